"""A whole model with a seeded recipe (stochastic rounding, random signs: ``tseng``) and its MX layers compiled into
the graph (``mx_compiled_seeded``) draws, step after step, the bits the custom ops draw: the per-step keys come from
device memory, so a compiled graph, and a CUDA graph replaying it, must see the step and call counters move.

The learning rate is 0 (the optimizer still steps, so the MX step advances as in training), so the weights never
change and every step's gradients are a function of the step's input and random bits only (``tseng``'s forward
is BF16; its randomness is in the backward GEMMs). The compiled layers' gradients must agree with the custom ops'
at every step (bit for bit layer by layer: tests/linear/test_compiledmx.py; the whole model's graphs differ around the
layers, so here within 1e-3 relative), while two draws of the bits differ by about 40 % (measured on the CPU
reference path: the same batch at step 0 and step 3): a compiled graph that froze its keys, or drew other bits
than the custom ops, fails by two orders of magnitude. The same batch fed at steps 1 and 4 must give gradients
that differ. GPU only (the compiled form is the FP8-carrier path of Hopper and later)."""
import logging

import pytest
import torch

import mxtrain
from mxtrain import settings


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from mxtrain.kernels import backend
    if backend("cuda") != "fp8_carrier":
        pytest.skip("needs FP8 tensor cores (the FP8-carrier GEMM)")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_seeded_compiled_model_draws_the_custom_ops_bits_every_step(mode, caplog):
    _gpu()
    from mxtrain.linear import COMPILED_FORMS, implementation
    from mxtrain.model.llama import Llama, ModelConfig
    with settings.override(mx_compiled_seeded=True):
        assert implementation("tseng", torch.zeros(64, 256, device="cuda"),
                              torch.zeros(128, 256, device="cuda")) == COMPILED_FORMS["graph"]
    grads = {}
    for kind in ("auto", "ops"):
        torch.manual_seed(0)
        m = Llama(ModelConfig.named("tiny", vocab_size=512)).cuda()
        mxtrain.convert(m, "tseng")
        f = torch.compile(m, mode=None if mode == "default" else mode)
        opt = torch.optim.AdamW(m.parameters(), lr=0.0, fused=True)
        g = torch.Generator(device="cuda").manual_seed(1)
        batches = [torch.randint(0, 512, (4, 129), device="cuda", generator=g) for _ in range(3)]
        out = []   # per step: every parameter's gradient, flattened
        torch._dynamo.reset()
        with caplog.at_level(logging.WARNING), settings.override(mx_compiled=kind, mx_compiled_seeded=True):
            for idx in batches + batches[:1]:   # the first batch again at step 4: other bits, other gradients
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = f(idx[:, :-1], idx[:, 1:])
                loss.backward()
                out.append(torch.cat([p.grad.float().flatten() for p in m.parameters() if p.grad is not None]))
                opt.step()
                opt.zero_grad(set_to_none=True)
        grads[kind] = out

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()
    for step, (a, b) in enumerate(zip(grads["auto"], grads["ops"])):
        assert rel(a, b) < 1e-3, (mode, step, rel(a, b))
    for kind in ("auto", "ops"):   # the counters moved: step 4 drew other bits for the same batch
        assert rel(grads[kind][3], grads[kind][0]) > 0.05, (mode, kind, rel(grads[kind][3], grads[kind][0]))
    assert "skipping cudagraphs" not in caplog.text
    assert "Recompiling" not in caplog.text
