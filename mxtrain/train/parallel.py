"""Multi-process training on PyTorch's own distributed stack: torchrun, DDP, FSDP2 and DCP checkpoints.

Parallelism is applied from outside the model: the trainer builds the model,
``convert``s it to a recipe, then calls ``wrap(model, mode, env)``. One process (world size 1, no
``RANK`` in the environment) runs the same code with no process group at all.

* ``init()`` reads torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``, picks the device
  (``cuda:LOCAL_RANK`` with NCCL, else CPU with gloo) and starts the process group.
* ``apply_ddp`` wraps in ``DistributedDataParallel``; ``apply_fsdp2`` calls ``fully_shard`` on every
  transformer block (``model.layers``) and then on the root, with a ``MixedPrecisionPolicy``
  (bf16 parameters for compute and fp32 gradient reduction on GPU; fp32 throughout on CPU).
* ``save_checkpoint``/``load_checkpoint`` write and read ``torch.distributed.checkpoint`` (DCP)
  folders through ``get_state_dict``/``set_state_dict``, so a checkpoint written by N ranks, with
  DDP, FSDP2 or one process, loads on M ranks with any of them. Writes are atomic: every rank writes
  into ``<path>.tmp``, then rank 0 renames it to ``<path>`` after a barrier.
* ``launch(nproc, argv)`` re-runs the command under ``torch.distributed.run`` (the ``--nproc N``
  convenience of ``mxtrain train``).

Where weight quantization happens under FSDP2: ``fully_shard`` stores each weight as a row shard
(a ``DTensor`` on dim 0) and all-gathers the full weight in the block's pre-forward (and again in
its pre-backward). ``MXLinear``'s forward and backward therefore see the full, unsharded weight and
quantize it there, after the all-gather: every rank quantizes the same full tensor with the same
recipe, layer id and step, so every rank uses a bit-identical quantized weight, equal to the one a
single process computes from the same parameters. (Quantizing the local shard before the gather
would be wrong: Dgrad blocks run along out-features, which is the sharded dim, and the Hadamard
rotations mix 16-32 neighbouring elements.) See ``docs/distributed.md`` and
``tests/train/test_distributed.py::test_fsdp2_quantizes_full_weight``.

The exception, opt-in: ``apply_fsdp2(..., gather="quantized")`` (``parallel.gather``) all-gathers each MX
layer's weight as its two quantized operands (``mxtrain.linear.qgather``), each rank quantizing its own shard, where
that is exact: the Dgrad operand's blocks and rotation blocks must not straddle shards (``out / ranks`` a
multiple of the block), NVFP4 / per-tensor FP8 take the all-reduced amax, and no weight operand is rounded
stochastically or rotated with per-step signs. Bit-identical to the high-precision gather; every other layer
gathers in high precision, said once with its reason (``gather_report``). Tested in
``tests/linear/test_qgather.py``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import pickle
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from .._launch import SAFE_ENV, int_env as _int_env, launch, strip_nproc
from .._io import swap_in, write_atomic, write_json
from ..errors import UserError
from ..linear.module import checkpoint as mx_checkpoint, ddp_ignore_states
from ..linear.qgather import GATHER_MODES, prepare
from ..model.llama import Block, FeedForward

__all__ = [
    "DistEnv", "init", "shutdown", "get_env", "is_rank0", "rank0_print", "barrier", "all_reduce_sum",
    "apply_ddp", "apply_fsdp2", "wrap", "unwrap", "grad_sync", "clip_grad_norm_", "local_batch_size",
    "save_checkpoint", "PendingCheckpoint", "load_checkpoint", "is_checkpoint", "read_extra", "launch", "strip_nproc", "MODES", "SAFE_ENV",
    "DCP_NAME", "DCP_OLD", "find_dcp", "reduce_mean", "reduce_sums", "even_batches", "load_full_state",
    "gather_report",
]

MODES = ("none", "ddp", "fsdp2")

# NVLink multicast (NVLS) off in NCCL, PyTorch symmetric memory and NVSHMEM (``SAFE_ENV``, from ``mxtrain._launch``
# with ``launch`` and ``strip_nproc``): on shared hosts a program that uses it can take the GPUs out of service.
# ``init`` and ``launch`` set these unless already set.


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands. ``distributed`` is False for a plain single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


_ENV = DistEnv()


def get_env() -> DistEnv:
    """The ``DistEnv`` set by the last ``init`` (a single CPU process before any)."""
    return _ENV


def init(device: str = "auto", backend: str | None = None, timeout_s: float = 600.0) -> DistEnv:
    """Start (or join) the process group that torchrun described in the environment.

    **Arguments:**
      * ``device``: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:K"``.
        Under torchrun with CUDA, each process takes ``cuda:LOCAL_RANK``.
      * ``backend``: ``None`` picks NCCL for CUDA and gloo for CPU.

    **Returns:** a ``DistEnv``. Without ``RANK``/``WORLD_SIZE`` in the environment (plain ``python``)
    or with ``WORLD_SIZE=1``, no process group is started and ``env.distributed`` is False.
    """
    global _ENV
    for k, v in SAFE_ENV.items():
        os.environ.setdefault(k, v)
    rank, world = _int_env("RANK", 0), _int_env("WORLD_SIZE", 1)
    local_rank = _int_env("LOCAL_RANK", 0)
    local_world = _int_env("LOCAL_WORLD_SIZE", world)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda asked for, but torch sees no CUDA GPU")
        if world > 1 or dev.index is None:
            idx = local_rank if world > 1 else (dev.index or 0)
            if idx >= torch.cuda.device_count():
                raise UserError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible")
            dev = torch.device("cuda", idx)
        torch.cuda.set_device(dev)
    elif local_world > 1:
        # CPU ranks on one host share its cores; without this each rank starts one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if world <= 1:
        _ENV = DistEnv(device=dev)
        return _ENV
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        from datetime import timedelta
        kw = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kw)
    _ENV = DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                   local_world_size=local_world, device=dev, backend=backend)
    return _ENV


def shutdown() -> None:
    """Destroy the process group if ``init`` started one.

    Drop every DDP / FSDP2 model first (let the function that built it return, or ``del`` it): those
    hold the process group, and a group left for the interpreter's exit to destroy can abort the
    process after a finished run (gloo, torch 2.13: "terminate called without an active exception";
    docs/distributed.md, "Checked and not checked", has the counts).
    """
    global _ENV
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # wrapped models in reference cycles (DDP's hooks) go now, not at exit
        dist.destroy_process_group()   # every group, the background writes' gloo group too
    _BACKGROUND_GROUP.clear()
    _ENV = DistEnv(device=_ENV.device)


def is_rank0() -> bool:
    return _ENV.rank == 0


def rank0_print(*args, **kwargs) -> None:
    """``print`` on rank 0 only (logging, progress bars and files are rank 0's job)."""
    if _ENV.rank == 0:
        print(*args, **kwargs)


def barrier() -> None:
    if _ENV.distributed:
        if _ENV.device.type == "cuda":
            dist.barrier(device_ids=[_ENV.device.index])
        else:
            dist.barrier()


def from_rank0(obj, env: DistEnv | None = None):
    """``obj`` as rank 0 has it, on every rank (a picklable value; ``obj`` itself on one process). Used where
    rank 0 alone decides (is the run folder free? did the checkpoint's last files get written?) and every rank
    must act on the same answer."""
    env = env or _ENV
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=env.device if env.device.type == "cuda" else None)
    return box[0]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over ranks (in place on a copy); identity on one process."""
    t = t.detach().clone()
    if _ENV.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def local_batch_size(global_batch: int, grad_accum: int = 1, world_size: int | None = None) -> int:
    """Sequences per rank per micro-step for a global batch of ``global_batch`` sequences per optimizer
    step: ``global_batch = micro * grad_accum * world_size``, which must divide exactly (a clear error
    otherwise), so the global batch, and the loss, are the same for any number of ranks."""
    world = _ENV.world_size if world_size is None else world_size
    per = grad_accum * world
    if global_batch % per:
        raise UserError(f"batch size {global_batch} is not a multiple of grad_accum ({grad_accum}) x "
                        f"world size ({world}); pick a global batch size divisible by {per}")
    return global_batch // per


# ---------------------------------------------------------------------------------------- wrapping

def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise UserError("FSDP2 needs the transformer blocks in model.layers (an nn.ModuleList)")
    return list(layers)


def apply_ddp(model: nn.Module, env: DistEnv | None = None, **ddp_kwargs) -> nn.Module:
    """Wrap ``model`` (already on ``env.device``) in ``DistributedDataParallel``.

    Gradients are averaged over ranks in the backward pass, so with equal per-rank batches the
    update equals one process's on the concatenated batch. Every rank holds and quantizes the full
    weights itself, identically.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP
    env = env or _ENV
    if not env.distributed:
        return model
    ids = [env.device.index] if env.device.type == "cuda" else None
    ddp_ignore_states(model)   # each rank keeps its own MX call numbers (no buffer broadcast of them)
    return DDP(model, device_ids=ids, **ddp_kwargs)


