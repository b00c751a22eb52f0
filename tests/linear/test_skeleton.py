"""The layer's one skeleton (``mxtrain.linear.skeleton``): its GEMMs, shapes, bias and dtypes against autograd's own
linear layer over a backend that quantizes nothing, what it asks each backend, and that every form of the layer runs
through it (an autograd function or a backend of ``mxtrain/linear`` that wrote its own GEMMs would fail here)."""

from __future__ import annotations

import ast
import os

import pytest
import torch
import torch.nn.functional as F

from mxtrain.linear import skeleton
from mxtrain.linear.skeleton import DGRAD, FPROP, WGRAD, Backend

LINEAR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "mxtrain", "linear")


class _Plain(Backend):
    """Multiplies the operands as they are, in float64, and records what the skeleton asked."""

    acc = torch.float64

    def __init__(self):
        self.calls, self.kept = [], None

    def start_forward(self, x2, weight, need_wgrad):
        self.calls.append(("start_forward", tuple(x2.shape), need_wgrad))

    def start_backward(self, dy2, weight, need):
        self.calls.append(("start_backward", tuple(dy2.shape), need))
        return dy2

    def gemm(self, g, a, b, final, dims):
        self.calls.append((g.name, final, dims))
        ta = a.double() if g.a_axis == 1 else a.double().t()
        tb = b.double() if g.b_axis == 1 else b.double().t()
        y = ta @ tb.t()
        assert tuple(y.shape) == dims[:2]
        return y


