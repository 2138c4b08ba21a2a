"""The page pool and its lifecycle: buffers, the manager and its saved-tensor scope."""

from te_paged.stash.buffer import PagedStashBuffer, StashKey, storage_dtype
from te_paged.stash.manager import PagedStashManager, StashMode, StashStats

__all__ = [
    "PagedStashBuffer",
    "PagedStashManager",
    "StashKey",
    "StashMode",
    "StashStats",
    "storage_dtype",
]
