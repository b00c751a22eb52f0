"""The blocks quantize kernel's tile arrangements (the ``qblocks`` setting): ``rows`` (a row's 4 MX blocks in 4
warps, each block's carrier bytes stored as one 32-byte run), ``rows16`` (stored as two 16-byte runs) and ``lanes``
(the pieces as [4, BR, 8]: a row's blocks in 4 lanes of one warp, 16-byte stores) write the same bytes, every output
and option: packed codes and scales against the reference quantizer, carriers, group scales and inexact counts
against ``rows``, in the single pass and in the dual pass's first side.

On CPU the kernels run in Triton's interpreter, which sees the index arithmetic of each arrangement but not its
registers and lanes; on a GPU the same tests run the compiled kernels (run them there before changing the
default, ``auto``: ``lanes`` but for a weight with random signs)."""

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
from mxtrain.numerics.hadamard import hadamard, rotation_signs  # noqa: E402
from mxtrain.numerics.quant import quantize as ref_quantize  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV),
                                reason="Triton kernels unavailable (set TRITON_INTERPRET=1 on CPU)")
FORMS = ("rows16", "lanes")
F32, BF16 = torch.float32, torch.bfloat16


def _data(M, K, seed, dtype):
    """Heavy-tailed values with blocks that the carrier cannot hold exactly (2**-20 below their row's largest),
    a row with NaN and one with an infinity."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.exp(2.0 * torch.randn(M, K, generator=g))
    x[:3, 32:64] *= 2.0**-20
    x[5, 7] = float("nan")
    x[9, 100] = float("inf")
    return x.to(dtype).to(DEV)


# (dtype, options of quantize_mxfp4_2d): rotations with and without signs (bf16 with 16: the normalization
# folded into the scales), stochastic rounding, prescale, the scale rules with a code path of their own
# (adaptive: a second pass over each block), 128x128 groups (a weight's), the uniform grids
CASES = [
    (BF16, dict(rot=0)),
    (BF16, dict(rot=16, signs=16)),
    (F32, dict(rot=32, signs=32, rounding="stochastic", prescale=0.75)),
    (F32, dict(rot=16, group_rows=128, scale_rule="rceil")),
    (BF16, dict(rot=8, scale_rule="adaptive")),
    (BF16, dict(rot=16, group_rows=128, scale_rule="adaptive", signs=16)),
    (BF16, dict(rot=16, fmt="mxint4")),
    (F32, dict(rot=32, signs=32, fmt="mxe1m2", rounding="stochastic")),
    (F32, dict(rot=4, prescale=0.75, fmt="mxe1m2")),
    (BF16, dict(rot=16, signs=16, rounding="stochastic", force_idx64=True)),   # 64-bit offsets
]


def _opts(case, seed):
    dtype, o = case
    o = dict(o)
    if o.get("signs"):
        o["signs"] = rotation_signs(o["signs"], "fixed", seed=seed, device=DEV)
    if o.get("rounding") == "stochastic":
        o["key"] = rng.stream_key(seed)
    return dtype, o


def _ref(x, o):
    """The reference quantizer's output along rows (the rotation first, as ``kq.quantize`` documents)."""
    t = x.to(F32)
    rot = o.get("rot", 0)
    if rot:
        t = hadamard(torch.nn.functional.pad(t, [0, (-t.shape[1]) % rot]), rot, axis=1, signs=o.get("signs"))
    return ref_quantize(t, o.get("fmt", "mxfp4"), axis=1, rounding=o.get("rounding", "nearest"),
                        scale_rule=o.get("scale_rule", "floor"), prescale=o.get("prescale", 1.0))


@pytest.fixture
def launches(monkeypatch):
    """The constexprs of every quantize launch made while the test runs (``ops.launch`` recorded, then run)."""
    log = []
    real = ops.launch

    def record(kern, kfn, grid, args, consts, *rest):
        log.append((kern, dict(consts)))
        return real(kern, kfn, grid, args, consts, *rest)
    monkeypatch.setattr(ops, "launch", record)
    return log


