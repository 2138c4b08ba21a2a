"""NVTX ranges (through the optional ``nvtx`` package) and a pool-occupancy timeline.

``nvtx_range(name)`` marks a region for Nsight Systems when the ``nvtx`` package is installed
and is a no-op otherwise (looked up once per process, lazily: importing te_paged imports no
profiler). te_paged marks ``te_paged.stash``, ``te_paged.pop``, ``te_paged.dispatch``,
``te_paged.combine`` and ``te_paged.experts``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
from collections.abc import Iterator

__all__ = ["TimelineEvent", "nvtx_available", "nvtx_range"]


@functools.lru_cache(maxsize=1)
def _nvtx():
    if importlib.util.find_spec("nvtx") is None:
        return None
    import nvtx

    return nvtx


def nvtx_available() -> tuple[bool, str]:
    if _nvtx() is None:
        return False, "the nvtx package is not installed (pip install 'te_paged[nvtx]')"
    return True, ""


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    nvtx = _nvtx()
    if nvtx is None:
        yield
        return
    with nvtx.annotate(name, domain="te_paged"):
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
