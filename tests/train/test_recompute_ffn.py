"""``train.recompute_ffn`` (``train.parallel.apply_ac``, ``Block.ffn_checkpoint``): under torch.compile the feed-forward's linear outputs are made
again in the backward instead of kept. Outputs and gradients are bit-identical; what the forward keeps for the
backward shrinks by exactly the gate and up outputs."""

import pytest
import torch

import mxtrain
from mxtrain.model.llama import Block, ModelConfig, rope_tables
from mxtrain.train.parallel import apply_ac

CFG = ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=64)
# (on the GPU, shapes where the fast path's 128-row padding of small operands does not dominate)
GPU_CFG = ModelConfig(dim=512, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=1536, vocab_size=64)


def _run(recipe: str, recompute: bool, device="cpu", backend="aot_eager_decomp_partition"):
    torch.manual_seed(0)
    cfg = CFG if device == "cpu" else GPU_CFG
    blk = Block(cfg).to(device)
    if recipe != "bf16":
        mxtrain.convert(torch.nn.ModuleList([blk]), recipe)
    apply_ac(torch.nn.ModuleList([blk]), recompute_ffn=recompute)
    torch._dynamo.reset()
    f = torch.compile(blk, backend=backend, fullgraph=True)
    T = 32 if device == "cpu" else 256
    x = torch.randn(2, T, cfg.dim, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    cos, sin = rope_tables(cfg.head_dim, T, cfg.rope_theta, device)
    kept = []

    def pack(t):
        kept.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = f(x, cos, sin)
    y.backward(torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape))   # (dY independent of Y)
    return y.detach(), [x.grad] + [p.grad for p in blk.parameters()], sum(kept)


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4-all", "mxfp4-all-sr"])
def test_recompute_ffn_same_results_less_kept(recipe):
    y0, g0, kept0 = _run(recipe, False)
    y1, g1, kept1 = _run(recipe, True)
    assert torch.equal(y0, y1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert kept0 - kept1 == 2 * 2 * 32 * CFG.hidden_dim * 4   # the gate and up outputs (float32 on CPU)


def test_recompute_ffn_is_a_train_setting(tmp_path):
    from mxtrain.train import config as C
    cfg = C.TrainConfig()
    C.apply_override(cfg, "train.recompute_ffn=true")
    assert cfg.train.recompute_ffn is True


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recipe", ["bf16", "mxfp4-all-dh16", "mxfp4-all-sr"])
def test_recompute_ffn_gpu_fast_path(recipe):
    """On the GPU (the fast path's split ops, inductor): less kept; outputs and gradients agree to rounding.
    Not bit for bit here: inductor fuses the two graphs differently and may add the float32 residual stream
    in another order (outputs 1 float32 ulp apart on the H100); a last-bit change of a value that is then
    quantized to FP4 can move it to the neighbouring FP4 value, so gradients are compared in norm. Bit
    identity is tested on CPU above."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y0, g0, kept0 = _run(recipe, False, "cuda", "inductor")
        y1, g1, kept1 = _run(recipe, True, "cuda", "inductor")
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=2e-6)
    for a, b in zip(g0, g1):
        rel = ((a.float() - b.float()).norm() / a.float().norm().clamp_min(1e-30)).item()
        assert rel < 1e-2, rel
    assert kept1 < kept0
