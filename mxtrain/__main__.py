"""``python -m mxtrain ...`` is the ``mxtrain`` command."""

from .cli.core import entry

entry()
