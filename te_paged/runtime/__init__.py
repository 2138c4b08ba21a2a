"""Step runtime: the rerun-on-overflow runner."""

from te_paged.runtime.runner import (
    CapacityLimitError,
    FallbackLimitError,
    InvalidCountsError,
    PagedStashRunner,
    PoolLimitError,
    StepDesyncError,
    StepRecord,
    StepState,
)

__all__ = [
    "CapacityLimitError",
    "FallbackLimitError",
    "InvalidCountsError",
    "PagedStashRunner",
    "PoolLimitError",
    "StepDesyncError",
    "StepRecord",
    "StepState",
]
