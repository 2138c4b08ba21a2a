"""The page pool and its lifecycle: buffers, the manager and its saved-tensor scope."""

# ruff: noqa: E402 — the torch check comes before the imports that need torch

from te_paged._lazy import require_torch

require_torch(__name__)

from te_paged.kernels.compiled import StashSite, save_for_backward, saved_tensors
from te_paged.stash.buffer import PagedStashBuffer, StashKey, storage_dtype
from te_paged.stash.manager import PagedStashManager, StashMode, StashStats

__all__ = [
    "PagedStashBuffer",
    "PagedStashManager",
    "StashKey",
    "StashMode",
    "StashSite",
    "StashStats",
    "save_for_backward",
    "saved_tensors",
    "storage_dtype",
]
