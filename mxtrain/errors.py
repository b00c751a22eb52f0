"""Errors meant for users: the CLI prints their message on one line and exits non-zero."""


class UserError(Exception):
    """Bad input the user can fix (missing file, unknown name, bad override...).

    The message says what is wrong and how to fix it; the CLI prints ``mxtrain: error: <message>``
    and exits with status 2, never a traceback.
    """


class OutOfMemory(UserError):
    """The GPU ran out of memory: what was asked, what the GPU holds, and the settings that need less.
    Exit status 1 (the input was valid; the machine too small for it)."""

    exit_code = 1


def read_json_object(path, what: str = "") -> dict:
    """The JSON object in the file ``path``; a ``UserError`` naming the file when it cannot be read, is not
    JSON, or holds something other than an object (a damaged or hand-edited run or study folder)."""
    import json
    from pathlib import Path
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise UserError(f"cannot read {p}: {e.strerror or e}") from None
    except RecursionError:
        raise UserError(f"{p} is nested too deeply to be a file mxtrain wrote{': ' + what if what else ''}; "
                        f"restore it or remove it") from None
    except (ValueError, UnicodeDecodeError) as e:   # (json.JSONDecodeError is a ValueError)
        raise UserError(f"{p} is not valid JSON ({str(e)[:120]}){': ' + what if what else ''}; restore it or "
                        f"remove it") from None
    if not isinstance(d, dict):
        raise UserError(f"{p} holds a JSON {type(d).__name__}, not the object mxtrain writes there"
                        f"{': ' + what if what else ''}; restore it or remove it")
    return d



# the largest integer a setting may hold: counts and seeds are stored in int64 tensors and checkpoints
INT_MAX = 2**63 - 1


def check_number(name: str, v, lo=None, hi=None, lo_open=False, hi_open=False, integer=False,
                 optional=False) -> None:
    """One number a user gave (a flag, ``--set``, a config file): a finite number (an int if ``integer``, at
    most ``INT_MAX`` in size unless ``hi`` says less) within [lo, hi] (open ends as asked); a ``UserError``
    naming ``name`` otherwise. The one range check every flag parser and config check uses."""
    import math
    if v is None and optional:
        return
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise UserError(f"{name} must be {kind}, got {v!r}")
    if integer:   # (math.isfinite of a 400-digit int is an OverflowError)
        if not -INT_MAX - 1 <= v <= INT_MAX and (lo is None or v >= lo) and (hi is None or v <= hi):
            lo, hi = -INT_MAX - 1 if lo is None else lo, INT_MAX if hi is None else hi
    elif not math.isfinite(v):
        raise UserError(f"{name} must be finite, got {v}")
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
    if bad_lo or bad_hi:
        shown = v if not integer or abs(v) < 10**30 else f"an integer of {len(str(abs(v)))} digits"
        if not bad_hi and hi is not None and hi >= 2**53:   # a size guard only: said when it is what failed
            hi = None
        rng = (f"{'(' if lo_open else '['}{'-inf' if lo is None else _short(lo)}, "
               f"{'inf' if hi is None else _short(hi)}{')' if hi_open or hi is None else ']'}")
        raise UserError(f"{name} must be in {rng}, got {shown}")


def _short(x) -> str:
    return "2**63 - 1" if x == INT_MAX else "-2**63" if x == -INT_MAX - 1 else f"{x:g}" if isinstance(x, float) else str(x)


def number_flag(lo=None, hi=None, lo_open=False, hi_open=False, integer=False):
    """An argparse ``type=`` for a numeric flag: the text read as an int (``integer``) or a float, then
    ``check_number``'s range check; argparse names the flag in its one-line error."""
    import argparse

    def parse(text: str):
        try:
            v = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if integer else 'a number'}, "
                                             f"got {text[:40]!r}") from None
        try:
            check_number("", v, lo, hi, lo_open, hi_open, integer)
        except UserError as e:   # argparse writes "argument --flag: must be ..."
            raise argparse.ArgumentTypeError(str(e).strip()) from None
        return v
    return parse


# ------------------------------------------------------------------------------------------------------------
# the machine's limits (full disk, file size limit, host memory): one line, for the CLI and the study's workers

_NO_SPACE = {28, 122, 27}   # ENOSPC, EDQUOT, EFBIG (a full disk, a full quota, the file size limit)


def machine_limit_message(e: BaseException, args=None) -> str | None:
    """One line for what stopped a command that its input did not get wrong, or None (a bug: its traceback):
    a full disk or quota (naming the folder), host memory exhausted (naming what to reduce), a panic of a Rust
    library (``tokenizers``: pyo3's PanicException, a BaseException, not an Exception)."""
    import errno
    cause = e
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in _NO_SPACE):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        where = (getattr(cause, "folder", None) or   # (set by the code that knows the folder: data prepare)
                 getattr(args, "out", None) or getattr(args, "dir", None) or
                 (__import__("os").path.dirname(str(cause.filename)) or "." if cause.filename else "the output folder"))
        if cause.errno == errno.EFBIG:   # a file grew past the process's file size limit (ulimit -f, a batch job's)
            return (f"cannot write into {where}: file too large (a file grew past the file size limit of this "
                    f"process, `ulimit -f`, or of the file system); raise the limit or write to another folder "
                    f"(--out), then run the command again (what it wrote whole is kept)")
        what = "no space left on the device" if cause.errno == errno.ENOSPC else "the disk quota is used up"
        return (f"cannot write into {where}: {what}; free space there or give another folder (--out), then run "
                f"the command again (what it wrote whole is kept)")
    text = " ".join(str(e).split())
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and (
            "DefaultCPUAllocator" in text or "can't allocate memory" in text)):
        return f"out of host (CPU) memory{_asked(text)}; " + _LOWER.get(getattr(args, "cmd", None), _LOWER[None])
    if type(e).__name__ == "PanicException":
        return f"a library failed inside (a Rust panic: {text[:200]}); the input that reached it is not supported"
    return None


# what to lower when host memory ran out, by command
_STEP = ("reduce what one step holds (--batch-size, --seq-len, --micro-batch-size for gradient accumulation, a "
         "smaller --model)")
_LOWER = {"train": _STEP, "study": _STEP, "bench": _STEP,
          "eval": "use a smaller --batch-size (windows per forward pass; --max-tokens evaluates fewer of them)",
          "generate": "use a shorter --prompt or fewer --max-tokens",
          None: _STEP + " or the input's size"}


def _asked(text: str) -> str:
    """What an allocation that failed asked for, from torch's message ("you tried to allocate N bytes"): ``": a
    block of 1.0 GiB could not be allocated"``, or "" when the message does not say."""
    import re
    m = re.search(r"tried to allocate (\d+) bytes", text)
    if not m:
        return ""
    n = int(m.group(1))
    size = f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"
    return f": a block of {size} could not be allocated"


def thread_limit_hook(seen: list):
    """A ``threading.excepthook`` for a command's run (the CLI's, a study worker's): a background thread stopped
    by a machine limit (a
    TensorBoard event writer on a full disk) prints no traceback; its message is kept in ``seen``. The thread's
    owner re-raises the error in the command itself (tensorboard does on its next write), whose one line then
    says it; a command that still succeeds prints the kept message as a warning. Anything else: the previous
    hook (a bug's traceback)."""
    import threading
    previous = threading.excepthook

    def hook(a):
        msg = machine_limit_message(a.exc_value) if a.exc_value is not None else None
        if msg is None:
            return previous(a)
        seen.append(msg)
    return hook, previous
