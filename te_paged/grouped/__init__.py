"""Compute on static expert buffers: GroupedTensor, device-initiated GroupedLinear, fused
probability-weighted activations and FP8 storage of saved inputs."""

# ruff: noqa: E402 — the torch check comes before the imports that need torch

from te_paged._lazy import require_torch

require_torch(__name__)

from te_paged.grouped.activations import weighted_quick_geglu, weighted_swiglu
from te_paged.grouped.fp8 import (
    Fp8Recipe,
    Fp8Tensor,
    dequantize,
    fp8_supported,
    mark_fp8_saved,
    quantize,
)
from te_paged.grouped.grouped_linear import GroupedLinear, make_grouped_linear
from te_paged.grouped.grouped_tensor import GroupedTensor

__all__ = [
    "Fp8Recipe",
    "Fp8Tensor",
    "GroupedLinear",
    "GroupedTensor",
    "dequantize",
    "fp8_supported",
    "make_grouped_linear",
    "mark_fp8_saved",
    "quantize",
    "weighted_quick_geglu",
    "weighted_swiglu",
]
