"""Step runtime: the rerun-on-overflow runner."""

from te_paged.runtime.runner import (
    FallbackLimitError,
    InvalidCountsError,
    PagedStashRunner,
    PoolLimitError,
    StepDesyncError,
    StepRecord,
    StepState,
)

__all__ = [
    "FallbackLimitError",
    "InvalidCountsError",
    "PagedStashRunner",
    "PoolLimitError",
    "StepDesyncError",
    "StepRecord",
    "StepState",
]
