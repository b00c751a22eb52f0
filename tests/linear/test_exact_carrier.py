"""The ``exact_carrier`` setting: on the FP8-carrier backend, a GEMM whose operands hold MXFP4 blocks the carrier
cannot represent (more than 14 binades under their group's largest) runs as the exact dequantize GEMM; the
others stay on the carrier. Runs the fast path's kernels through Triton's interpreter on CPU, with the
carrier GEMM computed as float math on the carrier's values (so its inexactness is kept), against the
reference MXLinear."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mxtrain.linear import fast
from mxtrain.numerics import recipes
from mxtrain import settings  # noqa: E402
from mxtrain.kernels import kernels_available  # noqa: E402
from mxtrain.linear.context import Ctx  # noqa: E402
from mxtrain.linear import reference as _ref_linear  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not kernels_available(torch.device("cpu")),
                                reason="CPU emulation of the carrier GEMM (Triton's interpreter)")


@pytest.fixture
def carrier_cpu(monkeypatch):
    """The FP8-carrier backend on CPU: the carrier GEMM multiplies the carrier's values (codes dropped), the
    exact GEMM decodes the FP4 codes. Yields the list of backends the GEMMs ran."""
    from mxtrain.kernels import gemm as kg
    real, used = kg.mx_gemm_nt, []

    def gemm(a, b, backend, *r):
        used.append(backend)
        if backend == "fp8_carrier":
            a, b = (dataclasses.replace(q, packed=None, scales=None) for q in (a, b))
        return real(a, b, "dequant", *r)
    monkeypatch.setattr(kg, "mx_gemm_nt", gemm)
    monkeypatch.setattr(kg, "activation_b_group_rows", lambda dev: 1)
    with settings.override(gemm_backend="fp8_carrier", qselfcheck="off"):
        fast.clear_caches()
        yield used


def _data(spread: bool):
    """X and W whose products come half from blocks 20 binades under their 128-group's largest (``spread``):
    X's blocks 1-3 of each row's first group are small, W's block 0 is small against its blocks 1-3."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 256, generator=g)
    w = torch.randn(40, 256, generator=g) / 16
    if spread:
        x[:, 32:128] *= 2.0 ** -20
        w[:, 32:128] *= 2.0 ** 20
    b = torch.randn(40, generator=g)
    gy = torch.randn(48, 40, generator=g)
    return x, w, b, gy


def _run(fn, rec, spread):
    x, w, b, gy = (t.clone().requires_grad_(i < 3) for i, t in enumerate(_data(spread)))
    y = fn(x, w, b, Ctx(rec, 1, 2, 0))
    y.backward(gy)
    return [t.detach() for t in (y, x.grad, w.grad)]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("preset", ["mxfp4-all", "mxfp4-all-dh16"])
def test_exact_mode_equals_reference_where_the_carrier_is_not(carrier_cpu, preset):
    rec = recipes.get(preset)
    ref = _run(_ref_linear.apply, rec, True)
    plain = _run(fast.apply, rec, True)
    assert _rel(plain[0], ref[0]) > 0.1          # the carrier alone loses the small blocks' products
    before = fast.inexact_by_tensor("cpu")
    carrier_cpu.clear()
    with settings.override(exact_carrier=True):
        got = _run(fast.apply, rec, True)
    for g, r in zip(got, ref):
        assert _rel(g, r) < 1e-5
    after = fast.inexact_by_tensor("cpu")
    assert after["x"] > before["x"] and after["w"] > before["w"]   # counted by tensor, as without the mode
    assert "dequant" in carrier_cpu


def test_exact_mode_keeps_the_carrier_where_it_is_exact(carrier_cpu):
    rec = recipes.get("mxfp4-all")
    ref = _run(_ref_linear.apply, rec, False)
    with settings.override(exact_carrier=True):
        got = _run(fast.apply, rec, False)
    for g, r in zip(got, ref):
        assert _rel(g, r) < 1e-5
    assert carrier_cpu == ["fp8_carrier"] * 3    # Fprop, Dgrad, Wgrad: no fallback needed


def test_exact_mode_is_recorded_as_a_numerics_setting():
    with settings.override(exact_carrier=True):
        d = settings.current().to_dict()
    assert d["exact_carrier"] is True
    f = {x.name: x for x in dataclasses.fields(settings.Settings)}["exact_carrier"]
    assert f.metadata.get("numerics")
