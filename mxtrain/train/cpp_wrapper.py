"""What a run compiled with inductor's C++ wrapper (``train.cpp_wrapper``, ``bench step``'s ``cpp_wrapper=true``)
needs before its first step: a C++ compiler (``check_cpp_compiler``), and a CUDA context bound to the thread that
runs the backward (``bind_backward_thread``).

The C++ wrapper loads its kernels through the CUDA driver (``cuModuleLoadData``), which reads the calling thread's
current context. The backward runs on autograd's device thread, where nothing may have bound one yet: torch's issue
#144609 (open) reports the C++ wrapper with autograd failing in a process whose graphs come from inductor's cache,
and one ``bench step`` run here stopped with "CUDA driver error: invalid device context" in such a process
(BENCHMARKS.md, "The HF model as a bench step model"). Any runtime call in that thread binds the device's primary
context, so one small eager backward on the device first is the workaround.

The wrapper is inductor's process-wide setting for the whole run (``cpp_wrapper_config``), as ``bench step`` sets it
around a whole variant, and not an option of each block's ``compile``: on torch 2.11 (H200, 2026-12-02) a trainer
whose blocks alone compiled with ``options={"cpp_wrapper": True}`` stopped at its first backward with
"CudaKernelParamCache not populated for triton_poi_fused__to_copy_view_0", BF16 included, where ``bench step`` runs.
The cause is torch's issue #178845: a backward graph
compiles lazily, at the first backward, after ``torch.compile``'s patch of its options has ended, so it compiles
without the C++ wrapper's settings (no kernel binaries kept for it) and the wrapper then finds none. The setting
made process-wide, the issue's workaround, holds through that compile. That the trainer runs with it on a GPU is not
yet measured (BENCHMARKS.md, "GPU test runs")."""

from __future__ import annotations

import contextlib

import torch

from ..errors import UserError

__all__ = ["check_cpp_compiler", "bind_backward_thread", "cpp_wrapper_config"]


def check_cpp_compiler(what: str = "train.cpp_wrapper") -> None:
    """Refuse in one line, before anything is compiled, where inductor finds no C++ compiler to build the wrapper
    with (``CXX``, else ``g++``; torch's own lookup), instead of inductor's error at the first step. (Where this
    torch keeps the lookup elsewhere, inductor says it itself.)"""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:
        return
    try:
        get_cpp_compiler()
    except Exception:
        raise UserError(f"{what} needs a C++ compiler where the model compiles (g++ or clang++, or the one the CXX "
                        f"environment variable names), and none was found; install one or leave {what} off") from None


def bind_backward_thread(device) -> None:
    """One small eager forward and backward on ``device``: autograd's thread for that device makes a runtime call,
    which binds the device's CUDA context to it before a compiled backward loads kernels through the driver there
    (module docstring). Changes no state a run keeps; on other devices it runs the same few operations."""
    x = torch.ones(8, device=device, requires_grad=True)
    (x * 2.0).sum().backward()
    if x.grad is None or float(x.grad[0]) != 2.0:
        raise RuntimeError("bind_backward_thread: the backward did not run")


def cpp_wrapper_config(on: bool):
    """A context in which everything inductor compiles uses the C++ wrapper (``on``), restored on exit; a context
    that changes nothing otherwise (no inductor import)."""
    if not on:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config
    return inductor_config.patch(cpp_wrapper=True)