def apply_fsdp2(model: nn.Module, env: DistEnv | None = None, *, param_dtype: torch.dtype | None = "auto",
                reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
                prefetch: int = 0, gather: str = "high") -> nn.Module:
    """``fully_shard`` every block in ``model.layers``, then the root (embeddings, final norm, head).

    **Arguments:**
      * ``param_dtype``: dtype of the all-gathered parameters used for compute. ``"auto"``: bf16 on
        CUDA, ``None`` (keep fp32) on CPU. The fp32 master weights and optimizer state stay sharded.
        MXLinear casts whatever it gets to fp32 and quantizes it; with bf16 it quantizes the
        bf16-rounded master weight (the all-gather moves half the bytes), with ``None`` exactly the
        fp32 master weight, as a single process does.
      * ``reduce_dtype``: dtype of the gradient reduce-scatter (fp32 by default). The reduction is the mean over
        ranks: NCCL's AVG, on other backends (gloo) a sum divided by the world size (``_sum_then_divide``).
      * ``reshard_after_forward``: free the gathered weights after each block's forward and gather
        again for backward (ZeRO-3); ``False`` keeps them (ZeRO-2-like, more memory, less traffic).
      * ``prefetch``: each block's forward starts the all-gathers of the next ``prefetch`` blocks, and its
        backward those of the ``prefetch`` blocks before it (FSDP2's ``set_modules_to_forward_prefetch`` /
        ``set_modules_to_backward_prefetch``); 0 leaves FSDP2's implicit overlap. Values are unchanged.
      * ``gather``: ``"high"`` (the default) all-gathers every weight in ``param_dtype`` and the MX layers
        quantize the gathered weight; ``"quantized"`` all-gathers each MX layer's weight as its two quantized
        operands (``mxtrain.linear.qgather``: bit-identical, fewer bytes), and where a layer cannot be gathered that
        way exactly it gathers in high precision, said once (a warning on rank 0 naming the layers and why).
        What was done: ``gather_report(model)``.

    The model is changed in place (``fully_shard`` swaps parameters for ``DTensor`` shards) and
    returned. On one process it is returned unchanged.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    env = env or _ENV
    if gather not in GATHER_MODES:
        raise UserError(f"FSDP2 gather must be one of {', '.join(GATHER_MODES)}, got {gather!r}")
    if not env.distributed:
        return model
    if param_dtype == "auto":
        param_dtype = torch.bfloat16 if env.device.type == "cuda" else None
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = _blocks(model)
    if gather == "quantized":   # (before fully_shard: the weights it shards carry the all-gather extension)
        if not reshard_after_forward:
            raise UserError("FSDP2 gather='quantized' needs reshard_after_forward=True: a gathered weight holds only "
                            "its quantized operands, so no block may stay unsharded after a forward (an evaluation's, "
                            "whose parameters other code may then read)")
        model._mx_gather_report = prepare(model, blocks, env.world_size, env.device, warn=env.is_rank0,
                                          param_dtype=param_dtype)
    if blocks and all(type(b) is Block for b in blocks):
        # A compiled Block can return a view (the compiler's output); FSDP2 then warns that an in-place op on it
        # would skip its pre-backward hook. mxtrain's Llama adds to block outputs out of place only (model.py),
        # and compiled FSDP2 runs equal eager ones bit for bit (tests/train/test_distributed.py): silenced for it alone.
        import warnings
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPBlock\) returned a view tensor")
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered (not quantized
        # gathers: their unsharded weights hold no values for code that reads parameters after an evaluation)
        keep = i == len(blocks) - 1 and not (gather == "quantized" and any(
            hasattr(p, "fsdp_pre_all_gather") for p in block.parameters()))
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not keep)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if _sum_then_divide(env):
        for m in (*blocks, model):
            m.set_force_sum_reduction_for_comms(True)
    if prefetch > 0:
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1: i + 1 + prefetch])
            if i > 0:
                block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch): i][::-1])
    return model


def _sum_then_divide(env: DistEnv) -> bool:
    """Whether FSDP2 must reduce gradients with ``ReduceOp.SUM`` and divide by the world size itself: on every
    backend but NCCL. FSDP2 reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG`` by default, and on
    torch 2.8 gloo's ``reduce_scatter_tensor`` returns the *sum* for AVG, without an error (pytorch/pytorch#162338;
    torch 2.13 averages): every gradient was ``world_size`` times too large, which gradient clipping and Adam
    mostly hide, so a 2-rank run drifted from one process's losses by up to 6e-2 in 20 toy steps instead of
    failing. SUM then a division by the world size in fp32 is the mean on any backend and any torch (FSDP2's
    ``set_force_sum_reduction_for_comms``); NCCL's AVG is native and keeps FSDP2's default (no extra division)."""
    return env.backend != "nccl"


def gather_report(model: nn.Module):
    """What ``apply_fsdp2(..., gather="quantized")`` did to ``model`` (``mxtrain.linear.qgather.GatherReport``: the MX
    layers whose weights gather as quantized operands, and why the others gather in high precision), or None."""
    return getattr(unwrap(model), "_mx_gather_report", None)


def wrap(model: nn.Module, mode: str, env: DistEnv | None = None, **kwargs) -> nn.Module:
    """Apply ``mode`` (``"none"``, ``"ddp"`` or ``"fsdp2"``) to a model already on ``env.device``.

    Returns the model to train with (for DDP, the wrapper; use ``unwrap`` to reach the model).
    ``"none"`` under several ranks is an error: ranks would silently drift apart.
    """
    env = env or _ENV
    if mode not in MODES:
        raise UserError(f"unknown parallel mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "none":
        if env.distributed:
            raise UserError(f"{env.world_size} ranks but parallel.mode=none; use ddp or fsdp2")
        return model
    if mode == "ddp":
        return apply_ddp(model, env, **kwargs)
    return apply_fsdp2(model, env, **kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 and plain models are returned as they are)."""
    return model.module if hasattr(model, "module") and isinstance(model, nn.parallel.DistributedDataParallel) else model


