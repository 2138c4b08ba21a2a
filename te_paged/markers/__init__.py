"""Which saved tensors the paged stash may own (producer markers) and which it must leave to
selective recompute (storage-level markers)."""

# ruff: noqa: E402 — the torch check comes before the imports that need torch

from te_paged._lazy import require_torch

require_torch(__name__)

from te_paged.markers.producer import (
    GROUPED_TENSOR_ATTR,
    MXFP8_SCALE_BLOCK,
    MarkerKind,
    grouped_tensor_marker,
    is_grouped_tensor_marked,
    mark_grouped_tensor,
    propagate_paged_stash_marker,
)
from te_paged.markers.recompute import is_checkpoint_without_output_tensor, mark_recompute_managed

__all__ = [
    "GROUPED_TENSOR_ATTR",
    "MXFP8_SCALE_BLOCK",
    "MarkerKind",
    "grouped_tensor_marker",
    "is_checkpoint_without_output_tensor",
    "is_grouped_tensor_marked",
    "mark_grouped_tensor",
    "mark_recompute_managed",
    "propagate_paged_stash_marker",
]
