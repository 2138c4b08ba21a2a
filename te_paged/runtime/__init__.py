"""Step runtime: the rerun-on-overflow runner."""

from te_paged.runtime.runner import (
    FallbackLimitError,
    PagedStashRunner,
    StepDesyncError,
    StepRecord,
    StepState,
)

__all__ = ["FallbackLimitError", "PagedStashRunner", "StepDesyncError", "StepRecord", "StepState"]
