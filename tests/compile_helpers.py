"""Shared helpers of the tests of traced layers under torch.compile (tests/linear/test_tracedfp8.py)."""

from __future__ import annotations

import torch


def fwd_bwd(x, w, b, gy, fn):
    """``fn(x, w, b)`` and its backward from ``gy``: [y, dX, dW(, db)] as float32."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = b.clone().requires_grad_() if b is not None else None
    y = fn(x, w, b)
    y.backward(gy)
    return [t.detach().float() for t in (y, x.grad, w.grad, *(() if b is None else (b.grad,)))]


def ops_of(fn, *args):
    """The call_function targets of the graph(s) ``torch.compile`` makes of ``fn`` (fullgraph)."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm
    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen


def mlp_losses(recipe: str, compiled: bool, dev: str, width: int = 64, batch: int = 32, steps: int = 6):
    """Losses of ``steps`` AdamW steps of a converted 3-layer MLP (``width`` -> 2 ``width`` -> ``width``) in a
    plain loop under bf16 autocast, the whole model under ``torch.compile(fullgraph=True)`` or eager."""
    import mxtrain
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                            torch.nn.Linear(2 * width, width)).to(dev)
    mxtrain.convert(m, recipe, skip=())
    f = torch.compile(m, fullgraph=True) if compiled else m
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(batch, width, generator=g).to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = (f(x).float() - x.flip(-1)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------------------------- fake Hopper graphs
#
# The graphs a compiled MX layer gives the compiler on an sm_90 GPU, captured on a CPU-only machine
# (tests/linear/test_graph_structure.py). Run in a child process (``fake_hopper_main``): Triton without its interpreter
# (``wrap_triton`` takes real jitted kernels) and process-wide patches that must not reach other tests.
#
# How: the model's parameters and inputs are fake CUDA tensors (``FakeTensorMode``); the device probes answer as
# an H100/H200 does (below); dynamo traces the model with every decision of the dispatcher and of the compiled
# layer made as on that GPU (``compiled_form``, ``compiledmx.plan``, ``_mm``'s ``torch._scaled_mm``). The backend
# then does what inductor does before it generates code: the pre-grad custom pass (``mx_compiled=shared``
# installs ``compiledmx.SharePass`` there), aot_autograd's functionalized joint graph with inductor's
# decompositions, the joint custom pre-pass (``compiledmx.ShareCarrierPass`` with ``shared``), split by the
# min-cut partitioner inductor uses; it records the forward and backward graphs and
# never runs anything. One difference from a GPU: torch built without CUDA cannot run its autograd engine on
# CUDA tensors (``torch.autograd.grad`` asks for the accelerator's streams), so aot_autograd traces dynamo's graph
# with meta tensors of the same shapes, strides and dtypes (device constants rewritten to meta); by then every
# device decision is in the graph, and the ops' bodies re-run on meta only to lay out their launches (which
# differ from the GPU's in the ``USE_ASM`` constexpr alone; the meta ``_scaled_mm`` checks shapes, strides and
# scale layouts as for CUDA).

_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"   # c10::impl::device_guard_impl_registry
# what ``kernels.gemm.probe`` finds on an H100 / H200: cuBLAS's blockwise ``_scaled_mm`` exact with 1x128 x 128x128
# and with 1x128 x 1x128 groups
HOPPER_PROBE = {"a1x128_b128x128": True, "b_1x128": True, "errors": {}}


def _fake_cuda_guard() -> None:
    """Let a CPU-only torch build autograd nodes for fake CUDA tensors: its registry of device guards has no CUDA
    entry (``torch._C._ensureCUDADeviceGuardSet`` fills one only in CUDA builds without a GPU), and recording an
    autograd node asks it for the tensor's stream. Meta's no-op guard stands in for CUDA's."""
    import ctypes
    import os
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    cuda, meta = 1, 14   # c10::DeviceType::CUDA, ::Meta (c10/core/DeviceType.h)
    reg = (ctypes.c_void_p * (meta + 1)).in_dll(lib, _REGISTRY)   # (std::array of atomic pointers)
    if not reg[cuda]:
        assert reg[meta], "no device guard registered for meta tensors"
        reg[cuda] = reg[meta]


def fake_hopper() -> None:
    """Make this process's device probes answer as on an H100/H200 (sm_90, Triton kernels, the FP8-carrier GEMM
    with exact 1x128 x 128x128 and 1x128 x 1x128 blockwise ``_scaled_mm``), every one on the compiled layer's
    path: ``kernels.capability`` (hence ``kernels.backend``: ``fp8_carrier``), ``gemm.probe`` (what cuBLAS's
    blockwise GEMM gets right: weight and Wgrad group rows) and the trace-time self-check of each kernel variant
    (setting ``qselfcheck=off``: it runs the variant on the GPU). ``kernels.kernels_available``, ``fast.KERNELS``
    and ``compiledmx``'s ``AVAILABLE`` answer from Triton's presence, as on the GPU; Triton's target is sm_90 for
    torch's analysis of the launches. (``torch.cuda.get_device_capability``, which the per-tensor FP8 forms ask,
    is not on the path of the MX recipes captured here.)"""
    import triton
    from triton.backends.compiler import GPUTarget
    import mxtrain.kernels as MK
    from mxtrain import settings
    from mxtrain.kernels import gemm

    class Target:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)
    triton.runtime.driver._active = Target()
    _fake_cuda_guard()
    MK.capability = lambda d: (9, 0) if torch.device(d).type == "cuda" else None
    gemm.probe = lambda d: dict(HOPPER_PROBE)
    # (the graph tests describe the layer that keeps X's Wgrad operand as FP4 codes and rebuilds its carrier in
    # the backward, wgrad_x=forward; wgrad_x=auto keeps the carrier at these widths: its own case below)
    settings.configure(qselfcheck="off", wgrad_x="forward")
    MK.CACHES.clear()


