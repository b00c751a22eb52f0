"""How the cols quantize kernel spreads its tile over threads (the ``qcols`` setting): each of its 32 loads of
``[4, BR]`` values gives a thread 2 of them (``pairs``, the launches made before the setting existed) or 1
(``singles``: twice the warps for a single pass; in the dual pass half the B rows a program, or twice the warps for
128x128 groups). Both write the same bytes, every output and option, in the single pass and in the dual pass's
second side (and a weight's dual pass).

On CPU the kernels run in Triton's interpreter, which sees each choice's grid and index arithmetic (the dual pass's
32-row B tiles: four programs a 128x128 block) but not its threads and registers; on a GPU the same tests run the
compiled kernels, where ``singles`` converts one value per inline-PTX call (``PACK`` 1)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from mxtrain import settings  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels import mxfp4 as kq  # noqa: E402
from mxtrain.kernels.mxfp4 import launch, ops  # noqa: E402
from mxtrain.numerics import rng  # noqa: E402
from mxtrain.numerics.hadamard import rotation_signs  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV),
                                reason="Triton kernels unavailable (set TRITON_INTERPRET=1 on CPU)")
F32, BF16 = torch.float32, torch.bfloat16


def _data(M, K, seed, dtype):
    """Heavy-tailed values with blocks that the carrier cannot hold exactly (2**-20 below their group's largest),
    a NaN and an infinity."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(2.0 * torch.randn(M, K, generator=g))
    x[32:64, :3] *= 2.0**-20
    x[7, 5] = float("nan")
    x[100, 9] = float("inf")
    return x.to(dtype).to(DEV)


@pytest.fixture
def launches(monkeypatch):
    """The constexprs and warps of every quantize launch made while the test runs (``ops.launch`` recorded, then
    run)."""
    log = []
    real = ops.launch

    def record(kern, kfn, grid, args, consts, nw, *rest):
        log.append((kern, dict(consts), nw, grid))
        return real(kern, kfn, grid, args, consts, nw, *rest)
    monkeypatch.setattr(ops, "launch", record)
    return log


def test_each_choice_sets_its_launch(launches):
    """``pairs`` (and ``auto``) launch what was launched before the setting existed; ``singles`` the cols pass with
    twice the warps and one value a conversion, and the dual pass in ``launch.DUAL_CONFIG_SINGLES``."""
    x = _data(256, 128, 0, BF16)
    got = {}
    for choice in ("auto", "pairs", "singles"):
        with settings.override(qkernel="auto", qcols=choice, qselfcheck="off", fast_launch="off", dual="on"):
            launches.clear()
            kq.quantize_mxfp4_2d(x, 0, carrier=True, fp4=False)                    # activation along tokens
            kq.quantize_mxfp4_2d(x.float(), 0, carrier=True, group_rows=128)       # a weight's Dgrad operand
            kq.quantize_mxfp4_dual(x, dict(rot=16), dict(rot=16))                   # dY
            kq.quantize_mxfp4_dual(x, dict(rot=16), dict(rot=16, group_rows=128))  # the compiled layer's X
        assert [k for k, *_ in launches] == ["cols", "cols", "dual", "dual"], launches
        got[choice] = [(c.get("BR", c.get("BR_A")), c.get("BR_B"), nw, c.get("PACK", c.get("PACK_B")))
                       for _, c, nw, _ in launches]
    assert got["auto"] == got["pairs"] == [(64, None, 4, 2), (128, None, 8, 2), (32, 64, 4, 2), (64, 128, 8, 2)]
    assert got["singles"] == [(64, None, 8, 1), (128, None, 16, 1), (32, 32, 4, 1), (128, 128, 16, 1)]
    with settings.override(qcols="singles"):
        st = settings.current()
    assert launch.cols_values(st) == 1 and launch.dual_config(128, 128, st) == launch.W_DUAL_CONFIG_SINGLES
    assert launch.block_config("cols", 0, 1, True, cols_per_thread=1) == (32, 4)   # stochastic rounding: 32 rows


def test_self_check_and_plans_key_on_the_choice():
    """A variant checked or planned under one choice is not taken for the other: the setting is part of the launch
    key that plans and self-check results are stored under."""
    keys = set()
    for choice in ("pairs", "singles"):
        with settings.override(qcols=choice):
            keys.add(settings.current().launch_key)
    assert len(keys) == 2


# (dtype, options of quantize_mxfp4_2d along columns): rotations with and without signs (bf16 with 16: the
# normalization folded into the scales), stochastic rounding with a prescale, 128x128 groups with a scale rule of
# its own, the adaptive rule, the uniform grids
CASES = [
    (BF16, dict(rot=16, signs=16)),
    (F32, dict(rot=32, signs=32, rounding="stochastic", prescale=0.75)),
    (F32, dict(rot=16, group_rows=128, scale_rule="rceil")),
    (BF16, dict(rot=8, scale_rule="adaptive")),
    (BF16, dict(rot=16, fmt="mxint4")),
    (F32, dict(rot=4, prescale=0.75, fmt="mxe1m2")),
]


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"case{i}")
def test_singles_write_the_same_bytes_as_pairs(case):
    """The single cols pass along columns of a ragged input (166 x 45: a ragged last tile of rows, two 128-token
    ranges) writes the same carrier, group scales, inexact count, codes and scales under either choice."""
    seed = 21 + case
    dtype, o = CASES[case]
    o = dict(o)
    if o.get("signs"):
        o["signs"] = rotation_signs(o["signs"], "fixed", seed=seed, device=DEV)
    if o.get("rounding") == "stochastic":
        o["key"] = rng.stream_key(seed)
    x = _data(166, 45, seed, dtype)
    outs = {}
    for choice in ("pairs", "singles"):
        with settings.override(qkernel="auto", qcols=choice, qselfcheck="off"), kq.record_launches() as log:
            outs[choice] = kq.quantize_mxfp4_2d(x, 0, carrier=True, fp4=True, k_multiple=256, **o)
        assert [e.kernel for e in log] == ["cols"]
    got, base = outs["singles"], outs["pairs"]
    assert torch.equal(got.carrier.view(torch.uint8), base.carrier.view(torch.uint8))
    for f in ("gscale", "inexact", "packed", "scales"):
        assert torch.equal(getattr(got, f), getattr(base, f)), f
    assert int(base.inexact.item()) > 0


