"""``carrier_from_packed`` (Triton: FP4 codes + E8M0 scales -> FP8 carrier) against the fused quantizer's
own carrier and against ``carrier_from_fp4`` (plain PyTorch, the definition): same bytes, same group
scales (values and strides), same count of inexact blocks. On CPU the kernel runs in Triton's
interpreter."""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain import settings  # noqa: E402
from mxtrain.kernels import CACHES, kernels_available  # noqa: E402
from mxtrain.kernels import mxfp4 as kq  # noqa: E402
from mxtrain.kernels.expand import carrier_from_packed  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")


@pytest.fixture
def fresh_caches():
    """The kernels' caches (``mxtrain.kernels.CACHES``) empty for the test, and emptied after it."""
    CACHES.clear()
    yield CACHES
    CACHES.clear()


@pytest.fixture
def use():
    """``use(**fields)``: ``settings.override(**fields)`` until the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda **fields: stack.enter_context(settings.override(**fields))


def _wide(R, K, seed):
    """Values over ~60 binades (rows and 32-blocks scaled apart), so that some blocks sit more than 14
    binades below their group's largest (inexact in the carrier), with zeros and a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g)
    x *= torch.exp2(torch.randint(-30, 30, (R, 1), generator=g).float())
    x *= torch.exp2(torch.randint(-20, 4, (1, K), generator=g).float())
    x[:, 32:64] *= 2.0**-20   # a whole block far below its neighbours: inexact in 1x128 groups
    x[0, :40] = 0.0
    x[1, 5] = float("nan")
    return x.to(DEV)


@pytest.mark.parametrize("group_rows", [1, 128])
@pytest.mark.parametrize("axis", [1, 0])
# (several 1x128 and 128x128 groups both ways, ragged edges, K padding to 512 along either axis, and one
# aligned single tile; wider shapes only added interpreted programs doing the same)
@pytest.mark.parametrize("shape", [(40, 140), (130, 260), (16, 128)])
def test_carrier_from_packed_equals_fused_and_definition(group_rows, axis, shape):
    x = _wide(*shape, seed=sum(shape) + axis + group_rows)
    q = kq.quantize_mxfp4_2d(x, axis, carrier=True, fp4=True, group_rows=group_rows, k_multiple=512)
    n_fused = int(q.inexact.item())
    cnt = torch.zeros((1,), dtype=torch.int32, device=DEV)
    got = carrier_from_packed(kq.QuantOut(q.R, q.K, None, None, group_rows, None, q.packed, q.scales),
                              k_multiple=512, counter=cnt)
    assert got.carrier.shape == q.carrier.shape and got.gs_base.shape == q.gs_base.shape
    assert torch.equal(got.carrier.view(torch.uint8), q.carrier.view(torch.uint8))
    assert torch.equal(got.gscale, q.gscale) and got.gscale.stride() == q.gscale.stride()
    assert int(cnt.item()) == n_fused
    # and the plain-PyTorch definition
    ref = kq.QuantOut(q.R, q.K, None, None, group_rows, None, q.packed, q.scales)
    kq.carrier_from_fp4(ref, 512, 16)
    assert torch.equal(got.carrier.view(torch.uint8), ref.carrier.view(torch.uint8))
    assert torch.equal(got.gscale, ref.gscale)
    assert int(ref.inexact.item()) == int(cnt.item())


def test_some_blocks_are_inexact():
    """The data above does reach the inexact case (else the count comparison proves little)."""
    x = _wide(40, 300, seed=1)
    q = kq.quantize_mxfp4_2d(x, 1, carrier=False, fp4=True)
    got = carrier_from_packed(q, k_multiple=512)
    assert int(got.inexact.item()) > 0


def test_refuses_an_operand_without_codes():
    x = _wide(16, 128, seed=2)
    q = kq.quantize_mxfp4_2d(x, 1, carrier=True, fp4=False)
    with pytest.raises(ValueError, match="no packed FP4 codes"):
        carrier_from_packed(q)