@contextlib.contextmanager
def grad_sync(model: nn.Module, enabled: bool):
    """Gradient accumulation: run the non-final micro-steps under ``grad_sync(model, False)`` so that
    DDP (``no_sync``) and FSDP2 (``set_requires_gradient_sync``) communicate only on the last one."""
    if enabled:
        yield
        return
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 module
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also works on FSDP2's ``DTensor`` gradients; returns
    the global (all-rank) total norm as a plain tensor, identical on every rank."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


# ------------------------------------------------------------------------------------- checkpoints

_META = "mxtrain_meta.json"
_EXTRA = "mxtrain_extra.pt"


def is_checkpoint(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / ".metadata").is_file() and (p / _META).is_file() and (p / _EXTRA).is_file()


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra: dict | None = None, env: DistEnv | None = None, background: bool = False):
    """Write model + optimizer state as a DCP folder at ``path``, atomically; call on every rank.

    ``extra``: rank 0's other state (step, tokens, data position, schedule, RNG states, config): plain
    Python values and tensors, written with ``torch.save`` to ``path/mxtrain_extra.pt`` (read back with
    ``weights_only=True``); a small ``path/mxtrain_meta.json`` says what the folder is. Every rank writes its shards into ``<path>.tmp``; after a
    barrier rank 0 writes the metadata and renames the folder, replacing an older ``path`` (moved to
    ``<path>.old`` first, then deleted). A crash at any point leaves either the old or the new
    checkpoint whole at ``path`` (or in ``<path>.old`` for the instant between the two renames).

    ``background=True`` (several processes): the state is copied to host memory (DCP's ``async_save``; the
    call returns once the copy is made, so training may change the weights), the shards are written by a
    thread, and a ``PendingCheckpoint`` is returned: its ``finish()``, called on every rank at the same
    point, waits for the shards and completes the folder as above. Until then ``path`` is the older
    checkpoint, whole. Returns ``path`` (or the ``PendingCheckpoint``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    env = env or _ENV
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if env.is_rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
    barrier()
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": msd}
    if optimizer is not None:
        state["optim"] = osd
    pending = PendingCheckpoint(path, extra, optimizer is not None, env)
    if background and env.distributed:
        with _write_errors(path, tmp):
            pending.future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=_background_group())
        return pending
    with _write_errors(path, tmp):
        with _quiet_single_process(env):
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not env.distributed)
    return pending.finish()


_BACKGROUND_GROUP = []


def _background_group():
    """A gloo group for DCP's background writes (their collectives run off the main thread, where NCCL's
    ordering with the training's own collectives is not guaranteed); made once, by every rank together."""
    if not _BACKGROUND_GROUP:
        _BACKGROUND_GROUP.append(dist.new_group(backend="gloo"))
    return _BACKGROUND_GROUP[0]


