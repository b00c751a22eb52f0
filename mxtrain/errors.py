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

