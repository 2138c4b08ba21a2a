"""How :class:`~te_paged.runtime.PagedStashRunner` sizes the dispatchers' budgets
(``grow_capacity``): te_paged's wire (``a2a_capacity_factor``, from the step's largest pair
demand, or once when the auto wire's first steps' demand stops rising) and receive budgets
(HybridEP's, from the peak its rerun measured), × ``capacity_headroom``, bounded by
``max_capacity_factor`` (:class:`~te_paged.runtime.CapacityLimitError`)."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from te_paged.moe import StaticBudgetDispatcher
from te_paged.moe.dispatcher import SHARE_ONE
from te_paged.runtime.records import CapacityLimitError, StepRecord

_RECEIVE_WHY = {
    "capture": "the capture step's peak x capacity_headroom did not fit the receive budget",
    "over budget": "a rank went over its receive budget",
    "headroom": "a rank's peak left less than capacity_headroom free",
}

_CAPACITY_WHY = {
    "capture": "the capture step's largest pair demand x capacity_headroom did not fit the wire",
    "over budget": "a rank went over the wire budget",
    "headroom": "a rank's largest pair demand left less than capacity_headroom free",
    "warm-up": "the auto wire is sized from its first steps' largest pair demand",
}


class BudgetSizing:
    """Part of :class:`~te_paged.runtime.PagedStashRunner` (mixed into it; uses its
    attributes): see the module docstring."""

    def _factor_name(self) -> str:
        """The name users set the dispatchers' budget factor by (a framework's own, e.g.
        torchtitan HybridEP's ``non_blocking_capacity_factor``)."""
        d = self.dispatchers[0] if self.dispatchers else None
        return getattr(d, "factor_name", "moe_expert_rank_capacity_factor")

    def _wire(self) -> StaticBudgetDispatcher | None:
        """The first dispatcher with a wire budget (the group's ranks send blocks), if any."""
        return next(
            (d for d in self.dispatchers if d.a2a_capacity_factor is not None and d.ep_size > 1),
            None,
        )

    def _size_capacity(self, record: StepRecord, why: str) -> None:
        """Raise every dispatcher's wire to the factor that holds the step's largest pair demand
        (``record.peak_pair_tokens``, reduced over the ranks: all decide alike, no collective)
        x ``capacity_headroom``, if that is above the wire's factor; bounded by the expert
        buffer's factor and ``max_capacity_factor``. An auto wire (:attr:`wire_auto
        <te_paged.moe.StaticBudgetDispatcher.wire_auto>`) only watches while the demand rises:
        at the first call whose demand is not above the peak of the calls before (or at the
        ``auto_wire_steps``-th call) it takes the factor of the largest demand it saw, lower
        too. Records and logs a change."""
        if self.grow_capacity and why != "over budget":  # that one: after the rerun measured it
            self._size_receive_budgets(record, why)
        wire = self._wire()
        if not self.grow_capacity or wire is None or not wire.last_num_tokens:
            return
        n = wire.last_num_tokens
        peak = self._pair_demand_at(wire, n, record.peak_pair_tokens)
        first = wire.wire_auto
        if first:  # at the expert factor, which holds whatever the expert buffer holds
            # Compared as shares (one order with the absolute demands at one token count):
            # the steps' microbatches may differ in size.
            self._auto_wire_seen += 1
            share = self._pair_share
            settled = self._auto_wire_seen > 1 and share <= self._auto_wire_share
            self._auto_wire_share = max(self._auto_wire_share, share)
            self._auto_wire_peak = max(self._auto_wire_peak, record.peak_pair_tokens)
            self._auto_wire_varied |= self._varied
            if not settled and self._auto_wire_seen < self.auto_wire_steps:
                return  # the demand still rises: the routers are learning
            peak = self._auto_wire_peak
            if self._auto_wire_varied:
                peak = self._demand_from_share(wire, n, self._auto_wire_share)
            why = "warm-up"
        needed = wire.fitting_capacity_factor(n, peak)
        limit = self.max_capacity_factor
        self._check_capacity_limit(
            record, f"a rank sent up to {peak} rows to one rank", "a2a_capacity_factor", needed,
            f"{n} tokens per rank, top-{wire.config.moe_router_topk}, {wire.ep_size} ranks",
        )  # fmt: skip
        want = wire.fitting_capacity_factor(n, math.ceil(peak * self.capacity_headroom))
        ceiling = min(d.capacity_factor for d in self.dispatchers if d.capacity_factor)
        if limit is not None:
            ceiling = min(ceiling, limit)
        want = min(want, ceiling)
        old = wire.a2a_capacity_factor
        holds = want < old or wire.fitting_capacity_factor(n, wire.pair_capacity) >= want
        if want == old or (holds and not first):  # (its rounding may give more than its factor)
            for d in self.dispatchers:
                d.wire_auto = False
            return
        for d in self.dispatchers:
            if d.a2a_capacity_factor is not None:
                d.set_a2a_capacity_factor(min(want, d.capacity_factor))
        record.capacity_growth = {
            "factor": "a2a_capacity_factor",
            "from": old,
            "to": want,
            "needed": needed,
            "why": why,
        }
        self._log(
            logging.INFO,
            f"PagedStashRunner: step {record.step}: {_CAPACITY_WHY[why]} (largest pair demand "
            f"{peak} rows, pair capacity {record.pair_capacity}), so a2a_capacity_factor "
            f"{'falls' if want < old else 'rises'} "
            f"{old:g} -> {want:g} (needed {needed:g} x capacity_headroom "
            f"{self.capacity_headroom:g}"
            + (", capped at the expert buffer's factor" if want == ceiling else "")
            + "); the next dispatch uses it",
        )

    def _pair_demand_at(self, d: StaticBudgetDispatcher, n: int, peak_pair_tokens: int) -> int:
        """The step's largest pair demand as a dispatch of ``n`` tokens per rank would ask it:
        the demand itself where every dispatch had the token count its static sizes were for,
        else from the step's largest share (a smaller microbatch asks a larger share)."""
        if not self._varied:
            return peak_pair_tokens
        return self._demand_from_share(d, n, self._pair_share)

    @staticmethod
    def _demand_from_share(d: StaticBudgetDispatcher, n: int, share: int) -> int:
        balanced = n * d.config.moe_router_topk
        return -(-share * balanced // (d.ep_size * SHARE_ONE))

    def _check_capacity_limit(
        self, record: StepRecord, what: str, factor: str, needed: float, sizes: str
    ) -> None:
        """:class:`CapacityLimitError` when the step ``needed`` more of ``factor`` than
        ``max_capacity_factor`` allows (every rank decides from the same reduced figures)."""
        limit = self.max_capacity_factor
        if limit is not None and needed > limit:
            raise CapacityLimitError(
                f"step {record.step}: {what}, which needs {factor} >= {needed}, more than "
                f"max_capacity_factor={limit} allows ({sizes}): raise max_capacity_factor, or "
                "balance the routing (the router's aux loss)"
            )

    def _receive_budgets(self) -> list[StaticBudgetDispatcher]:
        """The dispatchers whose budget is a receive buffer (``receive_budget``: HybridEP's)."""
        return [d for d in self.dispatchers if getattr(d, "receive_budget", False)]

    def size_receive_after_rerun(self, record: StepRecord) -> None:
        """After the dropless rerun of a step that went over budget (te_paged's rerun, or
        Megatron's runner's through :class:`~te_paged.integrations.megatron.MegatronLoopAdapter`;
        nothing otherwise): for receive budgets, the rows a rank was sent,
        as the rerun measured them (a receive budget's dispatcher reports what it kept, at
        most its budget, so the failed attempt cannot say what it needed), reduced over the
        group (one ``all_reduce`` and host read, on the rerun path only), then the budgets
        sized from them (:meth:`_size_receive_budgets`)."""
        pending, self._receive_pending = self._receive_pending, False
        budgets = self._receive_budgets()
        static = [d for d in budgets if d.static_rerun]
        if not budgets or not (pending or static):
            return
        device = self._device()
        peak = torch.stack([d.peak_tokens.to(device) for d in budgets]).max()
        share = torch.stack([d.peak_share.to(device) for d in budgets]).max()
        over = torch.stack([d.over_budget.to(device) for d in static]).max() if static else 0
        figures = torch.stack([peak, share, torch.as_tensor(over, device=device)]).long()
        if self._world()[1] > 1:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        peak, share, over = (int(x) for x in figures.tolist())
        if over:  # a budget that stayed static in the rerun dropped rows: never kept
            raise RuntimeError(
                f"step {record.step}: the rerun went over {static[0].factor_name}'s budget "
                f"too (sized from the {static[0].rerun_rows} rows its failed attempt demanded; "
                f"{peak} demanded in the rerun): its routing differed from the failed attempt's, "
                "so rows were dropped; the step is not kept"
            )
        if not pending:
            return
        record.peak_tokens = max(record.peak_tokens, peak)
        self._recv_share = max(self._recv_share, share)
        self._size_receive_budgets(record, "over budget")

    def _size_receive_budgets(self, record: StepRecord, why: str) -> None:
        """Raise the receive budgets (dispatchers with ``receive_budget``: Megatron's HybridEP,
        which has no wire) to the factor that holds the step's peak rows at one rank
        (``record.peak_tokens``, reduced over the ranks) x ``capacity_headroom``, when that is
        above their factor; bounded by ``max_capacity_factor``. Records and logs a change."""
        grown = self._receive_budgets()
        d = grown[0] if grown else None
        if d is None or not d.last_num_tokens or d.capacity_factor is None:
            return
        n, peak = d.last_num_tokens, record.peak_tokens
        if self._varied:  # the rows a dispatch of n tokens would ask, from the largest share
            peak = -(-self._recv_share * n * d.config.moe_router_topk // SHARE_ONE)
        needed = d.fitting_capacity_factor(n, peak)
        if why == "over budget":
            record.suggested_capacity_factor = needed
        limit = self.max_capacity_factor
        self._check_capacity_limit(
            record, f"a rank was sent up to {peak} rows", d.factor_name, needed,
            f"{n} tokens per rank, top-{d.config.moe_router_topk}",
        )  # fmt: skip
        want = d.fitting_capacity_factor(n, math.ceil(peak * self.capacity_headroom))
        if limit is not None:
            want = min(want, limit)
        old = d.capacity_factor
        if want <= old:
            return
        rows_before = d.rank_budget(n, old)
        for each in grown:
            each.set_capacity_factor(want)
        want = d.capacity_factor  # as the budget took it (at most its max_factor)
        for manager in self.managers:  # the experts' buffers grow with the budget
            manager.scale_static_peaks(d.rank_budget(n, want) / max(1, rows_before))
        record.capacity_growth = {
            "factor": d.factor_name, "from": old, "to": want,
            "needed": needed, "why": why,
        }  # fmt: skip
        self._log(
            logging.INFO,
            f"PagedStashRunner: step {record.step}: {_RECEIVE_WHY[why]} (peak {peak} rows at a "
            f"rank, budget {record.budget_tokens}), so {d.factor_name} rises "
            f"{old:g} -> {want:g} (needed {needed:g} x capacity_headroom "
            f"{self.capacity_headroom:g}); the next dispatch uses it",
        )
