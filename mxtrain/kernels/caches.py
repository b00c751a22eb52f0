"""What the kernels remember within a process, in one object: ``CACHES`` (a ``KernelCaches``).

Everything here is derived: dropping it (``CACHES.clear()``) changes no result, only costs the work of
finding it again (a device query, a GEMM probe, a kernel self-check, a launch plan). Its lifetime is the
process; tests that need a first call's behaviour clear it. Launch plans are bounded (least recently
used evicted first: a run with many distinct shapes, e.g. variable sequence lengths, keeps the ones in
use); the other entries are few (one per device or per kernel variant).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["LRU", "KernelCaches", "CACHES"]

_MISSING = object()


class LRU:
    """A dict of at most ``maxsize`` entries; adding one more evicts the least recently used."""

    __slots__ = ("maxsize", "_d")

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._d: OrderedDict = OrderedDict()

    def get(self, key, default=None):
        d = self._d
        v = d.get(key, _MISSING)
        if v is _MISSING:
            return default
        d.move_to_end(key)
        return v

    def __setitem__(self, key, value) -> None:
        d = self._d
        d[key] = value
        d.move_to_end(key)
        while len(d) > self.maxsize:
            d.popitem(last=False)

    def __getitem__(self, key):
        v = self.get(key, _MISSING)
        if v is _MISSING:
            raise KeyError(key)
        return v

    def __contains__(self, key) -> bool:
        return key in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self):
        return iter(list(self._d))

    def keys(self):
        return list(self._d.keys())

    def values(self):
        return list(self._d.values())

    def items(self):
        return list(self._d.items())

    def clear(self) -> None:
        self._d.clear()


class KernelCaches:
    """The kernels' per-process memory.

    * ``capability``: CUDA device index -> compute capability (``mxtrain.kernels.capability``)
    * ``backends``: ``torch.device`` (with an index) -> its GEMM backend (``mxtrain.kernels.backend``)
    * ``native``: CUDA device index -> whether an MX-native GEMM exists there (``mxdot.supports_native``)
    * ``probes``: device name (and, once a layer call asked, the ``torch.device`` itself) -> which blockwise
      ``_scaled_mm`` configurations are exact (``gemm.probe``), ``"native:<device>"`` -> the native-MX GEMM
      plan (``gemm.native_plan``), and
      ``"mm_out_dtype:<device>"`` -> whether ``torch.mm`` gives float32 from bf16 there (``linear._mm_f32``)
    * ``verified``, ``dual_verified``: kernel variant -> whether its self-check passed on this GPU
      (``quantize_mxfp4_2d``'s fused carrier, ``quantize_mxfp4_dual``)
    * ``plans``, ``dual_plans``: launch plans (``mxfp4.launch.Plan``, ``mxfp4.launch.DualPlan``; None where a
      configuration cannot be launched directly), LRU-bounded
    * ``direct``: launch plans of the small kernels (the call seeds, the carrier rebuild:
      ``mxfp4.launch.launch_direct``), LRU-bounded
    """

    def __init__(self, max_plans: int = 4096, max_dual_plans: int = 1024):
        self.capability: dict = {}
        self.backends: dict = {}
        self.native: dict = {}
        self.probes: dict = {}
        self.verified: dict = {}
        self.dual_verified: dict = {}
        self.plans = LRU(max_plans)
        self.dual_plans = LRU(max_dual_plans)
        self.direct = LRU(max_dual_plans)

    def clear_plans(self) -> None:
        """Drop the launch plans (the next launch of each configuration takes Triton's generic path)."""
        self.plans.clear()
        self.dual_plans.clear()
        self.direct.clear()

    def clear(self) -> None:
        """Forget everything, as a new process would start."""
        for d in (self.capability, self.backends, self.native, self.probes, self.verified, self.dual_verified):
            d.clear()
        self.clear_plans()


CACHES = KernelCaches()
