"""The packed-MXFP4 GEMM kernel (mxtrain.kernels.mxdot) against float64 products of independently
decoded operands.

On CPU the portable variant (codes decoded in registers) runs in Triton's interpreter; on a GPU the
same tests run it compiled (bf16 tensor cores), and the ``cuda`` tests add the ``tl.dot_scaled``
variant (the FP4-native path; Hopper emulates it).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.kernels.mxdot import mx_dot_nt, supports_native  # noqa: E402
from mxtrain.kernels.mxfp4 import dequantize_fp4, quantize_mxfp4_2d  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not kernels_available(DEV), reason="Triton kernels unavailable")

# E2M1 magnitudes by code (OCP MX spec, Table: FP4 E2M1), written out here independently of the library
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _values(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 values of packed codes and E8M0 scales, decoded with Python arithmetic."""
    p = packed.cpu().to(torch.int64)
    codes = torch.stack((p & 15, p >> 4), -1).reshape(p.shape[0], -1)
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    v = torch.where(codes >= 8, -mag, mag)
    s = scales.cpu().to(torch.float64)
    sv = torch.where(s == 255, torch.full_like(s, float("nan")), torch.pow(2.0, s - 127))
    return v * sv.repeat_interleave(32, 1)


def _operands(R, K, seed, wide=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g)
    if wide:
        x = x * torch.exp(2 * torch.randn(R, K, generator=g))
    q = quantize_mxfp4_2d(x.to(DEV), 1, carrier=False, fp4=True)
    return q.packed, q.scales


