"""The ``mxtrain`` command (layer 7): ``main`` (the parser, ``train``, ``data``, ``branch`` and the dispatch to
the other commands), ``study`` (``study``, ``report``, ``study-import``), ``hf`` (``export``, ``generate``,
``eval``); ``bench`` registers itself from ``mxtrain.bench``. Every bad input reaches the user as one line."""

from .core import entry, main

__all__ = ["main", "entry"]
