"""Configuration: `MoEConfig` and the enums its choice-valued fields are validated against."""

from __future__ import annotations

from te_paged.config.moe_config import (
    Activation,
    Fp8Recipe,
    KernelBackend,
    MoEConfig,
    RecomputeGranularity,
    RecomputeModule,
)

__all__ = [
    "Activation",
    "Fp8Recipe",
    "KernelBackend",
    "MoEConfig",
    "RecomputeGranularity",
    "RecomputeModule",
]
