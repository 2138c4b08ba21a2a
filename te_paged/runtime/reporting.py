"""What :class:`~te_paged.runtime.PagedStashRunner` says about a step that reruns or spills,
and the factors it suggests (those that would have fitted the step, plus a margin)."""

from __future__ import annotations

import math

from te_paged.runtime.records import StepRecord
from te_paged.runtime.reduction import _RankStats

_MARGIN = 1.05  # headroom on suggested factors, so a repeat of the same peak fits


class Reporting:
    """Part of :class:`~te_paged.runtime.PagedStashRunner` (mixed into it; uses its
    attributes): see the module docstring."""

    def _fallback_message(self, record: StepRecord, flag_ranks: list[list[int]], world: int) -> str:
        overflow, over, spill = flag_ranks
        why = []
        if overflow:
            why.append(f"stash overflow on rank(s) {overflow}")
        wire_over = record.pair_capacity and record.peak_pair_tokens > record.pair_capacity
        if over and wire_over:
            why.append(
                f"over the wire budget on rank(s) {over} (largest pair demand "
                f"{record.peak_pair_tokens} rows, pair capacity {record.pair_capacity} at "
                f"a2a_capacity_factor {record.a2a_capacity_factor:g})"
            )
        elif over and self._receive_budgets():
            why.append(
                f"over the receive budget on rank(s) {over} (budget {record.budget_tokens} rows "
                "a rank; the rerun measures what the step needed"
                + (", and the budget grows to it)" if self.grow_capacity else ")")
            )
        elif over:
            why.append(
                f"over the token budget on rank(s) {over} (peak {record.peak_tokens} tokens "
                f"routed to a rank, budget {record.budget_tokens})"
            )
        if spill:
            why.append(f"host spill on rank(s) {spill}")
        fits = [self._fits_text(self._suggestions(record))] if self._suggestions(record) else []
        if record.capacity_growth:
            growth = record.capacity_growth
            fits.append(f"{growth['factor']} {growth['to']:g}, which it now has")
        return (
            f"PagedStashRunner: step {record.step} reruns dropless without the paged stash "
            f"({world} rank(s): {'; '.join(why)}); its result equals a run without the stash. "
            f"Fallback {self.consecutive_fallbacks} of {self.max_consecutive_fallbacks} allowed "
            "in a row before FallbackLimitError; would have fitted: "
            + (", ".join(fits) or "unknown (no dispatcher reports token counts)")
            + (f"; {self._pool_outcome(record)}" if overflow else "")
        )

    def _suggestions(self, record: StepRecord) -> list[tuple[str, float | int, str]]:
        """``(setting, value, note)`` of what would have fitted the step: the expert buffer's
        factor (where it, not the wire, was the limit), the pool factor with the microbatch
        size it is relative to, and, where the step brought a larger microbatch than the pools
        were sized for, the declared maximum that would have sized them for it (an
        alternative to the pool factor)."""
        expert_fit = record.suggested_capacity_factor
        held = [getattr(d, "capacity_factor", None) for d in self.dispatchers]
        held = [f for f in held if f is not None]
        if expert_fit is not None and held and expert_fit <= min(held):
            expert_fit = None  # the expert buffer held it: the wire was the limit
        fits = [] if expert_fit is None else [(self._factor_name(), expert_fit, "")]
        pool_fit = record.suggested_buffer_size_factor_cuda
        declared = max((m.max_tokens_per_rank or 0 for m in self.managers), default=0)
        sized_for = declared or self.capture_tokens
        if pool_fit is not None:
            relative = (
                f" (x the balanced peak of a microbatch of {sized_for} tokens per rank, "
                + ("the declared maximum)" if declared else "the capture step's largest)")
                if sized_for
                else ""
            )
            fits.append(("moe_paged_stash_buffer_size_factor_cuda", pool_fit, relative))
        tokens = record.max_microbatch_tokens
        if record.stash_overflow_ranks and sized_for and tokens > sized_for:
            fits.append((
                "moe_max_tokens_per_rank", tokens,
                " (this step's largest microbatch; "
                + (f"{sized_for} declared)" if declared else f"the capture step's: {sized_for})"),
            ))  # fmt: skip
        return fits

    @staticmethod
    def _fits_text(fits: list[tuple[str, float | int, str]], verb: str = "") -> str:
        """``fits`` as text: the pool factor and the declared maximum are alternatives."""
        parts = [f"{name} {verb}>= {value}{note}" for name, value, note in fits]
        declared = [p for p, f in zip(parts, fits) if f[0] == "moe_max_tokens_per_rank"]
        rest = [p for p in parts if p not in declared]
        if declared and rest:
            rest[-1] = f"{rest[-1]} or {declared[0]}"
            return " and ".join(rest)
        return " and ".join(rest + declared)

    def _spill_message(self, record: StepRecord, ranks: list[int], world: int) -> str:
        fit = self._fitting_pool_factor(record)
        keep = (
            f"; moe_paged_stash_buffer_size_factor_cuda >= {fit} would keep them on the device"
            if fit is not None
            else ""
        )
        return (
            f"PagedStashRunner: step {record.step}: rank(s) {ranks} of {world} stashed tensors in "
            "the host tier (the device pool was full; no rerun needed, but each spilled tensor "
            f"is copied to the host and back){keep}"
        )

    def _suggest(
        self, record: StepRecord, peak_pair_tokens: int, per_rank: list[_RankStats]
    ) -> None:
        # te_paged's budget is per (source, destination) pair: size from that peak. A receive
        # budget (HybridEP's) reports what it kept, so only its rerun can tell what it needed.
        d = self.dispatchers[0] if self.dispatchers else None
        if record.overbudget_ranks and d is not None and not getattr(d, "receive_budget", False):
            peak = self._pair_demand_at(d, d.last_num_tokens, peak_pair_tokens)
            fit = d.fitting_capacity_factor(
                d.last_num_tokens, math.ceil(peak * _MARGIN), expert_buffer=True
            )
            record.suggested_capacity_factor = fit
        if record.stash_overflow_ranks:
            record.suggested_buffer_size_factor_cuda = self._fitting_pool_factor(record, per_rank)
