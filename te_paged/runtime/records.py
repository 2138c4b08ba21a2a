"""What :class:`~te_paged.runtime.PagedStashRunner` reports: its :class:`StepRecord` (one
per step, also a JSON line) and its errors. Free of torch: te_paged.jax reports the same record
(what a rerun puts back is :class:`~te_paged.runtime.step_state.StepState`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


class FallbackLimitError(RuntimeError):
    """Too many consecutive fallbacks: the static budgets are too small for this routing."""


class PoolLimitError(RuntimeError):
    """A stash overflow needs a pool larger than the runner's ``max_pool_bytes`` allows."""


class CapacityLimitError(RuntimeError):
    """A step needed a wire budget larger than the runner's ``max_capacity_factor`` allows."""


@dataclasses.dataclass
class StepRecord:
    """What happened in one step (also one JSON line via :meth:`to_json`)."""

    step: int
    attempt: int  # 1, or 2 when the step was rerun
    enabled: bool  # paged stash active in the attempt whose result was kept
    stash_overflow_ranks: int  # ranks whose stash overflowed in attempt 1
    overbudget_ranks: int  # ranks that dropped assignments over their token budget in attempt 1
    host_spill_ranks: int  # ranks that spilled a tensor to the host tier (no rerun needed)
    will_retry: bool  # attempt 1 was invalid and the step was rerun
    pool_high_water_pages: dict[str, int]  # max over ranks, per pool key
    pool_pages: dict[str, int]
    peak_tokens: int  # max over ranks and layers of tokens routed to a rank (before dropping)
    budget_tokens: int  # the static per-rank budget (max_num_tokens)
    balanced_tokens: int  # tokens per rank under perfect balance (tokens × top-k)
    suggested_capacity_factor: float | None = None
    suggested_buffer_size_factor_cuda: float | None = None
    fallback_peak_bytes: int | None = None  # memory the dropless rerun needed
    fallback_memory_method: str | None = None
    # Pipeline parallelism: per stage (its index, as a string), the max over its ranks of the
    # pool high-water pages per key; empty with one stage.
    stage_pool_high_water_pages: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # This rank's module buffers the failed attempt changed for the first time, so not copied
    # before it: the rerun started from their changed values (empty: everything was restored).
    unrestored_state: list[str] = dataclasses.field(default_factory=list)
    # Per pool key, max over ranks of the pages the step needed at its peak, stored or not
    # (State.DEMAND_HWM): what a pool would have to hold for the step not to overflow.
    pool_demand_pages: dict[str, int] = dataclasses.field(default_factory=dict)
    # This rank's pools that grew after this step (grow_pool): key -> {"from": pages, "to":
    # pages, "needed": pages, "why": "capture" | "overflow" | "headroom"}; the next step
    # allocates them (see PagedStashRunner).
    pool_growth: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    # The dispatchers' wire budget in this step: a2a_capacity_factor and the pair capacity C
    # (rows one rank sends another); the largest pair demand over ranks and layers.
    a2a_capacity_factor: float | None = None
    pair_capacity: int = 0
    peak_pair_tokens: int = 0
    # The budget changed after this step (grow_capacity): {"factor": "a2a_capacity_factor"
    # (te_paged's wire) | "moe_expert_rank_capacity_factor" (a receive budget: Megatron's
    # HybridEP), "from": factor, "to": factor, "needed": the factor that just held the step,
    # "why": "capture" | "over budget" | "headroom" | "warm-up" (the auto wire's one sizing,
    # which may lower it)}; the next dispatch uses it. Empty: unchanged.
    capacity_growth: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Bytes this rank handed the all-to-alls in the step, every attempt (docs/run-record.md).
    bytes_sent: int = 0
    # Saved tensors this rank's managers kept unpaged in attempt 1, their backward following
    # their forward at once (skip_immediate_backward); 0 in the capture step, which learns them.
    stashes_skipped: int = 0
    # Why this rank's managers paged nothing in the step although stashing was on and scopes
    # opened with grad enabled (PagedStashManager.paged_nothing: an outer saved-tensor hooks
    # context, compiled code that saved nothing through te_paged, unmarked producers); None
    # when they paged (or opened no such scope).
    paged_nothing: str | None = None
    # This rank's microbatches in the step, in forward order, tokens per rank each (its first
    # MoE layer's dispatches), and the largest any rank had: variable-length workloads.
    microbatch_tokens: list[int] = dataclasses.field(default_factory=list)
    max_microbatch_tokens: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def paged_nothing(managers) -> str | None:
    """The first of ``managers`` that paged nothing in the step: its cause (each says it once,
    at WARNING; see ``PagedStashManager.paged_nothing``), or None."""
    return next((c for c in (m.paged_nothing() for m in managers) if c is not None), None)


class StepDesyncError(RuntimeError):
    """The ranks reduced flags of different steps: one of them skipped or repeated a step."""


class InvalidCountsError(RuntimeError):
    """A rank's layers saw token counts or expert ids that cannot be right (not an overflow: a
    rerun would see them again)."""
