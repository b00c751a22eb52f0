"""``mxtrain bench limits``: the step's FLOPs equal torch's own count, the quantize bytes equal a count made
from the converted model's actual linear calls, and the command prints its table (no GPU needed)."""

import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import mxtrain
from mxtrain import settings
from mxtrain.numerics import recipes
from mxtrain.bench.limits import Rates, flops, limits, quantize_bytes
from mxtrain.model.llama import Llama, ModelConfig

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=96, max_seq_len=32)


def test_flops_equal_torch_flop_counter():
    """Linear layers and head, forward + backward: exactly torch.utils.flop_counter's matrix-product count;
    attention: the explicit (non-causal) products counted by torch, halved for the causal mask, forward
    plus a backward of 2.5x."""
    torch.manual_seed(0)
    m = Llama(CFG)
    idx = torch.randint(0, CFG.vocab_size, (2, 17))
    with FlopCounterMode(display=False) as fc:
        m(idx[:, :-1], idx[:, 1:]).backward()
    counted = sum(fc.get_flop_counts()["Global"].values())
    f = flops(CFG, 2, 16)
    assert f["linear"] + f["head"] == counted
    q = torch.randn(2, CFG.n_heads, 16, CFG.head_dim)
    with FlopCounterMode(display=False) as fa:
        (q @ q.transpose(-1, -2)).softmax(-1) @ q
    assert f["attention"] == sum(fa.get_flop_counts()["Global"].values()) / 2 * 3.5 * CFG.n_layers


# a feed-forward wider than ``wgrad_x=auto``'s carrier limit (2,048 inputs): w2's X goes ``forward``, the rest
# ``carrier``
WIDE = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=2112, vocab_size=96, max_seq_len=32)


@pytest.mark.parametrize("wgrad_x", ["auto", "carrier", "forward", "backward"])
@pytest.mark.parametrize("preset", ["mxfp4-all-dh16", "mxfp4-fprop", "mxfp4-bwd", "tseng", "bf16"])
def test_quantize_bytes_equal_a_count_of_the_model_calls(preset, wgrad_x):
    """An independent count from the converted model: each distinct input tensor of the MX layers (layers
    reading one input share it), each layer's output gradient and each weight, with the bytes the FP8-carrier
    path reads and writes for the recipe's MXFP4 operands, X's Wgrad operand where ``wgrad_x`` puts it (written
    out here per placement; ``auto`` by the input's width against 2,048)."""
    cfg = WIDE if wgrad_x == "auto" else CFG
    torch.manual_seed(0)
    m = Llama(cfg)
    mxtrain.convert(m, preset)
    r = recipes.get(preset)
    mx = lambda n: r.operand(n).fmt == "mxfp4"   # noqa: E731
    car, codes = 1 + 4 / 128, 0.5 + 1 / 32
    fx, wx = mx("fprop_x"), mx("wgrad_x") and mx("wgrad_dy")
    gd = mx("dgrad_dy") and mx("dgrad_w")
    n_w = int(mx("fprop_x") and mx("fprop_w")) + int(gd)
    seen, expect = {}, {"activations": 0.0, "wgrad_rebuild": 0.0, "grads": 0.0, "weights": 0.0}
    layers = [mod for name, mod in m.named_modules() if name.startswith("layers.") and isinstance(mod, torch.nn.Linear)]
    assert len(layers) == 7 * cfg.n_layers
    wides = []

    def hook(mod, inp, out):
        x = inp[0]
        if x.data_ptr() not in seen:   # the tensor is kept below, so no later input can reuse its memory
            seen[x.data_ptr()] = x
            where = wgrad_x if wgrad_x != "auto" else ("carrier" if x.shape[-1] <= 2048 else "forward")
            wides.append(where)
            n = x.numel()
            if fx:
                expect["activations"] += n * (2 + car)          # one read, the Fprop carrier
            if wx and where == "carrier":
                expect["activations"] += n * (car if fx else 2 + car)
            if wx and where == "forward":
                expect["activations"] += n * (codes if fx else 2 + codes)
                expect["wgrad_rebuild"] += n * (codes + car)
            if wx and where == "backward":
                expect["activations"] += n * (2 + car)          # read again in the backward
        if gd or wx:
            expect["grads"] += out.numel() * (2 + car * (int(gd) + int(wx)))
        expect["weights"] += mod.weight.numel() * (4 + car) * n_w

    hs = [mod.register_forward_hook(hook) for mod in layers]
    with torch.no_grad():
        m(torch.randint(0, cfg.vocab_size, (2, 16)))
    for h in hs:
        h.remove()
    if wgrad_x == "auto":
        assert wides.count("forward") == cfg.n_layers and wides.count("carrier") == 3 * cfg.n_layers
    with settings.override(wgrad_x=wgrad_x):
        got = quantize_bytes(r, cfg, 2, 16)
    assert got == pytest.approx(expect, rel=1e-12)
    assert (sum(got.values()) == 0) == (preset == "bf16")
    assert (got["wgrad_rebuild"] > 0) == (wx and (wgrad_x == "forward" or wgrad_x == "auto"))


