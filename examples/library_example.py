"""docs/library.md's example: a Hugging Face Llama converted with mxtrain, trained in a plain loop with
torch.compile and fused AdamW (byte-level language model on Python source: the standard library's
.py files of the interpreter that runs this), against the same loop in BF16.

    python examples/library_example.py --recipes bf16,mxfp4-all-dh16 --steps 300 --out result.json

Prints the loss every 50 steps, the held-out loss, tokens/s and peak GPU memory per recipe. A recipe may carry
mxtrain settings for its run after colons, e.g. ``mxfp4-all-dh16:mx_compiled=separate`` (docs/settings.md). The
arms ``torchao-tensorwise`` and ``torchao-rowwise`` train the same layers with torchao's float8 training instead
(the peer a user would pick; with torchao installed, the default arms include ``torchao-tensorwise``).
``--host-check`` adds, after the held-out loss, the host's time to issue one step against the GPU's busy time a
step: where the first is the larger, the loop is bound by the host (try ``--cpp-wrapper`` or ``--compile
reduce-overhead``). ``--cpp-wrapper`` compiles every arm with inductor's C++ wrapper
(``torch._inductor.config.cpp_wrapper``: the code that runs each compiled graph is C++, not Python; it needs a C++
compiler, as inductor does on CPU).
"""

import argparse
import glob
import json
import statistics
import sysconfig
import time

import torch
import transformers

import mxtrain
from mxtrain import settings


def corpus(max_bytes: int) -> torch.Tensor:
    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/**/*.py", recursive=True))
    buf = bytearray()
    for f in files:
        with open(f, "rb") as fh:
            buf += fh.read()
        if len(buf) >= max_bytes:
            break
    return torch.frombuffer(buf[:max_bytes], dtype=torch.uint8).long()


TORCHAO = ("torchao-tensorwise", "torchao-rowwise")
SKIP = "lm_head"   # (the layer both conversions keep in high precision: mxtrain's recipes skip it by name)


def has_torchao() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def parse_arm(arm: str) -> tuple[str, dict]:
    """``recipe:key=value:key=value`` -> the recipe and the settings for its run, checked before any GPU work."""
    recipe, *pairs = arm.split(":")
    if recipe in TORCHAO:
        if not has_torchao():
            raise SystemExit(f"--recipes: {arm!r} needs torchao (pip install torchao)")
    else:
        try:
            mxtrain.recipes.get(recipe)
        except ValueError as e:
            raise SystemExit(f"--recipes: {e}")
    over = {}
    for p in pairs:
        key, eq, value = p.partition("=")
        if not eq:
            raise SystemExit(f"--recipes: {arm!r}: settings after ':' are key=value pairs, got {p!r}")
        over[key.strip()] = value.strip()
    try:
        with settings.override(**over):
            pass
    except settings.SettingsError as e:
        raise SystemExit(f"--recipes: {arm!r}: {e}")
    return recipe, over


def run(arm: str, data: torch.Tensor, steps: int, B: int, T: int, compile_mode: str | None,
        host_check: bool = False, cpp_wrapper: bool = False) -> dict:
    """One arm: a recipe, with the settings given after it for its whole run; ``cpp_wrapper``: compiled with
    inductor's C++ wrapper (the arm's first step compiles it, inside the patch)."""
    recipe, over = parse_arm(arm)
    with settings.override(**over), torch._inductor.config.patch(cpp_wrapper=cpp_wrapper):
        return _run(arm, recipe, data, steps, B, T, compile_mode, host_check)


def convert_arm(model: torch.nn.Module, recipe: str) -> tuple[int, float]:
    """Convert ``model`` in place for the arm: mxtrain's recipe, or torchao's float8 training for a ``torchao-*``
    arm, on the same layers (every linear layer but ``lm_head``). Returns the layers converted and their share
    of the parameters."""
    if recipe not in TORCHAO:
        report = mxtrain.convert(model, recipe)
        print(report, flush=True)
        return len(report.converted), report.share
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    before = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe.split("-", 1)[1]),
                               module_filter_fn=lambda m, fqn: fqn != SKIP)
    done = [m for n, m in model.named_modules() if n in before and type(m).__name__ == "Float8Linear"]
    share = sum(m.weight.numel() + (m.bias.numel() if m.bias is not None else 0) for m in done)
    share /= sum(p.numel() for p in model.parameters())
    print(f"torchao float8 ({recipe}): {len(done)} layers converted, {share:.1%} of parameters", flush=True)
    return len(done), share


def host_and_gpu_ms(one_step, n: int = 10) -> tuple[float, float]:
    """The host's time to issue one step (median of ``n``; the GPU idle at its start, nothing waited for inside)
    and the GPU's busy time a step (its kernels' times summed under ``torch.profiler``, over ``n`` steps)."""
    host = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        one_step()
        host.append(1e3 * (time.perf_counter() - t))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            one_step()
        torch.cuda.synchronize()
    # (the GPU's own events only: kernels, copies, fills; with CPU activity off no host event carries their time)
    gpu_us = sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return statistics.median(host), gpu_us / 1e3 / n


