"""The compiled MX layer's graphs as the compiler gets them on a Hopper GPU, checked on a CPU (issue #45).

The layer's forward and backward graphs (ATen level, functionalized, split by the min-cut partitioner inductor
uses) and dynamo's graph are captured in one child process on fake CUDA tensors, with the device probes answering
as an sm_90 GPU does (``compile_helpers.fake_hopper``, ``graph_cases``; how and why in compile_helpers.py); nothing
runs. The dispatcher's choice of form per recipe and device is asked in this process, on fake tensors, with the
probes monkeypatched.

What the design says a layer is (``mxtrain/linear/compiledmx.py``; every GEMM MXFP4, ``mxfp4-all`` or
``mxfp4-all-dh16``, the weight trained, the default ``wgrad_x=forward``): three GEMMs, Fprop ``Y = X W^T``, Dgrad
``dX = dY W`` and Wgrad ``dW = dY^T X``, each an FP8-carrier ``torch._scaled_mm`` of two MXFP4 operands.

* Forward: X's Fprop operand (along K, 1x128 groups) and its Wgrad operand (along M, kept as FP4 codes) from one
  read of X: one ``q_dual``, made outside the layer's autograd function (at the top of dynamo's graph, where
  ``mx_compiled=shared`` can merge it with another layer's); W's Fprop operand (along K, 128x128 groups): one
  ``q_single`` in the ``blocks`` layout; the Fprop GEMM: one ``_scaled_mm``.
* Backward: dY's Dgrad operand (along N) and Wgrad operand (along M) from one read: one ``q_dual``; W's Dgrad
  operand (along N): one ``q_single`` in the ``cols`` layout; X's Wgrad carrier rebuilt from the kept codes: one
  ``q_expand``; the Dgrad and Wgrad GEMMs: two ``_scaled_mm``.
* A layer: five quantize launches and three ``_scaled_mm``; no custom op of the eager path (``mxtrain::linear``,
  ``quantize_input``, ``linear_q``) left; no copy of X, W or dY (a launch that leaves an argument out makes torch
  treat every input as written and copy it first) and no clone at all.
* A block of ``mxtrain.model.Block`` (separate wq, wk, wv, wo, w1, w3, w2): seven layers, 35 launches and 21
  GEMMs. With ``mx_compiled=shared`` q/k/v read one input (the attention norm's output) and w1/w3 another (the
  FFN norm's): X's ``q_dual`` is made once for each of the four distinct inputs (7 - 2 - 1), and so is X's carrier
  rebuilt from its shared codes in the backward (``q_expand``); everything else is per layer (weights, dY), 29
  launches. The block of ``bench step``'s user model (fused q|k|v, gate|up): four
  layers reading four inputs, 20 launches, 12 GEMMs.

The backward's launches write inexact-block counters of their own (``fast.COUNTERS``): a counter both graphs
wrote would be finished in the forward by aot_autograd, which then ran W's Dgrad operand and X's carrier there and
kept their 1-byte carriers for the backward instead of X's FP4 codes (``test_the_backward_quantizes_in_the_backward``
failed so until that was changed).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from compile_helpers import GRAPH_SIZES, HOPPER_PROBE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHES_PER_LAYER = {"q_dual": 2, "q_single": 2, "q_expand": 1}
LAYOUTS_PER_LAYER = {"blocks": 1, "cols": 1}
GEMMS_PER_LAYER = 3
MX_CASES = ("linear mxfp4-all-dh16", "linear mxfp4-all", "block mxfp4-all-dh16 shared", "user block mxfp4-all")


def _child_graphs() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # (wrap_triton: real jitted kernels)
    code = "import sys; sys.path.insert(0, 'tests'); import compile_helpers as h; h.fake_hopper_main()"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """``compile_helpers.graph_cases()`` from one child process per test session (pytest-xdist's workers share it
    through a file in the session's temporary folder)."""
    import fcntl
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent   # (the session's folder, common to the workers)
    path = base / "fake-hopper-graphs.json"
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # (released when the file closes)
        if path.is_file():
            return json.loads(path.read_text())
        res = _child_graphs()
        path.write_text(json.dumps(res))
        return res


def _sum(*counts: dict) -> dict:
    out: dict = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return out


def _times(d: dict, n: int) -> dict:
    return {k: v * n for k, v in d.items()}


@pytest.mark.parametrize("case", ["linear mxfp4-all-dh16", "linear mxfp4-all"])
def test_a_layer_is_five_quantize_launches_and_three_gemms(graphs, case):
    """One MX layer, forward and backward (module docstring): X's dual pass at dynamo's top level, W's Fprop
    quantize in the autograd function's forward, dY's dual pass, W's Dgrad quantize and X's carrier in its
    backward; in the compiled graphs five launches and three ``_scaled_mm`` in all, X's dual pass, W's ``blocks``
    launch and the Fprop GEMM in the forward, dY's dual pass and the Dgrad and Wgrad GEMMs in the backward; no
    custom op of the eager path."""
    g = graphs[case]
    assert g["dynamo"] == {"top": {"q_dual": 1}, "fwd_body": {"q_single": 1},
                           "bwd_body": {"q_dual": 1, "q_single": 1, "q_expand": 1}}, g["dynamo"]
    fw, bw = g["fw"], g["bw"]
    assert _sum(fw["ops"], bw["ops"]) == LAUNCHES_PER_LAYER, (fw["ops"], bw["ops"])
    assert _sum(fw["q_single_layouts"], bw["q_single_layouts"]) == LAYOUTS_PER_LAYER
    assert fw["scaled_mm"] + bw["scaled_mm"] == GEMMS_PER_LAYER and (fw["scaled_mm"], bw["scaled_mm"]) == (1, 2)
    assert fw["ops"]["q_dual"] == 1 and fw["q_single_layouts"].get("blocks") == 1   # X's and W's Fprop operands
    assert bw["ops"].get("q_dual") == 1                                             # dY's two operands
    assert fw["mxtrain_ops"] == [] and bw["mxtrain_ops"] == []


@pytest.mark.parametrize("case", ["linear mxfp4-all-dh16"])
def test_the_backward_quantizes_in_the_backward(graphs, case):
    """The design (module docstring): the forward keeps X's Wgrad operand as FP4 codes and the backward
    quantizes W along N and rebuilds X's carrier from the codes, so the forward graph has two launches (X's
    dual pass, W's ``blocks``) and the backward three (dY's dual pass, W's ``cols``, ``q_expand``), and what the
    backward receives from the forward holds X's codes: uint8 (M, K / 2)."""
    from compile_helpers import GRAPH_SIZES
    g = graphs[case]
    assert g["fw"]["ops"] == {"q_dual": 1, "q_single": 1} and g["fw"]["q_single_layouts"] == {"blocks": 1}
    assert g["bw"]["ops"] == {"q_dual": 1, "q_single": 1, "q_expand": 1}
    M, K = GRAPH_SIZES["batch"] * GRAPH_SIZES["seq"], GRAPH_SIZES["dim"]
    assert ["uint8", [M, K // 2]] in [d for _, d in g["bw"]["inputs"]], g["bw"]["inputs"]


def test_the_default_keeps_a_narrow_layers_carrier(graphs):
    """``wgrad_x=auto`` (the default) at a width of at most ``settings.WGRAD_X_CARRIER_MAX`` input features: the
    forward keeps X's Wgrad operand as its FP8 carrier (e4m3, the reduction over tokens padded to 512) and the
    backward rebuilds nothing (four launches, no ``q_expand``), three GEMMs as before."""
    from compile_helpers import GRAPH_SIZES
    from mxtrain import settings
    assert GRAPH_SIZES["dim"] <= settings.WGRAD_X_CARRIER_MAX and settings.Settings().wgrad_x == "auto"
    g = graphs["linear mxfp4-all-dh16 auto"]
    assert g["fw"]["ops"] == {"q_dual": 1, "q_single": 1} and g["bw"]["ops"] == {"q_dual": 1, "q_single": 1}
    assert g["fw"]["scaled_mm"] + g["bw"]["scaled_mm"] == GEMMS_PER_LAYER
    M, K = GRAPH_SIZES["batch"] * GRAPH_SIZES["seq"], GRAPH_SIZES["dim"]
    kept = [d for _, d in g["bw"]["inputs"]]
    assert [d for d in kept if d and d[0] == "float8_e4m3fn"] == [["float8_e4m3fn", [-(-M // 512) * 512, K]]], kept
    assert ["uint8", [M, K // 2]] not in kept
    assert settings.Settings(wgrad_x="auto").wgrad_x_for(2048) == "carrier"
    assert settings.Settings(wgrad_x="auto").wgrad_x_for(4096) == "forward"
    assert settings.Settings(wgrad_x="forward").wgrad_x_for(64) == "forward"


def test_a_block_quantizes_a_shared_input_once(graphs):
    """``mxtrain.model.Block`` of ``mxfp4-all-dh16`` with ``mx_compiled=shared``: dynamo captures one X pass per
    layer (7); the share pass leaves one per distinct input (4: q/k/v share the attention norm's output, w1/w3
    the FFN norm's). Each layer's backward body asks for X's carrier from the shared codes (7 ``q_expand`` in
    dynamo's graph); the joint pass (``compiledmx.share_carriers``) leaves one launch per distinct input (4). The
    compiled graphs hold 29 launches (the 35 of seven layers less the three merged X passes and the three merged
    carriers: 4 + 7 dual passes, 7 ``blocks`` and 7 ``cols`` launches, 4 ``q_expand``) and 21 GEMMs, 7 in the
    forward and 14 in the backward; no custom op of the eager path."""
    g = graphs["block mxfp4-all-dh16 shared"]
    assert g["dynamo_captured"]["top"] == {"q_dual": 7}
    assert g["dynamo"]["top"] == {"q_dual": 4}
    assert g["dynamo"]["fwd_body"] == {"q_single": 7}
    assert g["dynamo"]["bwd_body"] == _times({"q_dual": 1, "q_single": 1, "q_expand": 1}, 7)
    fw, bw = g["fw"], g["bw"]
    assert fw["ops"]["q_dual"] == 4 and bw["ops"]["q_dual"] == 7
    assert bw["ops"]["q_expand"] == 4 and "q_expand" not in fw["ops"]    # (one X carrier per shared input)
    assert _sum(fw["ops"], bw["ops"]) == _sum(_times(LAUNCHES_PER_LAYER, 7), {"q_dual": -3, "q_expand": -3})
    assert _sum(fw["q_single_layouts"], bw["q_single_layouts"]) == _times(LAYOUTS_PER_LAYER, 7)
    assert (fw["scaled_mm"], bw["scaled_mm"]) == (7, 14) and fw["scaled_mm"] + bw["scaled_mm"] == 7 * GEMMS_PER_LAYER
    assert fw["mxtrain_ops"] == [] and bw["mxtrain_ops"] == []
    # what the backward receives holds X's codes, once per distinct input (not the carriers: they are made there)
    M, C = GRAPH_SIZES["batch"] * GRAPH_SIZES["seq"], GRAPH_SIZES["dim"]
    codes = [d for _, d in bw["inputs"] if d == ["uint8", [C, M // 2]]]
    assert len(codes) == 3, bw["inputs"]   # (q/k/v's and w1/w3's inputs: dim wide; wo's too; w2's is ffn wide)
    assert not any(d[0] == "uint8" and d[1][-1] % 512 == 0 for _, d in bw["inputs"] if d), bw["inputs"]


def test_recomputing_x_keeps_no_copy_of_it(graphs):
    """``wgrad_x=backward`` with ``wgrad_x_recompute`` (``compiledmx.recompute_wgrad_inputs``, the joint pass): in a
    ``mxtrain.model.Block`` the layers whose input an elementwise chain makes (q/k/v and w1/w3: the norms' outputs;
    w2: the SwiGLU product) have X and its backward quantize recomputed in the backward, so the forward hands the
    backward three tensors fewer of X's size or its carrier's (which of the two the partitioner keeps without the
    pass depends on the sizes: at Llama-8B shapes w2's carrier, here its bf16 X; tools/saved_bytes.py); wo's input
    (the attention output, made otherwise) is kept either way; the launches and GEMMs are the same in number."""
    M, C, F = GRAPH_SIZES["batch"] * GRAPH_SIZES["seq"], GRAPH_SIZES["dim"], GRAPH_SIZES["ffn"]
    plain, rec = graphs["block mxfp4-all-dh16 backward"], graphs["block mxfp4-all-dh16 backward recompute"]
    sizes = ([M, C], [M, F], [C, M], [F, M])

    def xs(g):   # (activations of X's size, in bf16 or as a 1-byte carrier; not the parameters, which live anyway)
        return [n for n, d in g["bw"]["inputs"] if d and not n.startswith("primals")
                and d[0] in ("bfloat16", "float8_e4m3fn") and d[1] in sizes and not n.startswith("_scaled_mm")]
    assert len(xs(plain)) - len(xs(rec)) == 3, (xs(plain), xs(rec))
    assert len(xs(rec)) == 1, xs(rec)   # (wo's input)
    assert _sum(plain["fw"]["ops"], plain["bw"]["ops"]) == _sum(rec["fw"]["ops"], rec["bw"]["ops"])
    assert plain["fw"]["scaled_mm"] + plain["bw"]["scaled_mm"] == rec["fw"]["scaled_mm"] + rec["bw"]["scaled_mm"]


def test_a_block_with_fused_projections(graphs):
    """A block of ``bench step``'s user model (``UserLlama``: fused q|k|v and gate|up, an ``nn.Linear`` subclass
    converted to ``mxfp4-all``): four layers, four inputs, nothing to share; 20 launches and 12 GEMMs."""
    g = graphs["user block mxfp4-all"]
    assert g["dynamo"]["top"] == {"q_dual": 4} == g["dynamo_captured"]["top"]
    fw, bw = g["fw"], g["bw"]
    assert _sum(fw["ops"], bw["ops"]) == _times(LAUNCHES_PER_LAYER, 4)
    assert _sum(fw["q_single_layouts"], bw["q_single_layouts"]) == _times(LAYOUTS_PER_LAYER, 4)
    assert (fw["scaled_mm"], bw["scaled_mm"]) == (4, 8) and fw["scaled_mm"] + bw["scaled_mm"] == 4 * GEMMS_PER_LAYER
    assert fw["mxtrain_ops"] == [] and bw["mxtrain_ops"] == []


@pytest.mark.parametrize("case", MX_CASES)
def test_no_input_is_copied(graphs, case):
    """No quantize launch makes functionalization copy a graph input other than the inexact-block counters (the
    one tensor the ops mutate: copied back, ``counter_copies``), no other ``copy_``; a layer adds no clone (none
    in a layer's graphs; in a block as many as the same block in BF16 has: its attention's own reshapes)."""
    g = graphs[case]
    for part in ("fw", "bw"):
        s = g[part]
        assert s["cloned_inputs"] == [] and s["copies"] == 0, (part, s)
        if case.startswith("linear"):
            assert s["clones"] == 0, (part, s)
        elif case.startswith("block"):
            assert s["clones"] == graphs["block bf16"][part]["clones"], (part, s)


# ---------------------------------------------------------------------------------------------- the dispatcher

RECIPES = ["bf16", "fp8", "nvfp4", "mxfp4-all", "mxfp4-all-dh16", "mxfp4-all-dh32", "mxfp4-fprop", "tseng",
           "mxfp4-all-sr"]


@pytest.fixture
def fake_gpu(monkeypatch):
    """Fake CUDA tensors on a GPU of the compute capability ``fake_gpu(cap)`` sets (default sm_90), the probes
    monkeypatched: ``kernels.capability``, ``gemm.probe`` (an H100's answer), ``torch.cuda.get_device_capability``;
    ``fast.state`` and the element tables it warms are this test's (the counters ``compiledmx.plan`` makes are
    fake tensors), and so are inductor's pre-grad pass and the kernels' device caches."""
    import mxtrain.kernels as MK
    from mxtrain.numerics import quant
    from mxtrain.kernels import CACHES, gemm
    from mxtrain.linear import fast
    from torch._inductor import config as ic
    from torch._subclasses.fake_tensor import FakeTensorMode
    cap = [(9, 0)]
    monkeypatch.setattr(MK, "capability", lambda d: cap[0] if torch.device(d).type == "cuda" else None)
    monkeypatch.setattr(gemm, "probe", lambda d: dict(HOPPER_PROBE))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap[0])
    monkeypatch.setattr(fast, "state", fast.FastState())
    monkeypatch.setattr(quant, "warm_elem_tables", lambda d: None)
    monkeypatch.setattr(fast, "warm_elem_tables", lambda d: None)   # (the name fast.py calls)
    CACHES.clear()

    def tensors(c=(9, 0)):   # (called in the fake mode: an input (256 tokens, K 256) and a weight (N 512))
        cap[0] = c
        CACHES.clear()
        return (torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16),
                torch.zeros(512, 256, device="cuda", dtype=torch.bfloat16))
    with ic.patch(pre_grad_custom_pass=None, joint_custom_pre_pass=None), FakeTensorMode():
        yield tensors
    CACHES.clear()


def _forms(x, w, recipes=RECIPES) -> dict:
    from mxtrain.linear import COMPILED_FORMS, implementation
    name = {v: k for k, v in COMPILED_FORMS.items()}
    return {r: name[implementation(r, x, w)] for r in recipes}


HOPPER_FORMS = {"bf16": "plain", "fp8": "traced_fp8", "nvfp4": "op", "mxfp4-all": "graph", "mxfp4-all-dh16": "graph",
                "mxfp4-all-dh32": "graph", "mxfp4-fprop": "graph", "tseng": "graph", "mxfp4-all-sr": "graph"}


def test_the_dispatcher_on_a_hopper_gpu(fake_gpu):
    """``implementation`` (``compiled_form``) on an sm_90 GPU with the default settings: the MXFP4 recipes of
    round-to-nearest (``mxfp4-all``, ``-dh16``, ``-dh32``, ``mxfp4-fprop``) compiled into the graph; ``fp8`` the
    traced per-tensor FP8 form; ``bf16`` plain; ``nvfp4`` (no fast path) the custom op; the seeded recipes
    (``tseng``, ``mxfp4-all-sr``) compiled too, and the custom ops with ``mx_compiled_seeded`` off (``tseng``: plain
    Fprop, so no split, the one op; ``mxfp4-all-sr``: split ops)."""
    from mxtrain import settings
    x, w = fake_gpu()
    assert _forms(x, w) == HOPPER_FORMS
    with settings.override(mx_compiled_seeded=False):
        assert _forms(x, w) == {**HOPPER_FORMS, "tseng": "op", "mxfp4-all-sr": "split_ops"}
    with settings.override(mx_compiled="ops"):
        graph_to_split = {r: "split_ops" if f == "graph" else f for r, f in HOPPER_FORMS.items()}
        assert _forms(x, w) == {**graph_to_split, "tseng": "op"}
    for over in ({"fast": False}, {"exact_carrier": True}):   # (exact_carrier: MX layers only)
        with settings.override(**over):
            want = {r: "plain" if r == "bf16" else "traced_fp8" if r == "fp8" and "exact_carrier" in over else "op"
                    for r in RECIPES}
            assert _forms(x, w) == want, over
    from mxtrain.linear import implementation
    assert "fast path" in implementation("mxfp4-all-dh16", x, w, compiled=False)
    assert "reference" in implementation("nvfp4", x, w, compiled=False)


NEW_RECIPES = ["mxfp4-all-adaptive", "mxfp4-all-dh16+adaptive", "ufp4", "ufp4+adaptive", "ufp4+rceil"]


def test_the_dispatcher_compiles_the_uniform_grids_and_the_adaptive_rule(fake_gpu):
    """Issue #51's recipes on an sm_90 GPU: the ``adaptive`` rule and the uniform grids (``mxint4``: ``ufp4``;
    ``mxe1m2``) compiled into the graph as the MXFP4 presets are (by default; as the custom ops with
    ``mx_compiled_grids`` off): where nothing is drawn at random (``mxfp4-all-adaptive``, a round-to-nearest INT4
    or E1M2 recipe), and with ``mx_compiled_seeded`` (on by default) where it is (``ufp4``: random signs,
    stochastic rounding on dY; without the setting the custom op, as ``tseng``). With ``mx_compiled=ops`` the
    MXFP4 ones run as the split ops; on other GPUs the compiled layer is not taken."""
    from mxtrain import settings
    from mxtrain.linear import COMPILED_FORMS, implementation
    from mxtrain.numerics import recipes
    from mxtrain.numerics.recipe import OPERANDS
    x, w = fake_gpu()
    name = {v: k for k, v in COMPILED_FORMS.items()}
    want = {"mxfp4-all-adaptive": "graph", "mxfp4-all-dh16+adaptive": "graph", "ufp4": "op", "ufp4+adaptive": "op",
            "ufp4+rceil": "op"}
    ops = {r: "split_ops" if f == "graph" else f for r, f in want.items()}
    assert _forms(x, w, NEW_RECIPES) == {r: "graph" for r in NEW_RECIPES}   # (the defaults)
    r_int4 = recipes.get("mxfp4-all-dh16").with_(**{f"{n}.fmt": "mxint4" for n in OPERANDS})
    with settings.override(mx_compiled_grids=False):   # every one as the custom ops
        assert _forms(x, w, NEW_RECIPES) == ops
        assert name[implementation(r_int4, x, w)] == "op"   # (INT4 operands: the one op, not the split ops)
    with settings.override(mx_compiled_seeded=False):
        assert _forms(x, w, NEW_RECIPES) == want
        with settings.override(mx_compiled="ops"):
            assert _forms(x, w, NEW_RECIPES) == ops
        for fmt in ("mxint4", "mxe1m2"):   # (round to nearest, H16 without signs: nothing drawn)
            r = recipes.get("mxfp4-all-dh16").with_(**{f"{n}.fmt": fmt for n in OPERANDS})
            assert name[implementation(r, x, w)] == "graph", fmt
        x, w = fake_gpu((8, 0))
        assert _forms(x, w, NEW_RECIPES) == ops


def test_auto_installs_the_share_pass_and_separate_does_not(fake_gpu):
    """``mx_compiled=auto`` (the default) makes ``compiledmx.plan`` install ``SharePass`` as inductor's pre-grad pass
    (the pass the block test sees merge q/k/v and gate/up); ``separate`` leaves inductor's pass as it was."""
    from mxtrain import settings
    from mxtrain.linear import compiledmx
    from torch._inductor import config as ic
    x, w = fake_gpu()
    with settings.override(mx_compiled="separate"):
        assert _forms(x, w, ["mxfp4-all-dh16"]) == {"mxfp4-all-dh16": "graph"}
    assert ic.pre_grad_custom_pass is None and ic.joint_custom_pre_pass is None
    assert _forms(x, w, ["mxfp4-all-dh16", "mxfp4-all"]) == {"mxfp4-all-dh16": "graph", "mxfp4-all": "graph"}
    assert isinstance(ic.pre_grad_custom_pass, compiledmx.SharePass)
    assert isinstance(ic.joint_custom_pre_pass, compiledmx.ShareCarrierPass)


@pytest.mark.parametrize("cap,forms", [
    # sm_80: no FP8 tensor cores (the dequantizing GEMM): the MX layers as the split custom ops, fp8 the op
    ((8, 0), {"mxfp4-all-dh16": "split_ops", "mxfp4-all": "split_ops", "fp8": "op", "bf16": "plain"}),
    # sm_100: MX-native GEMMs, not the FP8 carrier the compiled layer multiplies: the split ops; FP8 traced
    ((10, 0), {"mxfp4-all-dh16": "split_ops", "mxfp4-all": "split_ops", "fp8": "traced_fp8", "bf16": "plain"}),
])
def test_the_dispatcher_on_other_gpus(fake_gpu, cap, forms):
    x, w = fake_gpu(cap)
    assert _forms(x, w, list(forms)) == forms


def test_the_dispatcher_on_a_cpu():
    """On CPU tensors nothing is compiled into the graph: ``bf16`` plain, every other recipe the custom op."""
    x, w = torch.zeros(256, 256, dtype=torch.bfloat16), torch.zeros(512, 256, dtype=torch.bfloat16)
    assert _forms(x, w) == {r: "plain" if r == "bf16" else "op" for r in RECIPES}
