"""``ReceiveBudget``: the runner-facing counters of a framework's device-initiated dispatcher.

Megatron's HybridEP dispatcher and torchtitan's (``deep_ep.HybridEPBuffer``) write only the real
rows into a static receive buffer of ``num_permuted_tokens`` rows, drop the rows past it and set
an overflow flag on the device. te_paged's runners read :class:`StaticBudgetDispatcher`'s device
counters and switches; a :class:`ReceiveBudget` is one with the budget of such a dispatcher
instead of te_paged's own exchange: per receiving rank (``receive_budget``), no wire
(``a2a_capacity_factor`` is ``None``), filled by :meth:`ReceiveBudget.note_dispatch` after each
dispatch of the framework's, and a factor the runner may raise after a step over it
(:meth:`ReceiveBudget.set_capacity_factor`). Its own ``dispatch``/``combine`` are not used.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from te_paged.config.checks import require_real
from te_paged.moe.dispatcher import RankBudget, StaticBudgetDispatcher

__all__ = ["ReceiveBudget", "kept_per_expert"]


def kept_per_expert(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of each expert that fit a buffer of ``rows``, the rows past the budget being
    the tail of the expert-grouped order (HybridEP's): the counts clipped where their running
    sum passes ``rows`` (unchanged when nothing was dropped). Device arithmetic, no host read,
    so the experts and the stash never see counts past their buffer.

    >>> kept_per_expert(torch.tensor([3, 4, 2]), 5).tolist()
    [3, 2, 0]
    """
    ends = tokens_per_expert.cumsum(0).clamp(max=rows)
    return torch.diff(ends, prepend=ends.new_zeros(1))


class ReceiveBudget(StaticBudgetDispatcher):
    """See the module docstring. ``ReceiveBudget(config, ep_group, *, rank_budget,
    max_factor=None, device=None)``: ``config.moe_expert_rank_capacity_factor`` is the
    dispatcher's factor, ``rank_budget(num_tokens, factor)`` its rule for the receive rows, and
    ``max_factor`` the largest factor it takes (torchtitan's HybridEP: 1.0, the worst case)."""

    #: The budget is what one rank receives, not a pair's: runners size it from ``peak_tokens``.
    receive_budget = True
    #: Whether the budget stays static in the runner's rerun (NCCL EP: its capacity is fixed
    #: at a bootstrap, so the rerun gets one that holds :attr:`rerun_rows`); the runner then
    #: checks after the rerun that nothing went over it. HybridEP's rerun is dropless.
    static_rerun = False

    def __init__(
        self,
        config: Any,
        ep_group: dist.ProcessGroup | None,
        *,
        rank_budget: RankBudget,
        max_factor: float | None = None,
        factor_name: str = "moe_expert_rank_capacity_factor",
        device: Any = None,
    ) -> None:
        super().__init__(config, ep_group, device=device, rank_budget=rank_budget)
        #: The name users set the factor by (in messages and ``StepRecord.capacity_growth``).
        self.factor_name = factor_name
        self._a2a = None  # no wire: the framework's dispatcher writes only the real rows
        self.wire_auto = False
        self.max_factor = max_factor
        #: The rows the failed attempt demanded at one rank (the runner's reduced
        #: ``peak_tokens``), set before its rerun: what a budget that stays static in the rerun
        #: must hold. ``None`` until a rerun.
        self.rerun_rows: int | None = None

    def set_capacity_factor(self, factor: float) -> None:
        """The receive budget's factor from the next dispatch on (host only; every rank of the
        group sets the same): the runner's growth after a step over budget."""
        factor = require_real("capacity_factor", factor, strict=True)
        if self.max_factor is not None:
            factor = min(factor, self.max_factor)
        self._capacity_factor = factor

    def fitting_capacity_factor(
        self, num_tokens: int, peak_tokens: int, *, expert_buffer: bool = True
    ) -> float:
        """Smallest factor, in steps of 0.01, whose receive budget for ``num_tokens`` local
        tokens holds ``peak_tokens`` rows arriving at one rank (at most ``max_factor``)."""
        factor = self.smallest_factor(num_tokens, peak_tokens)
        return factor if self.max_factor is None else min(factor, self.max_factor)

    def smallest_factor(self, num_tokens: int, rows: int) -> float:
        """Smallest factor, in steps of 0.01, whose receive budget holds ``rows``: a binary
        search over the hundredths, the rule being monotone in the factor. (A guess from
        ``rows / rank_budget(num_tokens, 1.0)`` overshoots where the rule rounds up: HybridEP's
        ``pad_multiple``, NCCL EP's 64-token chunks.)"""
        whole = max(1, self.rank_budget(num_tokens, 1.0))
        hi = max(1, math.ceil(100 * rows / whole))  # a factor of hi/100 holds rows...
        while self.rank_budget(num_tokens, hi / 100) < rows:  # ...or, rounding aside, one above
            hi *= 2
        lo = 0  # rank_budget(num_tokens, 0) holds nothing; the answer lies in (lo, hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.rank_budget(num_tokens, mid / 100) >= rows:
                hi = mid
            else:
                lo = mid
        return hi / 100

    def dispatch(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("a ReceiveBudget does not dispatch: its framework's dispatcher does")

    def combine(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("a ReceiveBudget does not combine: its framework's dispatcher does")

    def note_dispatch(
        self,
        num_tokens: int,
        budget_rows: int,
        tokens_per_expert: torch.Tensor,
        overflow: torch.Tensor | None,
        row_bytes: int,
        *,
        demanded: torch.Tensor | None = None,
    ) -> None:
        """One dispatch of ``num_tokens`` local tokens into ``budget_rows`` rows, with its
        device ``tokens_per_expert`` (the rows received) and overflow flag (``None``:
        dropless); ``demanded``, where the dispatcher reports it (NCCL EP's
        ``total_recv_tokens``), the rows asked for before any drop, which ``peak_tokens``
        then holds. Device arithmetic only."""
        self.last_num_tokens = num_tokens
        self.note_tokens(num_tokens)
        received = tokens_per_expert.sum().to(self.peak_tokens.device, torch.int64)
        asked = received if demanded is None else demanded.reshape(()).to(received.device)
        torch.maximum(self.peak_tokens, asked.to(torch.int64), out=self.peak_tokens)
        self._note_share(asked, num_tokens)
        # Dispatch, combine and their two backwards move the real rows, and only those.
        self.dropless_bytes.add_(received * (4 * row_bytes))
        if overflow is not None:
            self.budget_tokens = budget_rows
            over = (overflow.reshape(-1) != 0).any().to(self.over_budget.device, torch.int64)
            self.over_budget.add_(over)