# the Triton kernel each quantize op launches
KERNEL_OP = {"_mxfp4_dual_kernel": "q_dual", "_mxfp4_kernel": "q_single", "_expand_kernel": "q_expand"}


def _to_meta_graph(gm) -> None:
    """``gm`` and its subgraphs (the autograd functions' bodies) with every CUDA device constant made meta."""
    meta = torch.device("meta")

    def fix(a):
        return meta if isinstance(a, torch.device) and a.type == "cuda" else a
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            for n in m.graph.nodes:
                n.args = torch.fx.node.map_aggregate(n.args, fix)
                n.kwargs = torch.fx.node.map_aggregate(n.kwargs, fix)
            m.recompile()


def _mxtrain_ops(graph) -> list:
    """The names of the mxtrain custom ops a graph calls (``mxtrain::q_dual``, ``mxtrain::linear``...)."""
    out = []
    for n in graph.nodes:
        if n.op == "call_function":
            parts = str(n.target).replace("::", ".").split(".")   # (mxtrain.q_dual, mxtrain.q_dual.default)
            if parts[0] == "mxtrain" and len(parts) > 1:
                out.append(parts[1])
    return out


def _dynamo_summary(gm) -> dict:
    """mxtrain ops of dynamo's graph (after the pre-grad pass): at the top level (X's operands, made outside the
    layers' autograd functions), in the forward bodies and in the backward bodies of the autograd functions."""
    import collections
    top, fwd, bwd = collections.Counter(), collections.Counter(), collections.Counter()
    top.update(_mxtrain_ops(gm.graph))
    for name, m in gm.named_children():
        if isinstance(m, torch.fx.GraphModule):
            (fwd if name.startswith("fwd_body") else bwd if name.startswith("bwd_body") else top).update(
                _mxtrain_ops(m.graph))
    return {"top": dict(top), "fwd_body": dict(fwd), "bwd_body": dict(bwd)}


