"""Blockwise Hadamard rotations: the matrix, the transform, sign modes, GEMM invariance, fp32 bits."""

import math

import numpy as np
import pytest
import torch

import mxtrain
from mxtrain.numerics.hadamard import hadamard_matrix, rotation_signs

from numerics_helpers import assert_bitwise_equal

SIZES = (16, 32, 64, 128)


def sylvester(n: int) -> np.ndarray:
    """Independent definition: H[i, j] = (-1)**popcount(i & j) / sqrt(n)."""
    i = np.arange(n)
    pc = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return np.where(pc % 2 == 0, 1.0, -1.0) / math.sqrt(n)


@pytest.mark.parametrize("n", [1, 2, 4, 8] + list(SIZES))
def test_hadamard_matrix_is_sylvester_and_orthogonal(n):
    h = hadamard_matrix(n)
    assert h.dtype == torch.float64
    np.testing.assert_allclose(h.numpy(), sylvester(n), rtol=0, atol=1e-15)
    np.testing.assert_allclose((h @ h.T).numpy(), np.eye(n), rtol=0, atol=1e-12)
    with pytest.raises(ValueError):
        hadamard_matrix(n + 3 if n > 1 else 3)


def block_rotation(n: int, size: int, signs) -> np.ndarray:
    """The (n, n) block-diagonal matrix R with x_rotated = x @ R along the axis."""
    blk = sylvester(size)
    R = np.zeros((n, n))
    s = np.ones(n) if signs is None else np.resize(np.asarray(signs, np.float64), n)
    for b in range(0, n, size):
        R[b:b + size, b:b + size] = np.diag(s[b:b + size]) @ blk
    return R


@pytest.mark.parametrize("size", SIZES)
def test_hadamard_equals_matrix_product_any_axis(size):
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(3, 2 * size, 5, dtype=torch.float64, generator=gen)
    signs_blk = torch.where(torch.rand(size, generator=gen) < 0.5, -1.0, 1.0)
    signs_axis = torch.where(torch.rand(2 * size, generator=gen) < 0.5, -1.0, 1.0)
    for signs in (None, signs_blk, signs_axis):
        R = block_rotation(2 * size, size, None if signs is None else signs.numpy())
        got = mxtrain.hadamard(x, size, axis=1, signs=signs)
        assert got.dtype == torch.float64 and got.shape == x.shape
        ref = np.einsum("akb,kj->ajb", x.numpy(), R)
        np.testing.assert_allclose(got.numpy(), ref, rtol=0, atol=1e-12)
        got_last = mxtrain.hadamard(x.transpose(1, 2), size, axis=-1, signs=signs)
        np.testing.assert_allclose(got_last.transpose(1, 2).numpy(), ref, rtol=0, atol=1e-12)
    y = torch.randn(2 * size, 4, dtype=torch.float64, generator=gen)
    np.testing.assert_allclose(mxtrain.hadamard(y, size, axis=0).numpy(),
                               block_rotation(2 * size, size, None).T @ y.numpy(), rtol=0, atol=1e-12)


def test_hadamard_rejects_bad_sizes_and_lengths():
    with pytest.raises(ValueError, match="16, 32, 64, 128"):
        mxtrain.hadamard(torch.randn(4, 8), 8)
    with pytest.raises(ValueError, match="multiple"):
        mxtrain.hadamard(torch.randn(4, 40), 32)
    with pytest.raises(ValueError, match="signs"):
        mxtrain.hadamard(torch.randn(4, 64), 32, signs=torch.ones(48))
    with pytest.raises(ValueError, match="valid modes"):
        rotation_signs(16, "per_token")


