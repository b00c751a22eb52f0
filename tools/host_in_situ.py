"""Where the host time of a compiled ``MXLinear`` goes: the layer eager and under ``torch.compile(fullgraph=True)``;
the fast path's three bodies (``fast.quantize_input``, ``fast.forward``, ``fast.backward``) timed inside the
compiled calls, with the frame-evaluation callback each one finds (and again with it switched off), then the same
bodies called directly in a loop with the arguments of the last compiled call (BENCHMARKS.md, "The host time of
the fast path, continued").

    python tools/host_in_situ.py OUT.json [RECIPE]
"""
import json, sys, time, collections
import torch

from _timing import per_call_us  # noqa: E402
from mxtrain.linear import fast
from mxtrain.bench.suite import fwd_bwd_call
from mxtrain.linear.module import MXLinear
import torch._C._dynamo.eval_frame as EF

recipe = sys.argv[2] if len(sys.argv) > 2 else "mxfp4-all-dh16"
dev = "cuda"
M, N, K = 256, 512, 512
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
gy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
lin = MXLinear(K, N, bias=False, device=dev, dtype=torch.bfloat16, recipe=recipe)
base = torch.nn.Linear(K, N, bias=False, device=dev, dtype=torch.bfloat16)
res = {}
res["eager_mx"] = per_call_us(fwd_bwd_call(lin, x, gy, True))
cm = torch.compile(lin, fullgraph=True)
cb = torch.compile(base, fullgraph=True)
res["compiled_bf16"] = per_call_us(fwd_bwd_call(cb, x, gy, False))
res["compiled_mx"] = per_call_us(fwd_bwd_call(cm, x, gy, True))

acc = collections.defaultdict(float); cnt = collections.Counter(); cbs = collections.Counter(); args = {}
orig = {n: getattr(fast, n) for n in ("quantize_input", "forward", "backward")}
MODE = {"off": False}
def wrap(n):
    f = orig[n]
    def w(*a, **k):
        prev = EF.get_eval_frame_callback()
        cbs[(n, type(prev).__name__, repr(prev)[:60])] += 1
        args[n] = (a, k)
        if MODE["off"]:
            p = EF.set_eval_frame(None)
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[n] += time.perf_counter() - t; cnt[n] += 1
            if MODE["off"]:
                EF.set_eval_frame(p)
    return w
for n in orig:
    setattr(fast, n, wrap(n))
f = fwd_bwd_call(cm, x, gy, True)


def bodies_in_place():
    """(us a compiled fwd+bwd with the wrappers, us a call of each body inside it)"""
    for _ in range(20):
        f()
    acc.clear()
    cnt.clear()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 200 * 1e6, {k: acc[k] / cnt[k] * 1e6 for k in acc}


res["compiled_mx_wrapped"], res["bodies_in_situ_us"] = bodies_in_place()
res["callbacks_seen"] = {str(k): v for k, v in cbs.items()}
MODE["off"] = True
res["compiled_mx_evalframe_off"], res["bodies_in_situ_evalframe_off_us"] = bodies_in_place()
MODE["off"] = False
for n in orig:
    setattr(fast, n, orig[n])
# the bodies called directly (eager, outside compile) with the arguments of the last compiled call
for n, (a, k) in args.items():
    def g(n=n, a=a, k=k):
        fast.clear_caches()
        return orig[n](*a, **k)
    res[f"direct_{n}_us"] = per_call_us(g)
print(json.dumps(res, indent=1))
json.dump(res, open(sys.argv[1], "w"), indent=1)