@contextlib.contextmanager
def _write_errors(path: Path, tmp: Path):
    """A full disk (or any OSError) while writing shards: one ``UserError`` that says the old checkpoint is
    intact, on every rank (DCP wraps the writers' OSError in its own exception, a BaseException, raised on
    every rank when one rank failed)."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        why = next((x for x in _chain(e) if isinstance(x, OSError)), None)
        if why is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write checkpoint {path}: {why.strerror or why}; the previous checkpoint is "
                        f"intact") from None


class PendingCheckpoint:
    """A DCP checkpoint whose shards are (being) written to ``<path>.tmp``; ``finish()`` (every rank, at the
    same point) waits for them, then rank 0 writes ``extra`` and the metadata and renames the folder to ``path``.
    ``done()``: this rank's shards are written (``finish`` will not wait for them)."""

    def __init__(self, path: Path, extra: dict | None, has_optim: bool, env: DistEnv):
        self.path, self.extra, self.has_optim, self.env = path, extra, has_optim, env
        self.tmp = path.with_name(path.name + ".tmp")
        self.future = None

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def finish(self) -> Path:
        path, tmp, env = self.path, self.tmp, self.env
        if self.future is not None:
            with _write_errors(path, tmp):
                self.future.result()
        barrier()
        err = None
        if env.is_rank0:
            old = path.with_name(path.name + ".old")
            try:
                meta = {"format": "mxtrain-dcp-1", "world_size": env.world_size, "has_optim": self.has_optim}
                write_atomic(tmp / _EXTRA, lambda f: torch.save(self.extra or {}, f), user_error=False)
                write_json(tmp / _META, meta, user_error=False, indent=1, sort_keys=True)
            except OSError as e:   # a full disk on rank 0's last files: every rank must hear of it (no hang)
                shutil.rmtree(tmp, ignore_errors=True)
                err = f"cannot write checkpoint {path}: {e.strerror or e}; the previous checkpoint is intact"
            else:
                # (a save stopped between the two renames leaves the previous checkpoint whole at ``old``,
                # DCP_OLD, which ``checkpoint.latest`` reads)
                swap_in(tmp, path, old)
        err = from_rank0(err, env)   # rank 0's outcome to every rank (this is also the closing barrier)
        if err is not None:
            raise UserError(err)
        return path


def _chain(e: BaseException):
    """``e``, its causes and contexts, and the exceptions DCP collects per rank (``failures``)."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        for v in (getattr(x, "failures", None) or {}).values():
            if isinstance(v, tuple):   # (exception, its stack summary): DCP's wrapped exception of one rank
                v = next((y for y in v if isinstance(y, BaseException)), None)
            todo.append(v if isinstance(v, BaseException) else getattr(v, "exc", None))


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    env: DistEnv | None = None) -> dict:
    """Load a folder written by ``save_checkpoint`` into ``model`` (and ``optimizer``) on every rank,
    resharding as needed (any writer world size / parallel mode to any reader). Returns ``extra``.

    A missing, unfinished (``.tmp``) or non-mxtrain folder is a ``UserError``; a mismatched model (a
    key or shape that does not fit) raises ``UserError`` with DCP's message.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    env = env or _ENV
    path = Path(path)
    if not is_checkpoint(path):
        raise UserError(f"{path} is not an mxtrain distributed checkpoint (no .metadata / {_META} in it)")
    meta = _read_meta(path)
    if optimizer is not None and not meta.get("has_optim", False):
        raise UserError(f"{path} holds no optimizer state")
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": msd}
    if optimizer is not None:
        state["optim"] = osd
    # a crafted .metadata is refused here, before DCP gets to it; DCP then gets this very object
    metadata = _read_dcp_metadata(path)
    from torch.distributed.checkpoint.api import CheckpointException
    reader, planner = _trusted_reader(path, metadata), _trusted_planner(path)
    try:
        with _quiet_single_process(env), warnings.catch_warnings():
            # a damaged shard whose bytes start like a pickle of another protocol makes torch's unpickler warn
            # before it fails; the failure is this function's one line (below), the warning a second one
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=not env.distributed)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        refused = reader.refused or planner.refused  # DCP wraps what its reader / planner raise
        if refused is not None:
            raise refused from None
        raise UserError(f"cannot load checkpoint {path} into this model: {_dcp_reason(e)}") from e
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}), options=StateDictOptions(strict=True))
    return _load_extra(path)


