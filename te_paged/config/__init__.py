"""Configuration: `MoEConfig` and the enums (and registries) its choice-valued fields are validated
against. `Fp8Recipe` (of `te_paged.grouped`) and `KernelBackend` (of `te_paged.kernels`) are
re-exported here, where the fields that take them are."""

# ruff: noqa: E402 — the torch check comes before the imports that need torch

from __future__ import annotations

from te_paged._lazy import require_torch

require_torch(__name__)

from te_paged.config.moe_config import (
    Activation,
    MoEConfig,
    RecomputeGranularity,
    RecomputeModule,
)
from te_paged.grouped.fp8 import Fp8Recipe
from te_paged.kernels.backends import KernelBackend

__all__ = [
    "Activation",
    "Fp8Recipe",
    "KernelBackend",
    "MoEConfig",
    "RecomputeGranularity",
    "RecomputeModule",
]