def _check(c, pa, sa, pb, sb, divisor=1.0, out_dtype=torch.float32):
    va, vb = _values(pa, sa), _values(pb, sb)
    ref = va @ vb.t() / divisor
    bound = (va.abs() @ vb.abs().t()) / divisor * 2e-6 + 2.0**-126   # fp32 accumulation; underflow
    c = c.double().cpu()
    if out_dtype == torch.bfloat16:
        bound = bound + ref.abs() * 2.0**-7   # one bf16 rounding of the output (one ulp: the interpreter truncates)
    assert c.shape == ref.shape
    assert torch.isnan(c).equal(torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert ((c - ref).abs()[ok] <= bound[ok]).all(), ((c - ref).abs()[ok] / bound[ok]).max()


@pytest.mark.parametrize("Ra,Rb,K", [(67, 45, 96), (130, 33, 160), (5, 7, 1024)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_portable_matches_float64(Ra, Rb, K, out_dtype):
    pa, sa = _operands(Ra, K, 1, wide=True)
    pb, sb = _operands(Rb, K, 2)
    c = mx_dot_nt(pa, sa, pb, sb, out_dtype=out_dtype, divisor=16 / 9)
    assert c.dtype == out_dtype
    _check(c, pa, sa, pb, sb, 16 / 9, out_dtype)


def test_the_quantizers_dequantize_agrees_with_the_decode_here():
    pa, sa = _operands(9, 64, 3, wide=True)
    from mxtrain.kernels.mxfp4 import QuantOut
    q = QuantOut(9, 64, None, None, 1, None, pa, sa)
    assert torch.equal(dequantize_fp4(q).double().cpu(), _values(pa, sa))


def test_row_strided_views():
    pa, sa = _operands(80, 128, 4)
    pb, sb = _operands(40, 128, 5)
    a2, s2 = pa[::2], sa[::2]       # every other row: row stride 2x the row length
    assert not a2.is_contiguous()
    c = mx_dot_nt(a2, s2, pb, sb, out_dtype=torch.float32)
    _check(c, a2, s2, pb, sb)


def test_every_code_decodes_exactly():
    """A row holding all 16 codes (twice) against one-hot rows of B (code 2 = 1.0) returns each code's
    value times its block scale: the whole E2M1 table, both signs, at three scales."""
    codes = torch.arange(32, dtype=torch.uint8) % 16
    row = codes[0::2] | (codes[1::2] << 4)
    pa = row.repeat(3, 1).to(DEV)
    sa = torch.tensor([[127], [120], [131]], dtype=torch.uint8, device=DEV)
    eye = torch.zeros(32, 32, dtype=torch.uint8)
    eye[range(32), range(32)] = 2
    pb = (eye[:, 0::2] | (eye[:, 1::2] << 4)).contiguous().to(DEV)
    sb = torch.full((32, 1), 127, dtype=torch.uint8, device=DEV)
    c = mx_dot_nt(pa, sa, pb, sb, out_dtype=torch.float32).cpu().double()
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64).repeat(2)
    for r, e in enumerate((0, -7, 4)):
        assert torch.equal(c[r], table * 2.0**e), (r, c[r])


def test_scale_extremes_and_nan_blocks():
    """Scales 2^-127 (E8M0 code 0, a bf16/fp32 subnormal product) and 2^125 stay exact; code 255 (NaN)
    turns exactly the outputs that read that block into NaN."""
    K = 64
    g = torch.Generator().manual_seed(7)
    pa = torch.randint(0, 256, (6, K // 2), generator=g, dtype=torch.uint8)
    pb = torch.randint(0, 256, (5, K // 2), generator=g, dtype=torch.uint8)
    sa = torch.tensor([[0, 127], [250, 1], [127, 127], [255, 127], [10, 240], [127, 3]], dtype=torch.uint8)
    sb = torch.tensor([[120, 127], [0, 127], [121, 2], [100, 255], [110, 128]], dtype=torch.uint8)
    # sums stay below float32's 2^128 (scale codes of a pair add to < 372); products of two tiny
    # scales underflow float32 (allowed for by _check's absolute term)
    args = [t.to(DEV) for t in (pa, sa, pb, sb)]
    c = mx_dot_nt(*args, out_dtype=torch.float32)
    _check(c, *args)
    assert torch.isnan(c[3]).all() and torch.isnan(c[:, 3]).all()
    assert not torch.isnan(c[[0, 1, 2, 4, 5]][:, [0, 1, 2, 4]]).any()


def test_bad_inputs_are_clear_errors():
    pa, sa = _operands(4, 64, 1)
    pb, sb = _operands(4, 96, 2)
    with pytest.raises(ValueError, match="different lengths"):
        mx_dot_nt(pa, sa, pb, sb)
    with pytest.raises(ValueError, match="uint8"):
        mx_dot_nt(pa.to(torch.int32), sa, pa, sa)
    with pytest.raises(ValueError, match="scales of shape"):
        mx_dot_nt(pa, sa[:, :1], pa, sa)
    with pytest.raises(ValueError, match="out_dtype"):
        mx_dot_nt(pa, sa, pa, sa, out_dtype=torch.float16)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="needs a GPU"):
            mx_dot_nt(pa, sa, pa, sa, native=True)
        assert not supports_native("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dot_scaled_matches_float64_gpu(out_dtype):
    """tl.dot_scaled (the FP4-native instruction; emulated on Hopper) and the portable variant agree
    with float64 and with each other at a large, ragged shape."""
    pa, sa = _operands(1000, 1088, 11, wide=True)
    pb, sb = _operands(390, 1088, 12)
    cn = mx_dot_nt(pa, sa, pb, sb, out_dtype=out_dtype, native=True)
    cp = mx_dot_nt(pa, sa, pb, sb, out_dtype=out_dtype, native=False)
    _check(cn, pa, sa, pb, sb, out_dtype=out_dtype)
    _check(cp, pa, sa, pb, sb, out_dtype=out_dtype)


_COMPILE = textwrap.dedent(r"""
    import os, re
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from mxtrain.kernels.mxdot import _mx_dot_kernel as k

    def src(native):
        sig = {n: "*u8" for n in ("a_ptr", "as_ptr", "b_ptr", "bs_ptr")}
        sig["c_ptr"] = "*bf16"
        for n in ("Ra", "Rb", "sa_r", "ssa_r", "sb_r", "ssb_r", "sc_r"):
            sig[n] = "i32"
        sig["inv_div"] = "fp32"
        consts = dict(KB=2048, BM=128, BN=128, BK=128, NATIVE=native, FMT="e2m1", OUT_BF16=True,
                      DOT_DT=tl.bfloat16)
        sig.update({n: "constexpr" for n in consts})
        attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]]
                 for n in ("a_ptr", "as_ptr", "b_ptr", "bs_ptr", "c_ptr", "sa_r", "sb_r", "sc_r")}
        return ASTSource(k, sig, constexprs=consts, attrs=attrs)

    for tgt, native, key, pat in [
            (GPUTarget("cuda", 100, 32), True, "ptx", r"tcgen05\.mma[\w.:]*kind::mxf4"),
            (GPUTarget("hip", "gfx950", 64), True, "amdgcn", r"v_mfma_scale"),
            (GPUTarget("cuda", 90, 32), False, "ptx", r"wgmma\.mma_async[\w.]*bf16")]:
        c = triton.compile(src(native), target=tgt, options=dict(num_warps=8, num_stages=3))
        assert re.search(pat, c.asm[key]), (tgt, native, pat)
        print("ok", tgt.arch)
""")


@pytest.mark.skipif(DEV != "cpu", reason="the GPU tests run the kernel instead")
def test_native_variant_compiles_to_fp4_matrix_instructions():
    """No FP4 GPU here, so compile (not run) the kernel for them: the dot_scaled variant becomes the
    block-scaled FP4 MMA on sm_100 (tcgen05.mma kind::mxf4) and on gfx950 (v_mfma_scale); the portable
    variant becomes bf16 wgmma on sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["ok", "100", "ok", "gfx950", "ok", "90"], p.stdout


@pytest.mark.parametrize("hip,cap,native,want", [
    (None, (9, 0), False, "fp8_carrier"),     # H100 / H200
    (None, (10, 0), True, "native_mx"),       # B200
    (None, (12, 0), True, "native_mx"),       # RTX 50xx
    (None, (8, 0), False, "dequant"),         # A100
    ("6.4", (9, 5), True, "native_mx"),       # MI355X (gfx950)
    ("6.4", (9, 4), False, "dequant"),        # MI300X (gfx942)
    ("6.4", (9, 0), False, "dequant"),        # MI250X (gfx90a): not Hopper despite its (9, 0)
])
def test_backend_routes_by_vendor_and_capability(hip, cap, native, want, monkeypatch):
    import mxtrain.kernels as K
    import mxtrain.kernels.mxdot as mxd
    from mxtrain import settings
    monkeypatch.setattr(K, "capability", lambda d: cap)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mxd, "supports_native", lambda d: native)
    K.CACHES.native.clear()
    try:
        with settings.override(gemm_backend="auto"):
            assert K.backend("cuda:0") == want
        with settings.override(gemm_backend="dequant"):
            assert K.backend("cuda:0") == "dequant"
    finally:
        K.CACHES.native.clear()   # what the fake supports_native said must not outlive the test


@pytest.mark.parametrize("rows,cols", [(128, 4), (130, 5), (256, 36), (1, 1), (300, 9)])
def test_native_scale_layout_is_cublas_block_layout(rows, cols):
    """``gemm._to_blocked`` (the E8M0 scales of the native MX GEMM, ``_native_mx``) puts scale (i, j) where
    cuBLAS's block-scaling layout says: 128 x 4 tiles of the (rows, K/32) scale matrix, padded with zeros, stored
    tile after tile with the K tile index fastest, and within a tile entry (r, c) at (r % 32) * 16 + (r // 32) * 4
    + c (cuBLAS documentation, "1D Block Scaling Factors Layout"); written here element by element, not by the
    reshapes of the code under test."""
    from mxtrain.kernels.gemm import _to_blocked
    s = torch.arange(1, rows * cols + 1, dtype=torch.int32).reshape(rows, cols)
    out = _to_blocked(s)
    nr, nc = -(-rows // 128), -(-cols // 4)
    want = torch.zeros(nr * nc * 512, dtype=torch.int32)
    for i in range(rows):
        for j in range(cols):
            tile = (i // 128) * nc + j // 4
            r, c = i % 128, j % 4
            want[tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c] = s[i, j]
    assert torch.equal(out, want)


def test_the_native_gemm_probe_looks_at_every_element():
    """``gemm.exact_up_to_rounding``, the native MX GEMM probe's criterion: an output that is the exact product
    rounded to bf16 passes; one with a single block scale misread (one 32-value block of one row of A doubled)
    fails, although its error over the whole output is 0.37 % of the norm, under the 0.4 % norm tolerance
    the probe used before."""
    from mxtrain.kernels.gemm import exact_up_to_rounding
    g = torch.Generator().manual_seed(3)
    e2m1 = torch.tensor(E2M1 + [-v for v in E2M1[1:]], dtype=torch.float64)

    def mx(rows):   # E2M1 values times one power-of-two scale per block of 32
        v = e2m1[torch.randint(0, len(e2m1), (rows, 1088), generator=g)]
        return v * torch.exp2(torch.randint(-3, 4, (rows, 1088 // 32), generator=g).double()).repeat_interleave(32, 1)
    a, b = mx(256), mx(384)
    ref, mag = a @ b.t(), a.abs() @ b.abs().t()
    assert exact_up_to_rounding(ref.to(torch.bfloat16), ref, mag)[0]
    bad = a.clone()
    bad[17, 64:96] *= 2
    out = (bad @ b.t()).to(torch.bfloat16)
    norm_err = ((out.double() - ref).norm() / ref.norm()).item()
    assert norm_err < 4e-3                                       # the old criterion would have taken it as exact
    ok, worst = exact_up_to_rounding(out, ref, mag)
    assert not ok and worst > 10, worst