@pytest.mark.parametrize("shape,bias", [((5, 7), True), ((2, 3, 8), False), ((4, 1, 6), True)])
def test_skeleton_over_a_plain_backend_is_the_linear_layer(shape, bias):
    g = torch.Generator().manual_seed(0)
    N = 9
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(N, shape[-1], generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(N, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    gy = torch.randn(*shape[:-1], N, generator=g, dtype=torch.float64)
    want = F.linear(x, w, b)
    want_grads = torch.autograd.grad(want, [x, w] + ([b] if bias else []), gy)
    be = _Plain()
    y = skeleton.forward(be, x.detach(), w.detach(), None if b is None else b.detach(), torch.float64, True)
    dx, dw, db = skeleton.backward(be, gy, x.detach(), w.detach(), torch.float64, (True, True, bias))
    torch.testing.assert_close(y, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(dx, want_grads[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(dw, want_grads[1], rtol=0, atol=1e-12)
    if bias:
        torch.testing.assert_close(db, want_grads[2], rtol=0, atol=1e-12)
    else:
        assert db is None
    M, K = x.numel() // shape[-1], shape[-1]
    assert be.calls == [("start_forward", (M, K), True), ("fprop", None if bias else torch.float64, (M, N, K)),
                        ("start_backward", (M, N), (True, True, bias)), ("dgrad", torch.float64, (M, K, N)),
                        ("wgrad", torch.float64, (N, K, M))]


def test_final_dtypes_and_the_gemms_asked_for():
    """Fprop writes the output dtype itself only without a bias (the bias is added in ``acc`` first); Dgrad's final
    dtype is X's, Wgrad's the weight's; a GEMM the backward does not need is not run."""
    be = _Plain()
    x = torch.randn(6, 4, dtype=torch.bfloat16)
    w = torch.randn(3, 4, dtype=torch.float32)
    y = skeleton.forward(be, x, w, None, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and be.calls[-1] == ("fprop", torch.bfloat16, (6, 3, 4))
    be = _Plain()
    dx, dw, db = skeleton.backward(be, torch.randn(6, 3, dtype=torch.bfloat16), x, w, torch.bfloat16,
                                   (True, False, False))
    assert dx.dtype == torch.bfloat16 and dw is None and db is None
    assert [c[0] for c in be.calls] == ["start_backward", "dgrad"] and be.calls[-1][1] == torch.bfloat16
    be = _Plain()
    _, dw, _ = skeleton.backward(be, torch.randn(6, 3, dtype=torch.bfloat16), x, w, torch.bfloat16,
                                 (False, True, False))
    assert dw.dtype == torch.float32 and [c[0] for c in be.calls] == ["start_backward", "wgrad"]


def test_the_three_gemms_reduce_along_k_n_and_the_tokens():
    assert (FPROP.a, FPROP.a_axis, FPROP.b, FPROP.b_axis) == ("fprop_x", 1, "fprop_w", 1)
    assert (DGRAD.a, DGRAD.a_axis, DGRAD.b, DGRAD.b_axis) == ("dgrad_dy", 1, "dgrad_w", 0)
    assert (WGRAD.a, WGRAD.a_axis, WGRAD.b, WGRAD.b_axis) == ("wgrad_dy", 0, "wgrad_x", 0)


def _classes():
    for f in sorted(os.listdir(LINEAR)):
        if f.endswith(".py"):
            tree = ast.parse(open(os.path.join(LINEAR, f), encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    yield f, node


def _base_names(node: ast.ClassDef) -> set:
    return {ast.unparse(b) for b in node.bases}


def _calls(fn: ast.FunctionDef) -> set:
    return {ast.unparse(n.func) for n in ast.walk(fn) if isinstance(n, ast.Call)}


def test_every_form_of_the_layer_runs_through_the_skeleton():
    """Every autograd function in ``mxtrain/linear`` that computes the layer calls ``skeleton.forward`` in its
    forward and ``skeleton.backward`` in its backward, and the eager forms use ``skeleton.EagerLinear``; every
    backend subclasses ``skeleton.Backend``. (Autograd functions of the skeleton itself are the exception.)"""
    functions, backends = [], []
    for f, node in _classes():
        bases = _base_names(node)
        if any(b.endswith("autograd.Function") for b in bases) and f != "skeleton.py":
            functions.append(node.name)
            methods = {m.name: m for m in node.body if isinstance(m, ast.FunctionDef)}
            assert "skeleton.forward" in _calls(methods["forward"]), f"{f}: {node.name}.forward writes its own GEMMs"
            assert "skeleton.backward" in _calls(methods["backward"]), f"{f}: {node.name}.backward writes its own GEMMs"
        if node.name.endswith("Backend") and f != "skeleton.py":
            backends.append(node.name)
            assert bases & {"Backend", "skeleton.Backend"}, f"{f}: {node.name} is not a skeleton.Backend"
    assert sorted(functions) == ["_CompiledMXLinear", "_Grouped", "_TracedFP8Linear"]
    assert sorted(backends) == ["FastBackend", "RefBackend", "_ExpertBackend", "_FP8Backend", "_GraphBackend"]
    src = {f: open(os.path.join(LINEAR, f), encoding="utf-8").read() for f in ("reference.py", "fast.py")}
    assert all("skeleton.EagerLinear.apply" in s for s in src.values())


def test_the_bit_check_tool_runs_and_tells_a_changed_bit(tmp_path):
    """``tools/forms_bitcheck.py`` (the old-against-new check of every form) on one recipe on a CPU: a file compared
    with itself has no differing case, and one with a single bit flipped is named (exit status 1)."""
    import subprocess
    import sys
    tool = os.path.join(os.path.dirname(os.path.dirname(LINEAR)), "tools", "forms_bitcheck.py")
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, tool, str(a), "--quick", "--only", "mxfp4-all"], capture_output=True,
                       text=True, env=env, cwd=os.path.dirname(os.path.dirname(LINEAR)), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = torch.load(a)
    assert list(got) == ["reference/mxfp4-all/0"] and len(got["reference/mxfp4-all/0"]) == 8   # (y, dX, dW, db) x 2
    ok = subprocess.run([sys.executable, tool, "--compare", str(a), str(a)], capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0 and "1 cases, 0 differ" in ok.stdout
    t = got["reference/mxfp4-all/0"][0]
    t.view(torch.int32).view(-1)[0] ^= 1
    torch.save(got, b)
    bad = subprocess.run([sys.executable, tool, "--compare", str(a), str(b)], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1 and "1 differ" in bad.stdout and "reference/mxfp4-all/0" in bad.stdout, bad.stdout
