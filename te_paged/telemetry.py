"""NVTX ranges (through the optional ``nvtx`` package) and a pool-occupancy timeline.

``nvtx_range(name, layer=None)`` marks a region for Nsight Systems when the ``nvtx`` package
is installed and is a no-op otherwise (looked up once per process, lazily: importing te_paged
imports no profiler). Every range is in the NVTX domain ``te_paged``:

* per layer — ``te_paged.dispatch``, ``te_paged.experts``, ``te_paged.combine`` (te_paged's
  ``MoELayer``), ``te_paged.stash`` and ``te_paged.pop`` (one saved tensor; the pop carries the
  layer that stashed it). With a layer number the name ends in ``.layer<N>``
  (``te_paged.stash.layer3``): the expert module's ``layer_number`` — Megatron's 1-based
  ``layer_number`` (global across pipeline stages), which ``TransformerLayer`` hands the MoE
  layer through ``set_layer_number``, or ``MoELayer(layer_number=...)`` /
  ``TEGroupedMLP(layer_number=...)``. Without one the name has no suffix.
* per step — ``te_paged.reduce`` (the runner's one flags all-reduce and its host read),
  ``te_paged.rerun`` (the dropless fallback) and ``te_paged.allocate`` (the pools, allocated
  at the ``reset()`` after the capture step or after a fallback freed them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import sys
from collections.abc import Iterator

__all__ = ["TimelineEvent", "nvtx_available", "nvtx_range", "range_name"]


@functools.lru_cache(maxsize=1)
def _nvtx():
    if importlib.util.find_spec("nvtx") is None:
        return None
    import nvtx

    return nvtx


def _compiling() -> bool:
    """Whether torch.compile is tracing (a range there would mark tracing, not the run)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def nvtx_available() -> tuple[bool, str]:
    if _nvtx() is None:
        return False, "the nvtx package is not installed (pip install 'te_paged[nvtx]')"
    return True, ""


def range_name(name: str, layer: int | None = None) -> str:
    """``name``, or ``name.layer<N>`` for a range that belongs to layer ``N``."""
    return name if layer is None else f"{name}.layer{layer}"


@contextlib.contextmanager
def nvtx_range(name: str, layer: int | None = None) -> Iterator[None]:
    """An NVTX range ``range_name(name, layer)`` in the domain ``te_paged`` (no-op without
    the ``nvtx`` package; and while torch.compile traces, where Python ranges mark the tracing,
    not the compiled code's run: te_paged's stash ops keep theirs, they run as Python)."""
    if _compiling():
        yield
        return
    nvtx = _nvtx()
    if nvtx is None:
        yield
        return
    with nvtx.annotate(range_name(name, layer), domain="te_paged"):
        yield


@dataclasses.dataclass
class TimelineEvent:
    """One stash or pop, with the pool's occupancy right after it (host-read: telemetry only)."""

    index: int
    kind: str  # "stash" or "pop"
    key: str
    pages_in_use: int
    rows_in_use: int
    page_size: int

    @property
    def fragmentation(self) -> float:
        """Share of the pages in use not holding a row (padding in each tensor's last page)."""
        slots = self.pages_in_use * self.page_size
        return 0.0 if slots == 0 else 1 - self.rows_in_use / slots
