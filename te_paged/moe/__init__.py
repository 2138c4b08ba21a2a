"""MoE expert modules: ``TEGroupedMLP`` and selective recompute."""

from te_paged.moe.config_adapter import as_moe_config
from te_paged.moe.experts import TEGroupedMLP
from te_paged.moe.recompute import CheckpointWithoutOutput

__all__ = ["CheckpointWithoutOutput", "TEGroupedMLP", "as_moe_config"]
