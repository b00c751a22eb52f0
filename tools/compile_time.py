"""Where the first compiled step's time goes: one training step of a ``bench step`` model under cProfile.

``python3 tools/compile_time.py [--model 125m] [--layers 2] [--top 40] [--out prof.json] [--cache-dir DIR]
VARIANT [VARIANT ...]``

Per variant: wall time of the first step (trace, compile, run), the time and count of two suspects
(Triton's kernel-access analysis that functionalization runs for every ``wrap_triton`` call, and Triton
compiles), dynamo's time per compile phase (``torch._dynamo.utils.compile_times``), the compile caches'
hits, misses and bypasses (inductor's FX graph cache, AOTAutograd's cache; with the bypass reasons torch logs),
the time inductor spends on user kernels' source text (``user_defined_triton_kernel_transitive_closure_source_code``,
memoized for mxtrain's kernels by ``kernels.access_cache``; ``--no-source-memo`` puts torch's own back), and the
cProfile table of the step sorted by cumulative and by own time. For a GPU (``--device cpu`` only tries the
tool itself).

``--cache-dir DIR``: inductor's and Triton's on-disk caches in DIR (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``), set before torch is imported: a new folder gives a cold first compile, and a second
process given the same folder shows what a later process pays (the workers of a study after the first: what
the caches save, and which graphs they bypass).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import sys
import time


def _timed(owner, name: str, box: dict):
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            box["calls"] += 1
            box["s"] += time.perf_counter() - t
    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, fn)


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize()


class _Bypasses(logging.Handler):
    """The reasons torch logs when a compile cache bypasses a graph."""

    LOGGERS = ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache")

    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Bypassing"):
            self.reasons.append(msg[:400])

    def __enter__(self):
        for name in self.LOGGERS:
            lg = logging.getLogger(name)
            self._levels = getattr(self, "_levels", []) + [(lg, lg.level, lg.propagate)]
            lg.setLevel(logging.INFO)
            lg.propagate = False   # (torch's handlers would print every INFO line of these modules)
            lg.addHandler(self)
        return self

    def __exit__(self, *exc):
        for lg, level, propagate in self._levels:
            lg.removeHandler(self)
            lg.setLevel(level)
            lg.propagate = propagate


def _source_memo(on: bool) -> None:
    """mxtrain's memo of inductor's kernel-source text on (as installed) or off (torch's own function)."""
    import torch._inductor.codegen.wrapper as wrapper

    from mxtrain.kernels import access_cache
    from mxtrain.kernels.mxfp4 import traced  # noqa: F401  (installs the access cache and the memo)
    fn = getattr(wrapper, access_cache._SOURCE)
    if not on and getattr(fn, "_mxtrain_cached", False):
        setattr(wrapper, access_cache._SOURCE, fn.__wrapped__)


def one(variant: str, model: str, layers: int, batch: int, seq: int, top: int, device: str = "cuda",
        source_memo: bool = True) -> dict:
    import torch
    import torch._dynamo.utils as dynamo_utils
    import torch._higher_order_ops.triton_kernel_wrap as tkw
    import torch._inductor.codegen.wrapper as inductor_wrapper

    from mxtrain.kernels import access_cache

    from mxtrain.bench import step as bench_step
    torch._dynamo.reset()
    dynamo_utils.counters.clear()                     # (this variant's cache counts and phase times only)
    dynamo_utils.compilation_time_metrics.clear()
    dev = torch.device(device)
    m = bench_step._build(model, layers, seq, dev)
    bench_step._convert(m, variant)
    f = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=dev.type == "cuda")
    idx = torch.randint(0, m.cfg.vocab_size, (batch, seq + 1), device=dev)
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    access = {"calls": 0, "s": 0.0}
    ttir = {"calls": 0, "s": 0.0}
    name = "identify_accessed_tensors" if hasattr(tkw, "identify_accessed_tensors") else "identify_mutated_tensors"
    source = {"calls": 0, "s": 0.0}
    _source_memo(source_memo)
    undo = [_timed(tkw, name, access), _timed(tkw, "generate_ttir", ttir),
            _timed(inductor_wrapper, access_cache._SOURCE, source)]
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with _Bypasses() as bypasses:
        prof.enable()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = f(x, y)
        loss.backward()
        opt.step()
        _sync(dev)
        prof.disable()
    first = time.perf_counter() - t0
    for u in undo:
        u()
    t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        loss = f(x, y)
    loss.backward()
    opt.step()
    _sync(dev)
    second = time.perf_counter() - t0
    from torch._dynamo.utils import compile_times, counters

    caches = {group: {k: v for k, v in counters[group].items() if "cache" in k or "bypass" in k}
              for group in ("inductor", "aot_autograd")}
    tables = {"access_cache": access_cache.stats(), "compile_times": compile_times(repr="str"), "caches": caches,
              "bypass_reasons": bypasses.reasons}
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(top)
        tables[key] = s.getvalue()
    return {"variant": variant, "model": model, "layers": layers, "first_step_s": first, "second_step_s": second,
            "kernel_access_analysis": access, "generate_ttir": ttir, "kernel_source": source,
            "source_memo": source_memo, "profile": tables}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+")
    p.add_argument("--model", default="125m")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out")
    p.add_argument("--device", default="cuda", help="(cpu: to try the tool itself; MX layers then take the "
                                                   "reference path)")
    p.add_argument("--cache-dir", help="inductor's and Triton's caches in this folder (made if missing)")
    p.add_argument("--no-source-memo", action="store_true",
                   help="torch's own kernel-source function instead of mxtrain's memo (to measure what it saves)")
    a = p.parse_args(argv)
    if a.cache_dir:   # (before torch is imported: ``one`` imports it)
        os.makedirs(a.cache_dir, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(a.cache_dir)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(os.path.abspath(a.cache_dir), "triton")
    res = []
    for v in a.variants:
        r = one(v, a.model, a.layers, a.batch, a.seq, a.top, a.device, not a.no_source_memo)
        print(f"{v}: first step {r['first_step_s']:.1f} s, second {r['second_step_s']:.3f} s, kernel-access "
              f"analysis {r['kernel_access_analysis']['calls']} calls {r['kernel_access_analysis']['s']:.1f} s, "
              f"of which TTIR {r['generate_ttir']['calls']} calls {r['generate_ttir']['s']:.1f} s",
              flush=True)
        print("access cache", r["profile"]["access_cache"], flush=True)
        print(f"kernel source text (memo {'on' if r['source_memo'] else 'off'}): {r['kernel_source']['calls']} "
              f"calls {r['kernel_source']['s']:.1f} s", flush=True)
        print("compile caches", json.dumps(r["profile"]["caches"]), flush=True)
        for reason in r["profile"]["bypass_reasons"]:
            print("  bypassed:", reason.splitlines()[0][:300], flush=True)
        print(r["profile"]["compile_times"][:3000], flush=True)
        print(r["profile"]["tottime"][:5000], flush=True)
        res.append(r)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
