"""One launch for several tensors' single passes (``_mxfp4_group_kernel``, ``ops.quantize_mxfp4_group``): each
tensor's carrier, group scales and inexact count equal to its own single pass's, for the weights of a model (float32,
128x128 groups, along K and along N, H16), activations (bf16, 1x128 groups), ragged shapes, more tensors than one
launch takes, and tensors of different variants (launched apart). On CPU the kernels run in Triton's interpreter."""

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

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV),
                                reason="Triton kernels unavailable (set TRITON_INTERPRET=1 on CPU)")


def _data(shape, seed, dtype=torch.float32):
    """Heavy-tailed values, a block 2**-20 below its group (inexact in the carrier), a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(2.0 * torch.randn(*shape, generator=g))
    x[:32, :64] *= 2.0**-20
    x[-1, -1] = float("nan")
    return x.to(dtype).to(DEV)


@pytest.fixture
def kernels(monkeypatch):
    """The kernel name of every quantize launch made while the test runs."""
    log = []
    real = ops.launch

    def record(kern, *a):
        log.append(kern)
        return real(kern, *a)
    monkeypatch.setattr(ops, "launch", record)
    return log


def _check(xs, axis, outs, **o):
    for x, got in zip(xs, outs):
        cnt = torch.zeros(1, dtype=torch.int32, device=DEV)
        want = kq.quantize_mxfp4_2d(x, axis, carrier=True, fp4=False, counter=cnt, **o)
        assert torch.equal(got.carrier.view(torch.uint8), want.carrier.view(torch.uint8)), (tuple(x.shape), axis)
        assert torch.equal(got.gscale, want.gscale), (tuple(x.shape), axis)
        assert (got.R, got.K, got.group_rows) == (want.R, want.K, want.group_rows)
        yield int(want.inexact.item())


@pytest.mark.parametrize("axis", (1, 0))
def test_weights_in_one_launch_equal_their_own_passes(axis, kernels):
    """Four float32 weights of a 125M-class block's shapes (scaled down: q|k|v, o, gate|up, down) with H16 in
    128x128 groups, one of them ragged: one launch along K (Fprop's operands, the blocks layout) or along N (Dgrad's,
    the cols layout), each output the bytes of its own pass, the inexact blocks of all four counted once each."""
    xs = [_data(s, i) for i, s in enumerate(((384, 128), (128, 128), (640, 128), (128, 300)))]
    o = dict(rot=16, group_rows=128, k_multiple=256)
    with settings.override(qselfcheck="off", fast_launch="off"):
        cnt = torch.zeros(1, dtype=torch.int32, device=DEV)
        outs = kq.quantize_mxfp4_group(xs, axis, counter=cnt, **o)
        assert kernels == ["group"]
        n = sum(_check(xs, axis, outs, **o))
    assert n > 0 and int(cnt.item()) == n


def test_more_tensors_than_one_launch_and_mixed_variants(kernels):
    """Six activations (bf16, 1x128 groups) of which five share a variant: two group launches for those five (4 + 1,
    ``GROUP_MAX``), and the sixth (float32: another variant) in its own single pass."""
    xs = [_data((48 + 16 * i, 160), 10 + i, torch.bfloat16) for i in range(5)] + [_data((64, 96), 20)]
    o = dict(rot=32, scale_rule="rceil", k_multiple=128)
    with settings.override(qselfcheck="off", fast_launch="off"):
        outs = kq.quantize_mxfp4_group(xs, 1, **o)
        assert sorted(kernels) == ["blocks", "group", "group"], kernels
        list(_check(xs, 1, outs, **o))


def test_group_spec_lays_the_members_tiles_end_to_end():
    """The grid is the members' tiles one after another; each slot's integers are its single pass's, then its
    reduction blocks and the end of its programs; unused slots repeat the first member's; a pass with packed codes
    is not groupable."""
    with settings.override(qselfcheck="off"):
        st = settings.current()
    dev = torch.device(DEV)

    def spec(shape, fp4=False):
        return launch.single_spec(shape, (shape[1], 1), torch.float32, dev, 1, rot=16, has_signs=False,
                                  rounding="nearest", scale_rule="floor", prescale=1.0, index_strides=None,
                                  carrier=True, fp4=fp4, group_rows=128, row_multiple=128, block_rows=None,
                                  num_warps=None, k_multiple=512, key_ptr=False, force_idx64=False, st=st)
    a, b = spec((256, 512)), spec((384, 1024))
    g = launch.group_spec([a, b])
    assert g.grid == (2 * 4 + 3 * 8,) and g.consts["G"] == 2
    assert g.ints[0] == (*a.ints, 4, 8) and g.ints[1] == (*b.ints, 8, 32) and g.ints[2] == g.ints[3] == g.ints[0]
    assert launch.group_key(spec((256, 512), fp4=True)) is None
    assert len(g.ints) == launch.GROUP_MAX