def _is_counter(val) -> bool:
    # (``fast.state``'s inexact-block counters: int32, one element; the only tensors the quantize ops mutate)
    return isinstance(val, torch.Tensor) and val.dtype == torch.int32 and tuple(val.shape) == (1,)


_FRESH = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)   # an op's new outputs


def _aten_summary(gm) -> dict:
    """What a forward or backward graph holds: quantize launches by op (and ``_mxfp4_kernel``'s layout),
    ``_scaled_mm`` calls, mxtrain custom ops left (a fallback), clones and copies (``aten.copy_`` into a counter
    is the write-back of a mutated input: counted apart), the launch arguments functionalization copies first
    (``cloned_inputs``: any but the launch's fresh outputs and the inexact-block counter, the one tensor the ops
    mutate), and the graph's inputs (name, dtype, shape)."""
    import collections
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    g = gm.graph
    places = [n for n in g.nodes if n.op == "placeholder"]
    counters = {n for n in places if _is_counter(n.meta.get("val"))}
    ops, layouts, cloned = collections.Counter(), collections.Counter(), []
    clones = copies = counter_copies = scaled_mm = 0
    for n in g.nodes:
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
            op = KERNEL_OP.get(k, k)
            ops[op] += 1
            if op == "q_single":
                layouts[str(n.kwargs["kwargs"].get("LAYOUT"))] += 1
            for name in n.kwargs["tensors_to_clone"]:   # (what functionalization copies before the launch)
                arg = n.kwargs["kwargs"][name]
                if not (_is_counter(arg.meta.get("val")) or arg.target in _FRESH):
                    cloned.append(f"{k}.{name}")
        elif n.target is torch.ops.aten._scaled_mm.default:
            scaled_mm += 1
        elif n.target is torch.ops.aten.clone.default:
            clones += 1
        elif n.target in (torch.ops.aten.copy_.default, torch.ops.aten.copy.default):
            if n.args[0] in counters:
                counter_copies += 1
            else:
                copies += 1

    def desc(n):
        v = n.meta.get("val")
        return [str(v.dtype).replace("torch.", ""), list(v.shape)] if isinstance(v, torch.Tensor) else None
    return {"ops": dict(ops), "q_single_layouts": dict(layouts), "scaled_mm": scaled_mm,
            "mxtrain_ops": _mxtrain_ops(g), "clones": clones, "copies": copies, "counter_copies": counter_copies,
            "cloned_inputs": cloned, "inputs": [[n.name, desc(n)] for n in places]}