def test_each_form_sets_its_constexprs(launches):
    """``rows`` launches the variants made before the setting existed (neither constexpr passed); ``rows16`` the
    16-byte stores; ``lanes`` those and the blocks-first pieces; in the single pass and the dual kernel."""
    x = _data(32, 128, 0, BF16)
    want = {"rows": {}, "rows16": {"SPLIT16": True}, "lanes": {"SPLIT16": True, "BFIRST": True}}
    for form, w in want.items():
        with settings.override(qkernel="auto", qblocks=form, qselfcheck="off", fast_launch="off", dual="on"):
            launches.clear()
            kq.quantize_mxfp4_2d(x, 1, carrier=True, fp4=False)
            kq.quantize_mxfp4_dual(x, dict(rot=16), dict(rot=16))
        assert [k for k, _ in launches] == ["blocks", "dual"], launches
        (_, single), (_, dual) = launches
        assert {n: single[n] for n in ("BFIRST", "SPLIT16") if n in single} == w, form
        assert {n[:-2]: dual[n] for n in ("BFIRST_A", "SPLIT16_A") if n in dual} == w, form


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"case{i}")
def test_forms_write_the_same_bytes(case, form):
    """Codes and scales equal to the reference quantizer's (nearest rounding), and every output (carrier, group scales, the
    inexact count) equal to the ``rows`` arrangement's, for a ragged input (45 x 166: a ragged second tile,
    3 tiles of rows) and carrier padding to 256."""
    seed = 11 + case
    dtype, o = _opts(CASES[case], seed)
    x = _data(45, 166, seed, dtype)
    outs = {}
    for f in ("rows", form):
        with settings.override(qkernel="blocks", qblocks=f, qselfcheck="off"):
            outs[f] = kq.quantize_mxfp4_2d(x, 1, carrier=True, fp4=True, k_multiple=256, **o)
    got, base = outs[form], outs["rows"]
    # (kq.quantize: 1x32 blocks, no key; the reference rotates by 16 and more)
    if o.get("rounding") != "stochastic" and o.get("group_rows", 1) == 1 and o["rot"] in (0, 16, 32):
        with settings.override(qkernel="blocks", qblocks=form, qselfcheck="off"):
            q = kq.quantize(x, o.get("fmt", "mxfp4"), axis=1, scale_rule=o.get("scale_rule", "floor"),
                            prescale=o.get("prescale", 1.0), rotation=o["rot"], signs=o.get("signs"))
        ref = _ref(x, o)
        assert torch.equal(q.scales, ref.scales)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(got.carrier.view(torch.uint8), base.carrier.view(torch.uint8))
    for f in ("gscale", "inexact", "packed", "scales"):
        assert torch.equal(getattr(got, f), getattr(base, f)), f
    assert int(base.inexact.item()) > 0


@pytest.mark.parametrize("form", FORMS)
def test_forms_in_the_dual_pass(form):
    """The dual kernel's first side in each arrangement: both outputs equal to the two single passes (``rows``),
    with H16 and signs on both sides (an activation's), with 128x128 groups and stochastic rounding, and with one
    program a 128x128 block and 16-row A tiles."""
    x = _data(130, 140, 3, BF16)
    s16 = rotation_signs(16, "fixed", seed=4, device=DEV)
    for a, b, fp4_b, cfg in ((dict(rot=16, signs=s16), dict(rot=16, signs=s16), False, {}),
                             (dict(rot=32, rounding="stochastic", key=rng.stream_key(5)),
                              dict(rot=16, group_rows=128), True, {}),
                             # one program a 128x128 block (A tiles, then B), 16-row A tiles
                             (dict(rot=16, signs=s16), dict(rot=8), False,
                              dict(sequential=True, block_rows=(16, 128), num_warps=4))):
        with settings.override(qkernel="auto", qblocks="rows", qselfcheck="off"):
            want = [kq.quantize_mxfp4_2d(x, 1, carrier=True, k_multiple=128, **a),
                    kq.quantize_mxfp4_2d(x, 0, carrier=not fp4_b, fp4=fp4_b, k_multiple=128, **b)]
        with settings.override(qkernel="auto", qblocks=form, qselfcheck="off", dual="on"):
            with kq.record_launches() as log:
                got = kq.quantize_mxfp4_dual(x, a, b, k_multiple=128, fp4_b=fp4_b, **cfg)
        assert [e.kernel for e in log] == ["dual"]
        assert torch.equal(got[0].carrier.view(torch.uint8), want[0].carrier.view(torch.uint8))
        assert torch.equal(got[0].gscale, want[0].gscale)
        if fp4_b:
            assert torch.equal(got[1].packed, want[1].packed) and torch.equal(got[1].scales, want[1].scales)
        else:
            assert torch.equal(got[1].carrier.view(torch.uint8), want[1].carrier.view(torch.uint8))
        n = sum(int(w.inexact.item()) for w in want if w.inexact is not None)   # (none with packed codes)
        assert int(got[0].inexact.item()) == n and n > 0


def test_self_check_and_plans_key_on_the_form():
    """A variant checked or planned in one arrangement is not taken for another: the setting is part of the
    launch key that plans and self-check results are stored under."""
    keys = set()
    for form in ("rows", "rows16", "lanes"):
        with settings.override(qblocks=form):
            keys.add(settings.current().launch_key)
    assert len(keys) == 3
    assert launch.blocks_form("rows") == {} and launch.blocks_form("lanes", "_A") == {"SPLIT16_A": True,
                                                                                         "BFIRST_A": True}