def _run(arm: str, recipe: str, data: torch.Tensor, steps: int, B: int, T: int, compile_mode: str | None,
         host_check: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                   num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=T)
    model = transformers.LlamaForCausalLM(cfg).cuda()
    n_layers, share = convert_arm(model, recipe)
    train, val = data[: int(0.95 * len(data))], data[int(0.95 * len(data)):]
    # --- the loop of docs/library.md ----------------------------------------------------------
    step_fn = torch.compile(model, mode=compile_mode) if compile_mode != "none" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)

    def train_step() -> torch.Tensor:
        i = torch.randint(len(train) - T - 1, (B,), generator=g)
        x = torch.stack([train[j: j + T] for j in i.tolist()]).cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    losses, t0 = [], None
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        if step == 10:   # time after compilation
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = train_step()
        # no .item() a step (the host would wait for the GPU every step); a copy, because under reduce-overhead the
        # loss lives in CUDA graph memory that the next step overwrites
        losses.append(loss.detach().clone())
        if (step + 1) % 50 == 0:
            print(f"{arm} step {step + 1} loss {torch.stack(losses[-50:]).float().mean().item():.4f}", flush=True)
    # -----------------------------------------------------------------------------------------
    torch.cuda.synchronize()
    tps = (steps - 10) * B * T / (time.perf_counter() - t0)
    losses = torch.stack(losses).float().tolist()
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        vl = [model(input_ids=v.cuda(), labels=v.cuda()).loss.item()
              for v in val[: (len(val) // T) * T].view(-1, T).split(B)]
    out = {"recipe": arm, "layers_converted": n_layers, "converted_share": share,
           "loss_every_50": [sum(losses[k: k + 50]) / len(losses[k: k + 50]) for k in range(0, steps, 50)],
           "val_loss": sum(vl) / len(vl), "tokens_per_s": tps,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    if host_check:   # (after the held-out loss: these steps train the model further)
        model.train()
        out["host_ms"], out["gpu_busy_ms"] = host_and_gpu_ms(train_step)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", default="bf16,torchao-tensorwise,mxfp4-all-dh16" if has_torchao()
                    else "bf16,mxfp4-all-dh16")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--compile", default="default", help="torch.compile mode, or 'none'")
    ap.add_argument("--mb", type=int, default=24, help="corpus size in MB")
    ap.add_argument("--out", default=None)
    ap.add_argument("--host-check", action="store_true",
                    help="also the host's time to issue a step against the GPU's busy time a step")
    ap.add_argument("--cpp-wrapper", action="store_true",
                    help="compile every arm with inductor's C++ wrapper (less host time a step)")
    a = ap.parse_args()
    for arm in a.recipes.split(","):
        parse_arm(arm)
    if a.cpp_wrapper:
        # inductor builds the wrapper with this compiler: none found is one line, before any arm
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
        except ImportError:   # (a torch that keeps the lookup elsewhere: inductor says it itself)
            get_cpp_compiler = None
        try:
            if get_cpp_compiler is not None:
                get_cpp_compiler()
        except Exception:
            raise SystemExit("--cpp-wrapper needs a C++ compiler (g++ or clang++, or the one CXX names); none found")
        # the C++ wrapper loads kernels through the CUDA driver in autograd's thread, which may have no CUDA context
        # bound yet (torch's issue #144609): one small eager backward on the GPU first binds it
        x = torch.ones(8, device="cuda", requires_grad=True)
        (x * 2.0).sum().backward()
    torch.set_float32_matmul_precision("high")
    data = corpus(a.mb * 2**20)
    print(f"corpus: {len(data):,} bytes of Python standard library source", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
           "steps": a.steps, "batch": a.batch, "seq": a.seq, "compile": a.compile, "cpp_wrapper": a.cpp_wrapper,
           "corpus_bytes": len(data),
           "runs": [run(r, data, a.steps, a.batch, a.seq, None if a.compile == "default" else a.compile,
                        a.host_check, a.cpp_wrapper) for r in a.recipes.split(",")]}
    for r in res["runs"]:
        print(f"{r['recipe']}: val loss {r['val_loss']:.4f}, {r['tokens_per_s']:,.0f} tok/s, peak {r['peak_gib']:.1f} GiB",
              flush=True)
        if "host_ms" in r:
            host = r["host_ms"] > r["gpu_busy_ms"]
            hint = (" (less host time a step: --cpp-wrapper, --compile reduce-overhead, or a larger --batch)"
                    if host else "")
            print(f"  the host issues a step in {r['host_ms']:.1f} ms, the GPU is busy {r['gpu_busy_ms']:.1f} ms a "
                  f"step: bound by {'the host' if host else 'the GPU'}{hint}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
