"""MoE modules: ``TEGroupedMLP``, selective recompute, router, dispatcher and ``MoELayer``."""

# ruff: noqa: E402 — the torch check comes before the imports that need torch

from te_paged._lazy import require_torch

require_torch(__name__)

from te_paged.moe.config_adapter import as_moe_config
from te_paged.moe.dispatcher import DispatchHandle, StaticBudgetDispatcher, static_budget
from te_paged.moe.experts import TEGroupedMLP
from te_paged.moe.layer import MoELayer, init_expert_weights_
from te_paged.moe.participant import PagedStashParticipant, Participants, find_participants
from te_paged.moe.receive_budget import ReceiveBudget, kept_per_expert
from te_paged.moe.recompute import CheckpointWithoutOutput
from te_paged.moe.router import RouterOutput, RoutingSkew, TopKRouter

__all__ = [
    "CheckpointWithoutOutput",
    "DispatchHandle",
    "MoELayer",
    "PagedStashParticipant",
    "Participants",
    "ReceiveBudget",
    "RouterOutput",
    "RoutingSkew",
    "StaticBudgetDispatcher",
    "TEGroupedMLP",
    "TopKRouter",
    "as_moe_config",
    "find_participants",
    "init_expert_weights_",
    "kept_per_expert",
    "static_budget",
]