def _read_meta(path: Path) -> dict:
    try:
        with open(path / _META) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path / _META}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "mxtrain-dcp-1":
        raise UserError(f"{path} is not an mxtrain distributed checkpoint (format {meta.get('format')!r})")
    return meta


def read_extra(path: str | os.PathLike) -> dict:
    """Rank 0's ``extra`` state of a checkpoint folder, without loading model or optimizer."""
    path = Path(path)
    if not is_checkpoint(path):
        raise UserError(f"{path} is not an mxtrain distributed checkpoint (no .metadata / {_META} in it)")
    _read_meta(path)
    _read_dcp_metadata(path)  # the first thing a resume reads: refuse a crafted checkpoint at once
    return _load_extra(path)


def _load_extra(path: Path) -> dict:
    try:
        return torch.load(path / _EXTRA, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:120] if str(e) else ''}); restore it or start a new run") from None


# ------------------------------------------------------------------------- what a checkpoint may hold
# A run folder is data, never code (docs/training.md, "What a run folder is trusted with"). DCP itself
# unpickles ``.metadata`` (and ``__RANK.metadata``) with plain ``pickle.load`` and the non-tensor values of a
# state dict (``BytesStorageMetadata`` entries: optimizer hyper-parameters) with ``torch.load(weights_only=
# False)``, so a crafted folder would run any code on resume. mxtrain therefore never lets DCP read either
# itself: ``.metadata`` goes through ``_MetadataUnpickler`` (an allow-list of globals), read up front by
# ``read_extra`` and ``load_checkpoint`` (``_read_dcp_metadata``); ``load_checkpoint`` hands the object it
# read to ``dcp.load`` through its storage reader (``_trusted_reader``: there is no second read of the file,
# and any other metadata file DCP asks for, e.g. ``__RANK.metadata``, goes through the allow-list too), and
# the values are loaded by ``_trusted_planner`` (``weights_only=True``). Tensor data DCP already reads with
# ``weights_only=True``; ``mxtrain_extra.pt`` is read the same way, ``mxtrain_meta.json`` is JSON.
#
# The allow-list was collected by recording every ``find_class`` call while unpickling the ``.metadata`` of
# real saves (torch 2.13): one process, 2-rank DDP and 2-rank FSDP2 (``tests/_dist_worker.py``'s model and
# AdamW, ``save_checkpoint``). All three reference exactly: Metadata, TensorStorageMetadata,
# BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta and the enum
# _MEM_FORMAT_ENCODING (torch.distributed.checkpoint.metadata), _StorageInfo (...filesystem: what
# FileSystemWriter puts in ``storage_data``), torch.Size, torch.float32 (a dtype pickles as the global
# ``torch.<name>``), torch.serialization._get_layout (how a torch.layout pickles; replaced here by a lookup
# that only maps a layout's name to the layout) and pathlib.PosixPath (``storage_meta.checkpoint_id``).
# FSDP2's DTensor shards add no class: DCP flattens them into more ChunkStorageMetadata of the same
# TensorStorageMetadata. Added beyond what was seen, all plain values or data-class constructors: every
# torch dtype, layout and memory format (older torch pickled these as ``torch.<name>`` too), the other
# pathlib path classes (a checkpoint written on Windows; ``pathlib._local`` is their module from Python
# 3.13), collections.OrderedDict. A dataclass pickled at protocol >= 2 (DCP uses the default, 4 or 5)
# needs no builtins (NEWOBJ + BUILD), so none are allowed; copyreg._reconstructor (protocols 0-1) is not
# either. Globals are matched as exact (module, name) pairs, so no attribute walk ("Metadata.__init__")
# and no module object is reachable.

_DCP_META_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
_NOT_TRUSTED = "the folder is not trusted, and nothing from it was executed"


class _Refused(Exception):
    """A pickle asked for a global outside the allow-list (``str(e)``: its name)."""


class _Untrusted(UserError):
    """A checkpoint that references what no checkpoint contains (or points outside its folder): refused."""