def test_ceilings_follow_the_rates():
    """Faster GEMMs lower a quantized recipe's ceiling and leave BF16's at the measured step; zero other time
    when the measured step is exactly the counted parts."""
    rates = Rates()
    base = limits(CFG, 2, 16, ["bf16", "mxfp4-all-dh16"], rates, bf16_step_ms=10.0)
    assert base["recipes"]["bf16"]["ceiling_ms"] == pytest.approx(10.0)
    fast = limits(CFG, 2, 16, ["mxfp4-all-dh16"], Rates(mx_carrier_tflops=2 * rates.mx_carrier_tflops),
                  bf16_step_ms=10.0)
    assert fast["recipes"]["mxfp4-all-dh16"]["ceiling_ms"] < base["recipes"]["mxfp4-all-dh16"]["ceiling_ms"]
    r = base["recipes"]["mxfp4-all-dh16"]
    assert r["ceiling_ms"] == pytest.approx(base["other_ms"] + r["linear_gemm_ms"] + base["head_ms"]
                                            + base["attention_ms"] + r["quantize_ms"])


def test_cli_prints_table_and_refuses_bad_rates(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mxtrain", "bench", "limits", "--bf16-step-ms", "257.5",
                        "--out", str(tmp_path / "l.json")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "mxfp4-all-dh16" in p.stdout and "torchao-tensorwise" in p.stdout and (tmp_path / "l.json").exists()
    p = subprocess.run([sys.executable, "-m", "mxtrain", "bench", "limits", "--rates", "bf16_tflops=-1"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "positive" in p.stderr
    for ms in ("-1", "1", "nan"):   # a BF16 step shorter than its own counted GEMMs: no negative ceilings printed
        p = subprocess.run([sys.executable, "-m", "mxtrain", "bench", "limits", "--bf16-step-ms", ms],
                           capture_output=True, text=True)
        assert p.returncode == 2 and p.stdout == "" and p.stderr.strip().count("\n") == 0, (ms, p.stdout, p.stderr)
        assert p.stderr.startswith(f"mxtrain: error: --bf16-step-ms {ms} is shorter than"), p.stderr


@pytest.mark.parametrize("preset", ["fp8", "nvfp4"])
def test_reference_recipe_bytes_equal_a_count_of_the_model_calls(preset):
    """``fp8`` and ``nvfp4`` (every layer quantizes its own input): a count from the converted model's linear
    calls (their inputs, outputs and weights) with the per-element bytes of each recipe's passes equals
    ``reference_bytes``; MXFP4 presets and BF16 have none (``quantize_bytes`` counts those)."""
    from mxtrain.bench.limits import reference_bytes
    from mxtrain.linear.module import MXLinear
    cfg4 = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=96, max_seq_len=32)
    torch.manual_seed(0)
    m = Llama(cfg4)
    mxtrain.convert(m, preset, skip=())   # nvfp4 keeps its first and last block in BF16: 2 of 4 converted
    expect = {"activations": 0.0, "grads": 0.0, "weights": 0.0, "outputs": 0.0}
    if preset == "fp8":
        bx, bdy, bw, out_x, out_y, out_w = 7, 7, 20, 0, 0, 0
    else:   # every operand 2+2+2 (amax read, kernel read, bf16 write; the Wgrad operands' H16 inside both passes)
        bx, bdy, bw, out_x, out_y, out_w = 6 + 6, 6 + 6, 2 * (4 + 4 + 2), 16, 16, 8
    layers = [mod for name, mod in m.named_modules() if name.startswith("layers.") and isinstance(mod, MXLinear)]
    assert len(layers) == 7 * (4 if preset == "fp8" else 2)

    def hook(mod, inp, out):
        expect["activations"] += inp[0].numel() * bx
        expect["grads"] += out.numel() * bdy
        expect["weights"] += mod.weight.numel() * bw
        expect["outputs"] += inp[0].numel() * out_x + out.numel() * out_y + mod.weight.numel() * out_w

    hs = [mod.register_forward_hook(hook) for mod in layers]
    with torch.no_grad():
        m(torch.randint(0, CFG.vocab_size, (2, 16)))
    for h in hs:
        h.remove()
    assert reference_bytes(recipes.get(preset), cfg4, 2, 16) == pytest.approx(expect, rel=1e-12)
    assert reference_bytes(recipes.get("mxfp4-all-dh16"), cfg4, 2, 16) is None
    if preset == "nvfp4":   # a rotation the kernel does not fuse (H32) goes through float32 in torch: 2+4, 8, 4+4+2
        import dataclasses
        from mxtrain.numerics.recipe import Rotation
        r32 = dataclasses.replace(recipes.get("nvfp4"), wgrad_rotation=Rotation(32, "fixed"))
        b = reference_bytes(r32, cfg4, 2, 16)
        assert b["activations"] == pytest.approx(expect["activations"] * (6 + 24) / 12, rel=1e-12)
        assert b["grads"] == pytest.approx(expect["grads"] * (6 + 24) / 12, rel=1e-12)
        assert b["weights"] == pytest.approx(expect["weights"], rel=1e-12)
    assert reference_bytes(recipes.get("bf16"), cfg4, 2, 16) is None
    res = limits(cfg4, 2, 16, ["bf16", preset], Rates(), bf16_step_ms=10.0)
    assert res["recipes"][preset]["quantize_bytes"] == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("args,says", [
    (["limits", "--steps", "5"], "--steps is an option of bench step, not of bench limits"),
    (["limits", "--warmup", "3"], "--warmup is an option of bench step, not of bench limits"),
    (["limits", "--variants", "bf16"], "--variants is an option of bench step, not of bench limits"),
    (["limits", "--filter", ""], "--filter is an option of bench quantize, not of bench limits"),
    (["limits", "--glue", "eager"], "--glue is an option of bench blocks, not of bench limits"),
    (["limits", "--recompute-ffn"], "--recompute-ffn is an option of bench step, not of bench limits"),
    (["limits", "--profile"], "--profile is an option of bench step, blocks and host, not of bench limits"),
    (["quantize,gemm", "--rates", "bf16_tflops=1"], "--rates is an option of bench limits, not of bench quantize,gemm"),
    (["step", "--presets", "tseng", "--variants", "bf16"], "bench step times exactly the --variants"),
    (["limits,step"], "bench limits runs alone"),
])
def test_an_option_the_benchmark_does_not_take_is_refused(args, says):
    """#47: ``bench limits --steps 5`` (and every other option of another benchmark) was silently ignored; now
    one line naming the benchmarks that take it, before any GPU is asked for."""
    from train_helpers import one_line_error, run_main
    one_line_error(run_main("bench", *args), says)


def _gemm_flops(model, idx, targets):
    """Matrix-product FLOPs of one forward + backward of ``model`` (attention's own kernels left out)."""
    with FlopCounterMode(display=False) as fc:
        model(idx, targets).backward()
    return sum(v for op, v in fc.get_flop_counts()["Global"].items() if "mm" in str(op))


@pytest.mark.parametrize("model", ["125m-fused", "8b-fused", "hf-95m"])
def test_limits_counts_the_models_written_outside_mxtrain_from_their_own_shapes(model):
    """``bench limits --model`` for the fused-projection and Hugging Face models counts the GEMMs the built
    model runs: one block of it (``layers=1``), forward + backward, against torch's own FLOP count."""
    from mxtrain.bench.step import _build, counted_config
    if model == "hf-95m":
        pytest.importorskip("transformers")
    cfg = counted_config(model)
    m = _build(model, 1, 8, "cpu")
    idx = torch.randint(0, cfg.vocab_size, (1, 8))
    f = flops(cfg, 1, 8, layers=1)
    assert _gemm_flops(m, idx, idx) == f["linear"] + f["head"]


@pytest.mark.parametrize("gpus", [2, 4])
def test_fsdp_traffic_equals_the_collectives_fsdp2_issues(gpus):
    """``fsdp_traffic`` against the collectives FSDP2 itself issues for one forward + backward of the model as the
    trainer shards it (``train.parallel.apply_fsdp2``, bf16 gathers, float32 reduce-scatter), recorded at the
    dispatcher in one process over torch's fake process group of ``gpus`` ranks: the bytes each rank receives,
    ``(gpus - 1) / gpus`` of every gathered or reduced tensor."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from mxtrain.bench.limits import fsdp_traffic
    from mxtrain.train.parallel import DistEnv, apply_fsdp2

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.got = {"all_gather": 0.0, "reduce_scatter": 0.0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name.startswith("c10d._allgather_base_"):       # (output: the whole tensor, input: this shard)
                self.got["all_gather"] += args[0].numel() * args[0].element_size() * (gpus - 1) / gpus
            elif name.startswith("c10d._reduce_scatter_base_"):  # (output: this shard, input: the whole tensor)
                self.got["reduce_scatter"] += args[1].numel() * args[1].element_size() * (gpus - 1) / gpus
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=gpus)
    try:
        torch.manual_seed(0)
        m = Llama(CFG)
        apply_fsdp2(m, DistEnv(rank=0, world_size=gpus, backend="fake"), param_dtype=torch.bfloat16)
        idx = torch.randint(0, CFG.vocab_size, (2, 17))
        with Collectives() as log:
            m(idx[:, :-1], idx[:, 1:]).backward()
    finally:
        dist.destroy_process_group()
    want = fsdp_traffic(CFG, gpus)
    assert log.got["all_gather"] > 0 and log.got["reduce_scatter"] > 0
    assert want["all_gather_forward"] + want["all_gather_backward"] == pytest.approx(log.got["all_gather"], rel=1e-12)
    assert want["reduce_scatter"] == pytest.approx(log.got["reduce_scatter"], rel=1e-12)
    assert want["params"] == sum(p.numel() for p in Llama(CFG).parameters())


def test_fsdp_floor_and_its_options():
    """The floor a step keeps with none of the traffic overlapped, T / (T + traffic / link rate), for each
    recipe's ceiling and for a measured one-GPU step; the options refused where they mean nothing."""
    from mxtrain.bench.limits import fsdp_traffic
    from mxtrain.errors import UserError
    rates = Rates(link_gbs=100.0)
    res = limits(CFG, 4, 16, ["bf16", "mxfp4-all-dh16"], rates, bf16_step_ms=5.0, gpus=2, one_gpu_step_ms=4.0)
    comm = fsdp_traffic(CFG, 2)["total"] / 100e9 * 1e3
    assert res["fsdp"]["comm_ms"] == pytest.approx(comm)
    assert res["fsdp"]["floor_measured"] == pytest.approx(4.0 / (4.0 + comm))
    for r in res["recipes"].values():
        assert r["fsdp_floor"] == pytest.approx(r["ceiling_ms"] / (r["ceiling_ms"] + comm))
    assert "fsdp" not in limits(CFG, 4, 16, ["bf16"], rates, bf16_step_ms=5.0)
    with pytest.raises(UserError, match="--gpus"):
        limits(CFG, 4, 16, ["bf16"], rates, one_gpu_step_ms=4.0)
    for bad in (-5.0, 0.0, float("nan"), float("inf")):
        with pytest.raises(UserError, match="positive number of milliseconds"):
            limits(CFG, 4, 16, ["bf16"], rates, gpus=2, one_gpu_step_ms=bad)
    one = fsdp_traffic(CFG, 1)
    assert one["total"] == 0
    assert fsdp_traffic(CFG, 2, reshard_after_forward=False)["all_gather_backward"] == 0