def test_blocks_at_the_smallest_scale():
    """A block at scale 2**-127 counts as inexact under a large group exponent when it holds a non-zero
    code (its values are lost), not when every code rounded to zero (the carrier holds the zeros)."""
    x = torch.zeros(2, 128)
    x[:, 0] = 1.0
    x[0, 32:64] = 2.0**-126 * torch.linspace(0.1, 1.0, 32)   # scale 2**-127 (clamped), codes non-zero
    x[1, 32:64] = 1e-42                                          # scale 2**-127, every code 0
    q = kq.quantize_mxfp4_2d(x.to(DEV), 1, carrier=False, fp4=True)
    assert (q.scales[:, 1] == 0).all()
    from mxtrain.numerics.quant import unpack_fp4
    codes = unpack_fp4(q.packed)[:, 32:64] & 7
    assert codes[0].any() and not codes[1].any()
    got = carrier_from_packed(q)
    assert int(got.inexact.item()) == 1


def _signs(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=g) * 2 - 1).float().to(DEV)


FP4_B_CASES = [
    # (M, K, dtype, A options, B options, carrier K padding): several tiles of both operands (M and K past 128
    # where ragged: more than one 128 x 128 block of the dual grid both ways), whole tiles of K padding
    (128, 256, torch.bfloat16, dict(), dict(group_rows=128), 512),
    (130, 140, torch.float32, dict(rot=16, signs=_signs(16, 1)), dict(rot=16, signs=_signs(16, 2), group_rows=128), 512),
    (131, 129, torch.float32, dict(rounding="stochastic", key=11, prescale=0.75),
     dict(rot=32, rounding="stochastic", key=12, scale_rule="rceil"), 256),
    (96, 256, torch.bfloat16, dict(rot=8), dict(rot=4, signs=_signs(4, 3), group_rows=1, scale_rule="amd"), 128),
]


@pytest.mark.parametrize("case", range(len(FP4_B_CASES)))
def test_dual_pass_keeps_b_as_fp4_codes(case, fresh_caches, use):
    """The dual pass with ``fp4_b``: A is the carrier of the single pass, B the packed codes and scales of
    the single pass along columns; B's carrier rebuilt by ``carrier_from_packed`` is the carrier the dual
    pass writes without ``fp4_b`` (bytes, group scales, inexact count), also through a launch plan."""
    use(qselfcheck="off", dual="on", fast_launch="always")   # launch plans on the interpreter too
    M, K, dt, a, b, km = FP4_B_CASES[case]
    x = (_wide(M, K, seed=70 + case)).to(dt)
    x = torch.nan_to_num(x, nan=1.0)
    x[64:96, :2] *= 2.0**-20
    # this first (generic) launch also makes the launch plan replayed below (one dual pass fewer than
    # making it in a call of its own)
    got_a, got_b = kq.quantize_mxfp4_dual(x, a, b, k_multiple=km, fp4_b=True)
    assert got_b.carrier is None and got_b.group_rows == b.get("group_rows", 1)
    with settings.override(fast_launch="off"):   # the passes compared with: generic launches, no plans
        want_a = kq.quantize_mxfp4_2d(x, 1, **a, carrier=True, fp4=False, k_multiple=km)
        want_b = kq.quantize_mxfp4_2d(x, 0, **b, carrier=False, fp4=True, k_multiple=km)
        car_a, car_b = kq.quantize_mxfp4_dual(x, a, b, k_multiple=km)
    assert torch.equal(got_a.carrier.view(torch.uint8), want_a.carrier.view(torch.uint8))
    assert torch.equal(got_a.gscale, want_a.gscale)
    assert int(got_a.inexact.item()) == int(want_a.inexact.item())
    assert torch.equal(got_b.packed, want_b.packed) and torch.equal(got_b.scales, want_b.scales)
    cnt = torch.zeros((1,), dtype=torch.int32, device=DEV)
    rebuilt = carrier_from_packed(got_b, k_multiple=km, counter=cnt)
    assert torch.equal(rebuilt.carrier.view(torch.uint8), car_b.carrier.view(torch.uint8))
    assert torch.equal(rebuilt.gscale, car_b.gscale) and rebuilt.gscale.stride() == car_b.gscale.stride()
    assert int(cnt.item()) + int(want_a.inexact.item()) == int(car_a.inexact.item())
    # a launch plan replays the fp4_b variant (interpreted on CPU)
    assert len(fresh_caches.dual_plans) == 1
    with kq.record_launches() as log:
        pa, pb = kq.quantize_mxfp4_dual(x, a, b, k_multiple=km, fp4_b=True)
    assert log == [kq.Launch("dual", (M, K), True)]
    assert len(fresh_caches.dual_plans) == 1 and all(fresh_caches.dual_plans.values())
    assert torch.equal(pb.packed, want_b.packed) and torch.equal(pb.scales, want_b.scales)
    assert torch.equal(pa.carrier.view(torch.uint8), want_a.carrier.view(torch.uint8))