def _layout_by_name(name):
    """Stands in for ``torch.serialization._get_layout``: a layout's name (``"torch.strided"``) -> the layout."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise _Refused(f"torch.serialization._get_layout({_printable(repr(name))})")
    return layouts[name]


@functools.lru_cache(maxsize=None)
def _dcp_allowed() -> dict[tuple[str, str], object]:
    """``{(module, name): object}``: every global a DCP ``.metadata`` may reference."""
    import collections
    import pathlib
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    allowed: dict[tuple[str, str], object] = {}
    for n in _DCP_META_CLASSES:
        if hasattr(md, n):
            allowed[("torch.distributed.checkpoint.metadata", n)] = getattr(md, n)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    for n, v in vars(torch).items():  # values, none callable: torch.float32, torch.strided, torch.channels_last
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", n)] = v
    allowed[("torch.serialization", "_get_layout")] = _layout_by_name
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    native = "posix" if os.name != "nt" else "windows"
    for n in ("PurePosixPath", "PureWindowsPath", "PosixPath", "WindowsPath"):
        cls = getattr(pathlib, n)
        if n in ("PosixPath", "WindowsPath") and not n.lower().startswith(native):
            cls = getattr(pathlib, "Pure" + n)  # cannot be made on this system; only a name in storage_meta
        allowed[("pathlib", n)] = allowed[("pathlib._local", n)] = cls
    return allowed


@functools.lru_cache(maxsize=None)
def _dcp_buildable() -> frozenset:
    """The classes whose fresh instances a pickle may set the state of (BUILD): the data classes."""
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    return frozenset([getattr(md, n) for n in _DCP_META_CLASSES if hasattr(md, n) and n != "_MEM_FORMAT_ENCODING"]
                     + [fs._StorageInfo])


class _MetadataUnpickler(pickle._Unpickler):
    """An unpickler that resolves only the globals of ``_dcp_allowed()`` (exact pairs) and sets the state
    (BUILD) only of instances of the data classes. The second rule keeps a pickle from changing a class
    itself (``BUILD`` on ``pathlib.PosixPath`` with ``{"parent": ...}`` would change every path in the
    process) or a shared object (an enum member). It needs the Python unpickler, whose opcodes can be
    overridden: about 3x slower than the C one (~2 s for a 7 MB ``.metadata`` with 48,000 chunks)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module, name):
        obj = _dcp_allowed().get((module, name))
        if obj is None:
            raise _Refused(f"{_printable(module, 80)}.{_printable(name, 80)}")
        return obj

    def persistent_load(self, pid):
        raise _Refused(f"persistent id {_printable(repr(pid))}")

    def load_build(self):
        inst = self.stack[-2]  # BUILD: the state is on top, the object under it
        if type(inst) not in _dcp_buildable():
            what = inst.__module__ + "." + inst.__qualname__ if isinstance(inst, type) else type(inst).__name__
            raise _Refused(f"a change to {_printable(what, 80)} (BUILD)")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = load_build


def _printable(s: str, n: int = 120) -> str:
    """``s`` on one line, without control characters, at most ``n`` characters (for a crafted name)."""
    s = "".join(c if c.isprintable() else "?" for c in str(s))
    return s if len(s) <= n else s[: n - 3] + "..."


def _py3_global(name: str) -> str:
    """A global as torch's weights-only error names it -> its Python 3 name: ``torch.save`` pickles at protocol
    2 with Python 2 names (``commands.check_call``), and the error drops ``__builtin__.`` (``exec``)."""
    import _compat_pickle
    module, _, attr = name.rpartition(".")
    if not module:
        return f"builtins.{attr}"
    module, attr = _compat_pickle.NAME_MAPPING.get((module, attr), (module, attr))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{attr}"


