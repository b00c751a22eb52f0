"""Checkpoints: one ``torch.save`` file written atomically (``_io.write_atomic``: temporary file, fsync,
``os.replace``).

Contents: model and optimizer state, schedule step, data loader position, RNG states (Python,
NumPy, torch CPU and CUDA), the step and token counters, and the full config. A crash mid-write
leaves the previous checkpoint intact. Loading a corrupt, truncated or mismatched file raises a
``UserError``, never a silent restart. The checkpoints kept at chosen steps (``train.keep_checkpoints_at``):
``keep_copy`` and ``kept_name``.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

# (study/report.py imports write_atomic from here)
from .._io import lock_holder, replace_folder, temp_path, write_atomic
from ..errors import UserError
from . import parallel as D

FORMAT = "mxtrain-ckpt-v1"
NAME = "checkpoint.pt"
# config keys that must match to resume (the rest, e.g. steps or logging, may change)
# what a resumed run must share with its checkpoint; the optimizer's values (learning rate, betas, weight
# decay, eps, clipping) may change on resume: they do not change the shape of its state
IDENTITY_KEYS = [("model",), ("data", "seq_len"), ("data", "vocab_size"), ("data", "seed"), ("recipe",),
                 ("recipe_overrides",), ("train", "batch_size"), ("train", "seed")]


def rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    # plain lists and tensors only, so the file loads with torch.load(weights_only=True)
    st = {"python": list(random.getstate()[1]), "python_version": random.getstate()[0],
          "python_gauss": random.getstate()[2],
          "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
          "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict, path: str | Path = "") -> None:
    """Restore the RNG states ``rng_state`` saved. A state that lacks a part or does not fit (a damaged or
    foreign checkpoint ``path``) is one UserError; the run would not continue as it was."""
    try:
        if not isinstance(st, dict):
            raise KeyError("rng")
        random.setstate((st["python_version"], tuple(st["python"]), st["python_gauss"]))
        name, keys, pos, has_gauss, cached = st["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(st["torch"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda"])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        why = f"no {e.args[0]!r}" if isinstance(e, KeyError) and e.args else \
            f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"
        raise UserError(f"checkpoint {path}: its RNG state is incomplete or damaged ({why}), so the run cannot "
                        f"continue as it was; restore the checkpoint from a good copy or start a new run") from None


def save(path: Path, state: dict) -> None:
    state = {"format": FORMAT, **state}
    write_atomic(path, lambda f: torch.save(state, f), "checkpoint ")


def _candidates(folder: Path) -> list[Path]:
    """A run folder's complete latest checkpoints, in the order that wins a tie: ``checkpoint.pt`` (one
    process), ``checkpoint.dcp`` (several), ``checkpoint.dcp.old`` (the previous DCP checkpoint, whole, where a
    save stopped between its two renames)."""
    return ([folder / NAME] if (folder / NAME).is_file() else []) + \
        [p for p in (folder / D.DCP_NAME, folder / D.DCP_OLD) if D.is_checkpoint(p)]


def holds_checkpoint(folder: str | Path) -> bool:
    """Whether run folder ``folder`` holds a checkpoint to resume from (nothing is read)."""
    return bool(_candidates(Path(folder)))


def step_of(path: str | Path) -> int:
    """The step recorded in a checkpoint file or DCP folder, read without its tensors."""
    path = Path(path)
    if D.is_checkpoint(path):
        st = D.read_extra(path)
    else:
        st = _read(path, mmap=True)   # (the tensors stay on disk)
    try:
        return int(st["step"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"checkpoint {path} is incomplete (no step)") from None


def latest(folder: str | Path) -> Path | None:
    """The newest complete checkpoint of run folder ``folder`` by its recorded step (``_candidates``), or None.

    The one rule by which resume, branch, export, eval and generate pick a run's checkpoint: a stale
    ``checkpoint.dcp.old`` (or a multi-process leg's ``checkpoint.dcp``) never beats a newer ``checkpoint.pt``.
    Only reads: a read-only command renames and deletes nothing. A checkpoint whose step cannot be read loses
    to one whose step can; where none can, the first is returned (loading it says what is wrong)."""
    cands = _candidates(Path(folder))
    if len(cands) <= 1:
        return cands[0] if cands else None
    steps = {}
    for p in cands:
        try:
            steps[p] = step_of(p)
        except UserError:
            pass
    if not steps:
        return cands[0]
    return max(steps, key=lambda p: (steps[p], -cands.index(p)))


def state_note(folder: str | Path) -> str:
    """What a failed write in run folder ``folder`` leaves to resume from, for the end of its error line: the
    newest checkpoint (``latest``), or that none was written yet (so a user does not look for one)."""
    p = latest(folder)
    if p is None:
        return "; no checkpoint was written yet"
    try:
        return f"; the last checkpoint (step {step_of(p)}) is intact"
    except UserError:
        return "; the last checkpoint is intact"


def find(path: str | Path) -> Path:
    """A checkpoint file or DCP folder, or the newest checkpoint of a run folder (``latest``)."""
    p = Path(path)
    if D.is_checkpoint(p):
        return p
    if p.is_dir():
        c = latest(p)
        if c is not None:
            return c
        p = p / NAME
    elif p.name == D.DCP_NAME and D.is_checkpoint(p.with_name(D.DCP_OLD)):   # stopped between its renames
        return p.with_name(D.DCP_OLD)
    if not p.is_file():
        holder = lock_holder(p.parent / ".lock") if p.parent.is_dir() else None   # the trainer's run-folder lock
        if holder is not None:
            raise UserError(f"no checkpoint at {path} yet: the run training there (pid {holder or 'unknown'}) has "
                            f"not written one; "
                            f"wait for its first checkpoint (train.checkpoint_every) or for it to end")
        if (p.parent / "metrics.jsonl").is_file():
            raise UserError(f"no checkpoint at {path}: the run there stopped before its first checkpoint "
                            f"(train.checkpoint_minutes), so there is nothing to resume; train again into another "
                            f"--out, or remove {p.parent} first")
        raise UserError(f"no checkpoint at {path} (expected a run folder with {NAME}, or a checkpoint file)")
    return p


def _read(p: Path, mmap: bool = False) -> dict:
    """The dict in checkpoint file ``p`` (``weights_only``; ``mmap``: tensors left on disk until used), its
    format checked; anything else is one UserError."""
    try:
        with warnings.catch_warnings():   # (torch warns of a file in another pickle protocol: not ours; the
            warnings.simplefilter("ignore")   # error below says so in one line)
            st = torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, bad pickle, random bytes, an empty file...
        import re
        text = str(e)
        if _memory_ran_out(e, text, p):
            raise   # host memory ran out while reading the file: not "corrupt" (the CLI says what ran out)
        glob = re.search(r"GLOBAL (\S+)", text)
        if glob:   # a pickle that names a Python object (a function to call...): never unpickled
            raise UserError(f"checkpoint {p} holds objects other than tensors and plain data ({glob.group(1)}), "
                            f"which mxtrain does not load (the folder is not trusted: mxtrain's checkpoints never "
                            f"hold them); restore it from a trusted copy or start a new run") from None
        why = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)   # (torch's long preamble left out)
        first = why.group(1).strip() if why else (text.splitlines() or [""])[0]
        raise UserError(f"checkpoint {p} is corrupt or truncated ({type(e).__name__}{': ' + first[:120] if first else ''}); "
                        f"restore it or start a new run") from None
    if not isinstance(st, dict) or st.get("format") != FORMAT:
        raise UserError(f"{p} is not an mxtrain checkpoint (format {st.get('format') if isinstance(st, dict) else None!r})")
    return st


def _memory_ran_out(e: Exception, text: str, p: Path) -> bool:
    """Did reading checkpoint ``p`` fail because host memory ran out, rather than because the file is damaged?
    An allocation larger than the whole file is the file's fault (a damaged size field): no tensor read from it
    can be larger."""
    import re
    if not (isinstance(e, MemoryError) or "DefaultCPUAllocator" in text or "can't allocate memory" in text):
        return False
    asked = re.search(r"tried to allocate (\d+) bytes", text)
    try:
        return asked is None or int(asked.group(1)) <= os.path.getsize(p)
    except OSError:
        return True


def load(path: str | Path) -> dict:
    """The state in a checkpoint file, or in the newest checkpoint of a run folder when that is a
    ``checkpoint.pt`` (a DCP folder is read by ``mxtrain.train.parallel``)."""
    p = find(path)
    if p.is_dir():
        raise UserError(f"{p} is a multi-process (DCP) checkpoint, not a checkpoint file")
    st = _read(p)
    for k in ("model", "optimizer", "step", "loader", "config", "rng"):
        if k not in st:
            raise UserError(f"checkpoint {p} is incomplete (no {k!r})")
    return st


def check_compatible(saved: dict, now: dict, path) -> None:
    diffs = []
    for key in IDENTITY_KEYS:
        a, b = saved, now
        for k in key:
            a = a.get(k) if isinstance(a, dict) else None
            b = b.get(k) if isinstance(b, dict) else None
        if isinstance(a, dict) and isinstance(b, dict):   # a key added since the checkpoint: unset is absent
            a, b = ({k: v for k, v in d.items() if v is not None} for d in (a, b))
        if a != b and isinstance(a, dict) and isinstance(b, dict):   # name the fields that differ
            diffs += [f"{'.'.join(key)}.{k} ({a.get(k)!r} in checkpoint, {b.get(k)!r} now)"
                      for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(f"{'.'.join(key)} ({a!r} in checkpoint, {b!r} now)")
    if diffs:
        raise UserError(f"checkpoint {path} does not match this config: {'; '.join(diffs)}")


def keep_copy(path: Path, step: int) -> None:
    """Keep the checkpoint just written at ``path`` as ``checkpoint-<step>.pt`` (a hard link where the file
    system allows: the next checkpoint replaces ``checkpoint.pt`` by a rename, the link keeps this one) or,
    for a DCP folder, ``checkpoint-<step>.dcp`` (a copy)."""
    path = Path(path)
    dst = path.with_name(kept_name(step, dcp=path.is_dir()))
    try:
        tmp = temp_path(dst)
        if path.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(path, tmp)
            replace_folder(tmp, dst)
            return
        if tmp.exists():
            tmp.unlink()
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copy2(path, tmp)
        os.replace(tmp, dst)
    except OSError as e:
        raise UserError(f"cannot keep checkpoint {dst}: {e.strerror or e}") from None


def kept_name(step: int, dcp: bool = False) -> str:
    """The file (folder) name of the checkpoint kept at ``step``: ``checkpoint-<step>.pt`` (``.dcp``)."""
    return f"checkpoint-{step}.{'dcp' if dcp else 'pt'}"
