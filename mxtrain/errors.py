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
    except (ValueError, UnicodeDecodeError) as e:   # (json.JSONDecodeError is a ValueError)
        raise UserError(f"{p} is not valid JSON ({str(e)[:120]}){': ' + what if what else ''}; restore it or "
                        f"remove it") from None
    if not isinstance(d, dict):
        raise UserError(f"{p} holds a JSON {type(d).__name__}, not the object mxtrain writes there"
                        f"{': ' + what if what else ''}; restore it or remove it")
    return d


def write_json_atomic(path, obj, **dumps) -> None:
    """``obj`` as JSON into ``path``, whole or not at all (a temporary sibling renamed over it: a run or study
    stopped mid-write leaves the previous file)."""
    import json
    import os
    from pathlib import Path
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, **dumps))
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"cannot write {p}: {e.strerror or e}") from None
