"""Step runtime: the rerun-on-overflow runner."""

from te_paged.runtime.runner import FallbackLimitError, PagedStashRunner, StepRecord

__all__ = ["FallbackLimitError", "PagedStashRunner", "StepRecord"]
