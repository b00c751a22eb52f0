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