def test_singles_in_the_dual_pass():
    """The dual pass under ``singles``: both outputs equal to the two single passes under ``pairs``, for a
    gradient's operands (H16 and signs on both sides, 1x128 groups: 32-row B tiles, four a 128x128 block), the
    compiled layer's X (128x128 Wgrad groups as FP4 codes, stochastic rounding on A) and a weight's two operands
    (128x128 groups on both sides)."""
    x = _data(260, 140, 3, BF16)
    s16 = rotation_signs(16, "fixed", seed=4, device=DEV)
    for xx, a, b, fp4_b in ((x, dict(rot=16, signs=s16), dict(rot=16, signs=s16), False),
                            (x, dict(rot=32, rounding="stochastic", key=rng.stream_key(5)),
                             dict(rot=16, group_rows=128), True),
                            (x.float(), dict(rot=16, group_rows=128), dict(rot=16, group_rows=128), False)):
        with settings.override(qkernel="auto", qcols="pairs", qselfcheck="off"):
            want = [kq.quantize_mxfp4_2d(xx, 1, carrier=True, k_multiple=128, **a),
                    kq.quantize_mxfp4_2d(xx, 0, carrier=not fp4_b, fp4=fp4_b, k_multiple=128, **b)]
        with settings.override(qkernel="auto", qcols="singles", qselfcheck="off", dual="on"):
            with kq.record_launches() as log:
                got = kq.quantize_mxfp4_dual(xx, a, b, k_multiple=128, fp4_b=fp4_b)
        assert [e.kernel for e in log] == ["dual"]
        assert torch.equal(got[0].carrier.view(torch.uint8), want[0].carrier.view(torch.uint8))
        assert torch.equal(got[0].gscale, want[0].gscale)
        if fp4_b:
            assert torch.equal(got[1].packed, want[1].packed) and torch.equal(got[1].scales, want[1].scales)
        else:
            assert torch.equal(got[1].carrier.view(torch.uint8), want[1].carrier.view(torch.uint8))
            assert torch.equal(got[1].gscale, want[1].gscale)
        n = sum(int(w.inexact.item()) for w in want if w.inexact is not None)
        assert int(got[0].inexact.item()) == n


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_singles_at_model_shapes():
    """On a GPU, where the choices differ in threads, registers and the e4m3 conversion: the 125M model's and the
    Hugging Face example's activation shapes (bf16, H16 with and without signs) as the compiled layer quantizes
    them (dY: both carriers; X: 128x128 Wgrad groups as FP4 codes) and a float32 weight in 128x128 groups, single
    and dual passes, byte for byte against ``pairs``; and no variant fails its self-check."""
    import warnings
    g = torch.Generator(device="cuda").manual_seed(7)
    s16 = rotation_signs(16, "fixed", seed=4, device="cuda")
    for (M, K), dtype, a, b, fp4_b in (((16384, 768), BF16, dict(rot=16), dict(rot=16), False),
                                       ((16384, 2048), BF16, dict(rot=16), dict(rot=16, group_rows=128), True),
                                       ((8192, 2816), BF16, dict(rot=16, signs=s16), dict(rot=16, signs=s16), False),
                                       ((2048, 1000), F32, dict(rot=16, group_rows=128),
                                        dict(rot=16, group_rows=128), False)):
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        outs = {}
        for choice in ("pairs", "singles"):
            with settings.override(qcols=choice, dual="on"), warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*(failed its self-check|differed from two single).*")
                single = kq.quantize_mxfp4_2d(x, 0, carrier=not fp4_b, fp4=fp4_b, k_multiple=512, **b)
                kq.quantize_mxfp4_dual(x, a, b, k_multiple=512, fp4_b=fp4_b)   # (the first call self-checks)
                with kq.record_launches() as log:
                    dual = kq.quantize_mxfp4_dual(x, a, b, k_multiple=512, fp4_b=fp4_b)
                assert [e.kernel for e in log] == ["dual"], (choice, M, K)
            outs[choice] = (single, *dual)
        for i, (p, s) in enumerate(zip(outs["pairs"], outs["singles"])):
            for f in ("carrier", "gscale", "packed", "scales", "inexact"):
                u, v = getattr(p, f), getattr(s, f)
                assert (u is None) == (v is None), (M, K, i, f)
                if u is not None:
                    assert torch.equal(u.view(torch.uint8) if f == "carrier" else u,
                                       v.view(torch.uint8) if f == "carrier" else v), (M, K, i, f)
