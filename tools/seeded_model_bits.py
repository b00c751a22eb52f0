"""Per-step gradients of a seeded recipe's whole model, run eagerly and compiled in each form and mode, each against
the first configuration given (GPU; a diagnosis of tests/linear/test_compiled_seeded_model.py).

The tiny Llama with ``tseng`` (stochastic rounding and random signs in the backward), learning rate 0, fused AdamW:
every step's gradients are a function of its batch and random bits only. A configuration is ``form:mode`` with form
``ops`` (the custom ops) or ``auto`` (compiled into the graph) and mode ``eager``, ``default`` or
``reduce-overhead`` (``ro-notrees``: CUDA graphs without cudagraph trees), for ``STEPS`` steps (3). Each
configuration runs in this process in the order given; its relative difference to the first one is printed as soon
as it has run, step by step, with the three parameters that differ most. ``SAVE=prefix``: each configuration's
gradients also go to ``prefix-FORM-MODE.pt``, to compare runs of separate processes.

    python3 tools/seeded_model_bits.py ops:eager ops:default auto:default ops:reduce-overhead auto:reduce-overhead

Stochastic rounding turns BF16-level differences of the code around the layers (another fusion, another order of a
sum) into a few % of the gradient, so only configurations whose glue is the same code are expected to agree within
1e-3; two draws of other bits differ by about 40 %.
"""
import os
import sys

import torch

import mxtrain
from mxtrain import settings
from mxtrain.model.llama import Llama, ModelConfig


def run(form: str, mode: str, steps: int, recipe: str) -> list[dict]:
    torch.manual_seed(0)
    m = Llama(ModelConfig.named("tiny", vocab_size=512)).cuda()
    mxtrain.convert(m, recipe)
    if mode == "ro-notrees":   # CUDA graphs without cudagraph trees (torch's older cudagraphify)
        torch._inductor.config.triton.cudagraph_trees = False
        mode = "reduce-overhead"
    else:
        torch._inductor.config.triton.cudagraph_trees = True
    f = m if mode == "eager" else torch.compile(m, mode=None if mode == "default" else mode)
    opt = torch.optim.AdamW(m.parameters(), lr=0.0, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    batches = [torch.randint(0, 512, (4, 129), device="cuda", generator=g) for _ in range(steps)]
    out = []
    torch._dynamo.reset()
    with settings.override(mx_compiled=form, mx_compiled_seeded=True):
        for idx in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = f(idx[:, :-1], idx[:, 1:])
            loss.backward()
            out.append({n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main(argv: list[str]) -> None:
    configs = [a.split(":") for a in argv if ":" in a] or [["ops", "eager"], ["ops", "reduce-overhead"],
                                                          ["auto", "reduce-overhead"]]
    ref = None
    for form, mode in configs:
        out = run(form, mode, steps=int(os.environ.get("STEPS", "3")), recipe="tseng")
        if os.environ.get("SAVE"):   # every step's gradients, for a comparison across processes
            torch.save(out, f"{os.environ['SAVE']}-{form}-{mode}.pt")
        if ref is None:
            ref = out
            print(f"{form}:{mode} is the reference", flush=True)
            continue
        for s, (a, b) in enumerate(zip(out, ref)):
            whole = rel(torch.cat([v.flatten() for v in a.values()]), torch.cat([v.flatten() for v in b.values()]))
            worst = sorted(((rel(a[n], b[n]), n) for n in b), reverse=True)[:3]
            print(f"{form}:{mode} step {s}: {whole:.4g} of the reference; most: "
                  + ", ".join(f"{n} {r:.3g}" for r, n in worst), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