@pytest.mark.parametrize("mode", ["none", "fixed", "per_layer", "per_step"])
@pytest.mark.parametrize("size", SIZES)
def test_rotated_gemm_equals_unrotated_gemm(mode, size):
    # Both operands of a GEMM rotated along the reduction axis with the same signs: (A R)(B R)^T = A B^T.
    gen = torch.Generator().manual_seed(size)
    a = torch.randn(7, 2 * size, dtype=torch.float64, generator=gen)
    b = torch.randn(5, 2 * size, dtype=torch.float64, generator=gen)
    s = rotation_signs(size, mode, seed=3, layer=2, gemm=1, step=9)
    assert (s is None) == (mode == "none")
    ra, rb = mxtrain.hadamard(a, size, signs=s), mxtrain.hadamard(b, size, signs=s)
    assert not torch.allclose(ra, a)
    torch.testing.assert_close(ra @ rb.T, a @ b.T, rtol=0, atol=1e-12)
    # Dgrad / Wgrad orientation: rotate along axis 0 of both
    torch.testing.assert_close(mxtrain.hadamard(a.T, size, axis=0, signs=s).T @ mxtrain.hadamard(b.T, size, axis=0, signs=s),
                               a @ b.T, rtol=0, atol=1e-12)


def test_sign_modes_depend_on_the_right_things():
    def sg(mode, **kw):
        args = dict(seed=1, layer=0, gemm=0, step=0) | kw
        return rotation_signs(16, mode, **args)

    assert torch.equal(sg("fixed"), sg("fixed", layer=5, gemm=2, step=7))
    assert not torch.equal(sg("fixed"), sg("fixed", seed=2))
    assert torch.equal(sg("per_layer"), sg("per_layer", gemm=2, step=7))
    assert not torch.equal(sg("per_layer"), sg("per_layer", layer=1))
    assert not torch.equal(sg("per_step"), sg("per_step", step=1))
    assert not torch.equal(sg("per_step"), sg("per_step", gemm=1))
    assert not torch.equal(sg("per_step"), sg("per_step", layer=1))
    for mode in ("fixed", "per_layer", "per_step"):
        s = sg(mode)
        assert s.shape == (16,) and set(s.tolist()) == {-1.0, 1.0}
        assert torch.equal(s, sg(mode))  # deterministic


def fwht_numpy_fp32(x: np.ndarray, size: int, signs=None) -> np.ndarray:
    """The documented float32 arithmetic, written out: signs, stages h = 1, 2, ..., size/2 of
    (a, b) -> (a + b, a - b) on pairs (i, i + h) with bit h of i clear, then one multiply by
    float32(1/sqrt(size))."""
    y = x.astype(np.float32).copy()
    if signs is not None:
        y = y * np.resize(np.asarray(signs, np.float32), y.shape[-1])
    for base in range(0, y.shape[-1], size):
        h = 1
        while h < size:
            for i in range(base, base + size):
                if (i - base) & h:
                    continue
                a, b = y[..., i].copy(), y[..., i + h].copy()
                y[..., i], y[..., i + h] = a + b, a - b
            h *= 2
    return y * np.float32(1 / math.sqrt(size))


@pytest.mark.parametrize("size", SIZES)
def test_fp32_butterfly_is_bit_exact_and_deterministic(size):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 2 * size, generator=gen) * 2.0 ** torch.randint(-8, 8, (6, 2 * size), generator=gen)
    s = rotation_signs(size, "fixed", seed=4)
    got = mxtrain.hadamard(x, size, signs=s)
    assert got.dtype == torch.float32
    assert_bitwise_equal(got, fwht_numpy_fp32(x.numpy(), size, s.numpy()), f"H{size} fp32")
    assert torch.equal(got, mxtrain.hadamard(x.clone(), size, signs=s))
    assert torch.equal(mxtrain.hadamard(x.bfloat16(), size), mxtrain.hadamard(x.bfloat16().float(), size))


def test_fp32_bit_test_detects_a_different_stage_order():
    # The bit-exact test above has power: running the stages in reverse order (h = n/2 ... 1)
    # gives the same matrix but different float32 rounding on some inputs.
    size = 32
    x = torch.randn(64, size) * 2.0 ** torch.randint(-8, 8, (64, size))
    y = x.numpy().astype(np.float32).copy()
    h = size // 2
    while h >= 1:
        for i in range(size):
            if i & h:
                continue
            a, b = y[:, i].copy(), y[:, i + h].copy()
            y[:, i], y[:, i + h] = a + b, a - b
        h //= 2
    y = y * np.float32(1 / math.sqrt(size))
    np.testing.assert_allclose(y, fwht_numpy_fp32(x.numpy(), size), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(y, fwht_numpy_fp32(x.numpy(), size))
