"""``mxtrain bench``: GPU benchmarks of the MX linear layer and of whole training steps, JSON out
(``suite``: the command and the kernel, layer and block benchmarks; ``step``: the whole-step benchmark;
``limits``: counted FLOPs, bytes and the fastest step a recipe can reach, no GPU needed)."""

from .suite import main, register

__all__ = ["main", "register"]
