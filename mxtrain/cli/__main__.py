"""``python -m mxtrain.cli ...`` is the ``mxtrain`` command."""

from .core import entry

entry()
