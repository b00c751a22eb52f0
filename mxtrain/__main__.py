"""``python -m mxtrain ...`` is the ``mxtrain`` command."""

from .cli import entry

entry()
