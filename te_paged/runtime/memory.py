"""Peak memory of a piece of work, measured by torch's own trackers, and the capacity model.

* CUDA: the caching allocator's statistics (``max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus what was allocated before).
* CPU: torch's dispatch-based ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which
  sees every storage allocated while the work runs and reports the peak by category.

Either way the figure is the peak of memory allocated *during* the work; memory that existed
before it (parameters, a stash pool allocated at the step boundary) is not included, so callers
add the pool explicitly when comparing paged stash ON against OFF.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MemoryReport", "capacity_model_saving", "measure_peak"]


@dataclasses.dataclass
class MemoryReport:
    peak_bytes: int
    method: str
    by_category: dict[str, int]


def measure_peak(fn: Callable[[], Any], device: torch.device | str) -> tuple[Any, MemoryReport]:
    """Run ``fn`` and return its result and the peak bytes it allocated on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        return result, MemoryReport(peak, "CUDA caching allocator peak (max_memory_allocated)", {})
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        result = fn()
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    categories = {getattr(k, "value", str(k)): int(v) for k, v in snapshot.items() if k != "Total"}
    report = MemoryReport(int(snapshot.get("Total", 0)), "torch MemTracker peak (dispatch-based)",
                          categories)  # fmt: skip
    return result, report


def capacity_model_saving(capacity_factor: float, buffer_factor: float, s_bytes: float) -> float:
    """Predicted peak saving of paged stashing: ``(capacity_factor − buffer_factor) × S``."""
    return (capacity_factor - buffer_factor) * s_bytes