def _load_dcp_metadata_file(file: Path):
    """Unpickle one DCP metadata file through the allow-list and check its shape; a ``UserError`` otherwise."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise _Untrusted(f"checkpoint metadata {file} references {_printable(e)}, which a checkpoint never "
                        f"contains: {_NOT_TRUSTED}") from None
    except OSError as e:
        raise UserError(f"cannot read checkpoint metadata {file}: {e.strerror or e}") from None
    except Exception as e:  # truncated or garbled pickle, or a constructor refusing its arguments
        raise UserError(f"checkpoint metadata {file} is corrupt or malformed ({type(e).__name__}); "
                        f"restore it or start a new run") from None

    def bad(why: str) -> UserError:
        return _Untrusted(f"checkpoint metadata {file} is malformed ({why}); {_NOT_TRUSTED}")

    if not isinstance(md, Metadata):
        raise bad(f"a {_printable(type(md).__name__, 40)}, not DCP Metadata")
    if not isinstance(md.state_dict_metadata, dict):
        raise bad("state_dict_metadata is not a dict")
    if not isinstance(md.storage_data, dict):
        raise bad("storage_data is not a dict")
    for k, v in md.storage_data.items():
        if not isinstance(k, MetadataIndex) or not isinstance(v, _StorageInfo):
            raise bad("storage_data is not MetadataIndex -> _StorageInfo")
        rp = v.relative_path
        # data files lie in the checkpoint folder itself; nothing outside it is read
        if (not isinstance(rp, str) or rp in ("", ".", "..") or "/" in rp or "\\" in rp or "\0" in rp
                or os.path.isabs(rp) or ":" in rp):
            raise bad(f"data file {_printable(repr(rp), 80)} is not a file name in the checkpoint folder")
        if (not isinstance(v.offset, int) or not isinstance(v.length, int) or isinstance(v.offset, bool)
                or isinstance(v.length, bool) or v.offset < 0 or v.length < 0):
            raise bad(f"entry {_printable(getattr(k, 'fqn', '?'), 80)} has a bad offset or length")
    return md


def _read_dcp_metadata(path: str | os.PathLike):
    """The ``Metadata`` of the DCP folder ``path``, read through the allow-list."""
    return _load_dcp_metadata_file(Path(path) / ".metadata")


@functools.lru_cache(maxsize=None)
def _trusted_reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class TrustedReader(FileSystemReader):
        """``FileSystemReader`` whose ``read_metadata`` (global or rank-local) uses the allow-list."""

        def __init__(self, path, metadata=None):
            super().__init__(path)
            self.metadata = metadata  # ``.metadata`` as load_checkpoint read it (the first call returns it)
            self.refused: _Untrusted | None = None  # DCP catches what read_metadata raises; load_checkpoint
            # re-raises this one

        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            if rank is None and self.metadata is not None:
                md, self.metadata = self.metadata, None
            else:
                name = ".metadata" if rank is None else f"__{rank}.metadata"
                try:
                    md = _load_dcp_metadata_file(Path(self.path) / name)
                except _Untrusted as e:
                    self.refused = self.refused or e
                    raise
            if getattr(md, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return TrustedReader


@functools.lru_cache(maxsize=None)
def _trusted_planner_class():
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class TrustedPlanner(DefaultLoadPlanner):
        """``DefaultLoadPlanner`` that loads non-tensor values with ``torch.load(weights_only=True)``
        (DCP's own uses ``weights_only=False``)."""

        def __init__(self, path):
            super().__init__()
            self.path = path
            self.refused: UserError | None = None

        def load_bytes(self, read_item, value):
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:  # what weights_only refuses
                import re
                m = re.search(r"GLOBAL (\S+)", str(e))
                what = _py3_global(m.group(1)) if m else "an object that is not plain data"
                self.refused = _Untrusted(f"checkpoint {self.path}: its saved value {_printable(fqn, 80)} references "
                                         f"{_printable(what)}, which a checkpoint never contains: {_NOT_TRUSTED}")
                raise self.refused from None
            except Exception as e:
                self.refused = UserError(f"checkpoint {self.path}: saved value {_printable(fqn, 80)} is corrupt "
                                         f"({type(e).__name__}); restore it or start a new run")
                raise self.refused from None
            # what DefaultLoadPlanner.load_bytes does with the value it loads (should a later torch rename
            # these attributes, the load fails with "cannot load checkpoint", never unsafely)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return TrustedPlanner


def _trusted_reader(path: Path, metadata=None):
    return _trusted_reader_class()(str(path), metadata)


def _trusted_planner(path: Path):
    return _trusted_planner_class()(path)


@contextlib.contextmanager
def _quiet_single_process(env: DistEnv):
    """DCP warns 'torch.distributed is disabled...' on one process even with no_dist=True."""
    import warnings
    with warnings.catch_warnings():
        if not env.distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_reason(e: BaseException) -> str:
    """The last line of DCP's per-rank traceback (e.g. 'RuntimeError: Missing key ... model.w')."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln.split(":", 1)[0]:
            return ln[:300]
    return (lines[0] if lines else type(e).__name__)[:300]


# ----------------------------------------------------------------------------------- trainer hooks
# What mxtrain.train.trainer calls; each is a no-op (or the plain single-process thing) on one process.

DCP_NAME = "checkpoint.dcp"  # a run folder's distributed checkpoint (the single-process one is checkpoint.pt)
DCP_OLD = DCP_NAME + ".old"   # the previous one, whole, while a save is between its two renames


def find_dcp(path: str | os.PathLike) -> Path | None:
    """``path`` itself if it is a DCP checkpoint folder, ``path/checkpoint.dcp`` if that is one, else
    ``checkpoint.dcp.old`` where a save stopped between its two renames (``save_checkpoint``) left the previous
    checkpoint whole there and nothing at ``checkpoint.dcp``; else None. Nothing is renamed (a run folder's
    checkpoint, of either kind, is picked by ``mxtrain.train.checkpoint.latest``)."""
    p = Path(path)
    for c in (p, p / DCP_NAME):
        if is_checkpoint(c):
            return c
    dcp = p if p.name == DCP_NAME else p / DCP_NAME
    old = dcp.with_name(DCP_OLD)
    if not dcp.exists() and is_checkpoint(old):
        return old
    return None


def _reduce(xs, op) -> list[float]:
    """Python floats reduced over ranks with ``op``, in one all-reduce (float64); as they are on one process."""
    if not _ENV.distributed:
        return [float(x) for x in xs]
    t = torch.tensor(xs, dtype=torch.float64, device=_ENV.device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def reduce_mean(x: float) -> float:
    """Mean of a Python float over ranks (loss logging); ``x`` on one process."""
    return _reduce([x], dist.ReduceOp.SUM)[0] / _ENV.world_size


def reduce_max(x: float) -> float:
    """Largest value of a Python float over ranks (peak memory per GPU); ``x`` on one process."""
    return _reduce([x], dist.ReduceOp.MAX)[0]


def reduce_over_ranks_(t: torch.Tensor, op: str = "mean") -> torch.Tensor:
    """``t`` (a tensor on this rank's device) reduced over ranks in place, on the device: the host waits for
    nothing (``mxtrain.train.stepcheck``). ``op``: ``mean`` or ``max``. Returns ``t``; on one process, as it is."""
    if _ENV.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if op == "mean":
            t.div_(_ENV.world_size)
    return t


def reduce_sums(*xs: float) -> list[float]:
    """Sums over ranks of several Python floats, in one all-reduce (float64)."""
    return _reduce(xs, dist.ReduceOp.SUM)


def even_batches(batches, pad=None) -> list[tuple[object, float]]:
    """``[(batch, weight)]`` with the same length on every rank: ranks with fewer batches repeat their
    last one with weight 0. FSDP2 all-gathers inside every forward, so evaluation must run the same number
    of forwards on every rank or it hangs. A rank with no batch at all (fewer validation windows than
    ranks) runs ``pad()`` (any batch of the right kind) with weight 0; without ``pad`` that is an error."""
    batches = list(batches)
    n = len(batches)
    if _ENV.distributed:
        t = torch.tensor([n], dtype=torch.int64, device=_ENV.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n_max = int(t.item())
    else:
        n_max = n
    if n == 0 and n_max > 0:
        if pad is None:
            raise UserError("validation set smaller than the number of ranks; raise log.eval_tokens")
        return [(pad(), 0.0)] * n_max
    return [(b, 1.0) for b in batches] + [(batches[-1], 0.0)] * (n_max - n)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, model_sd: dict,
                    optim_sd: dict | None) -> None:
    """Load a single-process checkpoint (``model.state_dict()``, ``optimizer.state_dict()``, full
    tensors on every rank) into a DDP- or FSDP2-wrapped model and its optimizer: FSDP2 takes each
    rank's shard. The optimizer's state is keyed by parameter index in ``param_groups`` order; it is
    re-keyed by parameter name, which is what ``set_state_dict`` expects, so the optimizer must be
    built with its parameters in the same order as the one that wrote the checkpoint."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    opts = StateDictOptions(full_state_dict=True, strict=True)
    if optimizer is None or optim_sd is None:
        set_state_dict(model, [], model_state_dict=model_sd, optim_state_dict={}, options=opts)
        return
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    n_saved = sum(len(g["params"]) for g in optim_sd["param_groups"])
    if n_saved != len(order):
        raise UserError(f"checkpoint's optimizer has {n_saved} parameters, this model {len(order)}")
    fqn_sd = {"state": {order[int(i)]: st for i, st in optim_sd["state"].items()},
              "param_groups": [{**g, "params": [order[int(i)] for i in g["params"]]} for g in optim_sd["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=fqn_sd, options=opts)


# ------------------------------------------------------------------------------- activation checkpointing
# Applied to the model from outside, as DDP / FSDP2 are: the model's blocks take two optional functions
# (``Block.checkpoint``, ``Block.ffn_checkpoint``) and know nothing of MX layers; these are mxtrain's, and
# ``apply_ac`` gives them to every block. Each is one module-level function shared by all blocks, so compiled
# blocks keep sharing one graph (dynamo guards on the function, the same object in every block).

def checkpoint_block(block: nn.Module, fn, *args):
    """Full activation checkpointing of one block (``train.checkpoint_blocks``): ``mxtrain.checkpoint`` over the
    block's MX layers, so the recomputed forward draws the random inputs (stochastic rounding, per-step signs) the
    first one drew and gradients are those without checkpointing, bit for bit."""
    return mx_checkpoint(fn, *args, layers=block)


_RECOMPUTED_OPS: set = set()


def _recompute_linears(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy of ``recompute_ffn``: matrix products (BF16 ``mm``, FP8 ``_scaled_mm`` as
    torchao's float8 layers run it, mxtrain's MX linear ops) are made again in the backward from the tensors they
    read; everything else is the compiler's choice."""
    from torch.utils.checkpoint import CheckpointPolicy
    if op in _RECOMPUTED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def _ffn_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    if not _RECOMPUTED_OPS:
        _RECOMPUTED_OPS.update({torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default,
                                torch.ops.mxtrain.linear.default, torch.ops.mxtrain.linear_q.default})
    return create_selective_checkpoint_contexts(_recompute_linears)


def checkpoint_ffn(block: nn.Module, fn, x):
    """``train.recompute_ffn``: under ``torch.compile``, the feed-forward's linear outputs are made again in the
    backward (selective checkpointing of the FFN norm and FFN) instead of being kept: the SwiGLU inputs (two
    ``hidden_dim``-wide tensors a token) give way to what the up projections read (an MX layer's quantized input
    operand; BF16 layers: the normalized input, recomputed from the residual). Costs the gate and up GEMMs once
    more; same results. Eager calls keep the outputs."""
    if not torch.compiler.is_compiling():
        return fn(x)
    from torch.utils.checkpoint import checkpoint
    return checkpoint(fn, x, use_reentrant=False, context_fn=_ffn_context)


def apply_ac(model: nn.Module, checkpoint_blocks: bool = False, recompute_ffn: bool = False) -> nn.Module:
    """Activation checkpointing for every block of ``model`` (``model.layers``, or ``model`` itself when it is a
    list of blocks): ``checkpoint_blocks`` full (``checkpoint_block``), else ``recompute_ffn`` the dense
    feed-forward's linear outputs under ``torch.compile`` (``checkpoint_ffn``; a mixture of experts keeps its
    experts' outputs). False turns either off. Returns ``model``."""
    for b in (model.layers if hasattr(model, "layers") else model):
        if not isinstance(b, Block):
            raise TypeError(f"apply_ac: {type(b).__name__} is not an mxtrain.model Block")
        b.checkpoint = checkpoint_block if checkpoint_blocks else None
        dense = isinstance(b.feed_forward, FeedForward)
        b.ffn_checkpoint = checkpoint_ffn if recompute_ffn and dense and not checkpoint_blocks else None
    return model


__all__ += ["apply_ac", "checkpoint_block", "checkpoint_ffn"]