def test_auto_takes_lanes_except_for_a_weight_with_signs():
    """The default (``auto``) launches ``lanes`` for every blocks-layout pass but one in 128x128 groups with random
    signs (a weight of ``-rht16`` / ``ufp4``), which keeps ``rows`` (it spills more in the others): read from the
    launch specs that the eager launch and the traced form both build."""
    assert settings.Settings().qblocks == "auto"   # the default (current() may carry MXTRAIN_QBLOCKS of the run)
    with settings.override(qblocks="auto"):
        st = settings.current()
    lanes, rows = {"SPLIT16": True, "BFIRST": True}, {}

    def single(dtype, group_rows, signs):
        spec = launch.single_spec((256, 512), (512, 1), dtype, torch.device(DEV), 1, rot=16, has_signs=signs,
                                  rounding="nearest", scale_rule="floor", prescale=1.0, index_strides=None,
                                  carrier=True, fp4=False, group_rows=group_rows, row_multiple=16, block_rows=None,
                                  num_warps=None, k_multiple=512, key_ptr=False, force_idx64=False, st=st)
        assert spec.kern == "blocks"
        return {k: v for k, v in spec.consts.items() if k in ("SPLIT16", "BFIRST")}
    assert single(BF16, 1, False) == lanes and single(BF16, 1, True) == lanes   # activations, with signs or not
    assert single(F32, 128, False) == lanes                                        # a weight without signs
    assert single(F32, 128, True) == rows                                          # a weight with random signs

    def dual(a, b):
        spec = launch.dual_spec((256, 512), 512, BF16, torch.device(DEV), a, b, k_multiple=512, block_rows=None,
                                num_warps=None, sequential=None, fp4_b=False, force_idx64=False, st=st)
        return {k: v for k, v in spec.consts.items() if k in ("SPLIT16_A", "BFIRST_A")}
    s16 = object()   # (the spec only asks whether signs are given)
    assert dual(dict(rot=16), dict(rot=16, group_rows=128)) == {"SPLIT16_A": True, "BFIRST_A": True}
    assert dual(dict(rot=16, signs=s16), dict(rot=16, signs=s16)) == {"SPLIT16_A": True, "BFIRST_A": True}
    assert dual(dict(rot=16, group_rows=128, signs=s16), dict(rot=16, group_rows=128, signs=s16)) == {}
    for form in ("rows", "rows16", "lanes"):   # a form set by hand is taken as it is
        assert launch.resolve_form(form, 128, True) == form


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", FORMS)
def test_cuda_forms_at_model_shapes(form):
    """On a GPU, where the arrangements differ in lanes, registers and stores: the 125M model's and the Hugging
    Face example's activation shapes (bf16, H16 with and without signs) and a float32 weight in 128x128 groups,
    single and dual passes, byte for byte against ``rows``; and no variant fails its self-check."""
    import warnings
    g = torch.Generator(device="cuda").manual_seed(7)
    s16 = rotation_signs(16, "fixed", seed=4, device="cuda")
    for (M, K), dtype, a, b in (((16384, 768), BF16, dict(rot=16), dict(rot=16)),
                                ((8192, 2816), BF16, dict(rot=16, signs=s16), dict(rot=16, signs=s16)),
                                ((2048, 1000), F32, dict(rot=16, group_rows=128), dict(rot=16, group_rows=128))):
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        outs = {}
        for f in ("rows", form):
            with settings.override(qblocks=f, dual="on"), warnings.catch_warnings():
                # (verify.py's warnings: a variant that fails its self-check, a dual pass that differs from two
                # single passes; either would be replaced by a correct fallback and pass unnoticed)
                warnings.filterwarnings("error", message=".*(failed its self-check|differed from two single).*")
                single = kq.quantize_mxfp4_2d(x, 1, carrier=True, fp4=False, k_multiple=512, **a)
                kq.quantize_mxfp4_dual(x, a, b, k_multiple=512)   # (the first call runs the self-checks)
                with kq.record_launches() as log:
                    dual = kq.quantize_mxfp4_dual(x, a, b, k_multiple=512)
                assert [e.kernel for e in log] == ["dual"], (f, M, K)
            outs[f] = (single, *dual)
        for p, q in zip(outs[form], outs["rows"]):
            assert torch.equal(p.carrier.view(torch.uint8), q.carrier.view(torch.uint8)), (M, K)
            assert torch.equal(p.gscale, q.gscale)
        assert int(outs[form][0].inexact.item()) == int(outs["rows"][0].inexact.item())