def capture(model, args) -> dict:
    """Compile ``model(*args)`` (fake CUDA tensors, in their fake mode) with a backend that records and never runs:
    ``{"dynamo_captured": ..., "dynamo": ..., "fw": ..., "bw": ...}``: dynamo's graph as captured and after
    inductor's pre-grad custom pass (``_dynamo_summary``), the forward and backward graphs (``_aten_summary``)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor import config as ic
    from torch._inductor.decomposition import select_decomp_table
    out = {}

    def backend(gm, example_inputs):
        assert "dynamo" not in out, "one graph expected (fullgraph)"
        out["dynamo_captured"] = _dynamo_summary(gm)
        if ic.pre_grad_custom_pass is not None:   # (inductor's compile_fx: the pre-grad passes first)
            ic.pre_grad_custom_pass(gm.graph)
            gm.recompile()
        out["dynamo"] = _dynamo_summary(gm)
        _to_meta_graph(gm)
        ins = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").requires_grad_(
            t.requires_grad) if isinstance(t, torch.Tensor) else t for t in example_inputs]

        def partition(joint, inputs, **kw):
            if ic.joint_custom_pre_pass is not None:   # (inductor's partition_fn: the joint passes first)
                ic.joint_custom_pre_pass(joint.graph)
                joint.graph.lint()
                joint.recompile()
            fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kw)
            out["fw"], out["bw"] = _aten_summary(fw), _aten_summary(bw)
            return fw, bw

        def compiler(g, ex):
            return make_boxed_func(g.forward)
        with torch._guards.tracing(None):
            aot_module_simplified(gm, ins, fw_compiler=compiler, bw_compiler=compiler, partition_fn=partition,
                                  decompositions=select_decomp_table())
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*args)
    return out


# the cases of tests/linear/test_graph_structure.py: sizes with every GEMM dimension a multiple of 128 (no padding)
GRAPH_SIZES = dict(batch=2, seq=128, dim=256, ffn=512, heads=4)


def graph_cases() -> dict:
    """``{case: capture(...)}`` of tests/linear/test_graph_structure.py, bf16 parameters and inputs (CUDA autocast is
    off in a torch without CUDA): one ``MXLinear`` (dim -> 2 dim) of ``mxfp4-all-dh16`` and one with a bias of
    ``mxfp4-all``; one ``mxtrain.model.Block`` (separate q/k/v and gate/up) of ``mxfp4-all-dh16`` with
    ``mx_compiled=shared`` and the same block in BF16; one block of ``bench step``'s user model (fused q|k|v and
    gate|up, ``UserLlama``) of ``mxfp4-all``. Each with its time in seconds."""
    import time
    import mxtrain
    from mxtrain import settings
    from mxtrain.bench.step import _UserBlock
    from mxtrain.model import Block, ModelConfig, rope_tables
    from torch._inductor import config as ic
    from torch._subclasses.fake_tensor import FakeTensorMode
    mode = FakeTensorMode()
    B, T, C, F, H = (GRAPH_SIZES[k] for k in ("batch", "seq", "dim", "ffn", "heads"))
    res = {}

    def run(name, make, args, recipe, **over):
        # (each case as in a fresh process: the share passes install themselves once)
        ic.pre_grad_custom_pass = ic.joint_custom_pre_pass = None
        t0 = time.perf_counter()
        with settings.override(**over), mode:
            torch.set_default_dtype(torch.bfloat16)
            try:
                m = make()
            finally:
                torch.set_default_dtype(torch.float32)
            if recipe:
                mxtrain.convert(m, recipe, skip=())
            res[name] = capture(m, args())
        res[name]["seconds"] = round(time.perf_counter() - t0, 2)

    def x():
        return (torch.randn(B, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True),)

    def xcs():
        return x() + rope_tables(C // H, T, 10000.0, device="cuda")

    def block():
        return Block(ModelConfig(dim=C, n_heads=H, n_kv_heads=H, ffn_dim=F, max_seq_len=T), device="cuda")
    run("linear mxfp4-all-dh16", lambda: torch.nn.Linear(C, 2 * C, bias=False, device="cuda"), x, "mxfp4-all-dh16")
    run("linear mxfp4-all", lambda: torch.nn.Linear(C, 2 * C, bias=True, device="cuda"), x, "mxfp4-all")
    run("linear mxfp4-all-dh16 auto", lambda: torch.nn.Linear(C, 2 * C, bias=False, device="cuda"), x,
        "mxfp4-all-dh16", wgrad_x="auto")
    run("block mxfp4-all-dh16 shared", block, xcs, "mxfp4-all-dh16", mx_compiled="shared")
    run("block mxfp4-all-dh16 backward", block, xcs, "mxfp4-all-dh16", wgrad_x="backward")
    run("block mxfp4-all-dh16 backward recompute", block, xcs, "mxfp4-all-dh16", wgrad_x="backward",
        wgrad_x_recompute=True)
    run("block bf16", block, xcs, None)
    run("user block mxfp4-all", lambda: _UserBlock(C, H, H, F, "cuda"), xcs, "mxfp4-all")
    return res


def fake_hopper_main() -> None:
    """The child process of tests/linear/test_graph_structure.py: ``graph_cases()`` as JSON on stdout."""
    import json
    import sys
    fake_hopper()
    json.dump(graph_cases(), sys.stdout)