def test_dual_self_check_covers_fp4_b(fresh_caches, use):
    """The once-per-variant self-check compares the FP4 side with the single pass's codes and scales."""
    use(qselfcheck="always", dual="on")
    x = _wide(64, 160, seed=9).nan_to_num(nan=1.0).to(torch.bfloat16)
    kq.quantize_mxfp4_dual(x, dict(), dict(group_rows=128), fp4_b=True)
    verified = fresh_caches.dual_verified
    assert [k[-1] for k in verified] == [True] and list(verified.values()) == [True]


def test_carrier_rebuild_through_its_launch_plan(fresh_caches, use):
    """With launch plans on (the interpreter here, as GPUs by default) the first rebuild of a shape launches
    the kernel the generic way and keeps a plan (``CACHES.direct``); the next one, into new buffers, goes
    through that plan; both equal the rebuild without plans (bytes, group scales, inexact count). Another
    shape, with 128x128 groups, gets a plan of its own."""
    use(qselfcheck="off", fast_launch="always")
    group_rows = 1
    x = _wide(40, 140, seed=4)
    q = kq.quantize_mxfp4_2d(x, 1, carrier=False, fp4=True, group_rows=group_rows, k_multiple=512)

    def rebuild():
        cnt = torch.zeros((1,), dtype=torch.int32, device=DEV)
        return carrier_from_packed(q, k_multiple=512, counter=cnt), int(cnt.item())

    with settings.override(fast_launch="off"):
        want, want_n = rebuild()
    assert len(fresh_caches.direct) == 0 and want_n > 0
    first, n1 = rebuild()
    assert len(fresh_caches.direct) == 1
    (key, (run, rest)), = fresh_caches.direct.items()
    used = []
    fresh_caches.direct[key] = (lambda *a: (used.append(1), run(*a))[1], rest)
    second, n2 = rebuild()
    assert used == [1] and len(fresh_caches.direct) == 1
    for got, n in ((first, n1), (second, n2)):
        assert torch.equal(got.carrier.view(torch.uint8), want.carrier.view(torch.uint8))
        assert torch.equal(got.gscale, want.gscale) and got.gscale.stride() == want.gscale.stride()
        assert n == want_n
    other = kq.quantize_mxfp4_2d(_wide(40, 300, seed=5), 0, carrier=False, fp4=True, group_rows=128,
                                 k_multiple=512)
    with settings.override(fast_launch="off"):
        want_other = carrier_from_packed(other, k_multiple=512)
    got_other = carrier_from_packed(other, k_multiple=512)
    assert len(fresh_caches.direct) == 2 and used == [1]
    assert torch.equal(got_other.carrier.view(torch.uint8), want_other.carrier.view(torch.uint8))
    assert torch.equal(got_other.gscale, want_other.gscale)
