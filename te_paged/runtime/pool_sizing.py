"""How :class:`~te_paged.runtime.PagedStashRunner` sizes the stash pools after a step
(``grow_pool``): never below the largest need seen × ``grow_headroom``, bounded by the largest
static peak of any step so far (a pool that large saves nothing; a larger microbatch has larger
static buffers, so the bound follows a variable-length workload) and by ``max_pool_bytes``
(:class:`~te_paged.runtime.PoolLimitError`)."""

from __future__ import annotations

import logging
import math

import torch

from te_paged.runtime.records import PoolLimitError, StepRecord
from te_paged.runtime.reduction import _RankStats
from te_paged.runtime.reporting import _MARGIN
from te_paged.stash import StashKey

_MIB = 2**20


def _size(nbytes: int) -> str:
    return f"{nbytes / _MIB:.2f} MiB" if nbytes >= _MIB else f"{nbytes} bytes"


_GROWTH_WHY = {
    "capture": "the capture step held more than the pools' factor gives",
    "overflow": "the stash overflowed",
    "headroom": "a rank's step left less than the headroom free",
}


class PoolSizing:
    """Part of :class:`~te_paged.runtime.PagedStashRunner` (mixed into it; uses its
    attributes): see the module docstring."""

    def _after_capture(self, record: StepRecord) -> None:
        """The capture step's observed peak is a need too: no pool starts below it
        (``grow_pool``); and the pools the next step allocates must fit ``max_pool_bytes``."""
        self.capture_tokens = record.max_microbatch_tokens
        if self.grow_pool:
            needs = {k: m.sizing_peaks(k)[1] for m in self.managers for k in m.keys}
            self._grow(record, needs, "capture")
        else:
            self._check_planned_pools(record)

    def _check_planned_pools(self, record: StepRecord) -> None:
        """``max_pool_bytes`` holds for the pools the next ``reset()`` allocates (the factors'
        sizes, or larger where they grew): else :class:`PoolLimitError` on every rank, before
        any allocation. One collective (each rank's planned bytes), taken at the capture step
        and after a growth only."""
        if self.max_pool_bytes is None:
            return
        planned = needed = 0
        pools = []
        for m in self.managers:
            for key in m.keys:
                pages, page = m.pool_pages_for(key)[0], m.page_size * key.row_bytes
                planned += pages * page
                needed += m.capture_peaks(key)[1] * page
                pools.append(f"{key} {pages} pages")
        mine = torch.tensor([planned], dtype=torch.int64, device=self._device())
        every = [row[0] for row in self._gather_rows(mine, "the planned pool sizes")]
        over = [rank for rank, b in enumerate(every) if b > self.max_pool_bytes]
        if not over:
            return
        factor = self.managers[0].buffer_size_factor_cuda if self.managers else None
        fix = (f"the capture step needed {_size(needed)} at its peak here, itself more "
               "than the bound: raise max_pool_bytes, add a host tier "
               "(moe_paged_stash_buffer_size_factor_cpu) or balance the routing"
               if needed > self.max_pool_bytes else
               f"the capture step needed {_size(needed)} at its peak here: lower "
               f"moe_paged_stash_buffer_size_factor_cuda (now {factor}) or raise "
               "max_pool_bytes")  # fmt: skip
        raise PoolLimitError(
            f"step {record.step}: the paged-stash pools the next step would allocate hold "
            f"{_size(max(every))} on rank(s) {over} ({', '.join(pools)} here), more than "
            f"max_pool_bytes={self.max_pool_bytes} ({_size(self.max_pool_bytes)}) allows; {fix}"
        )

    def _fitting_pool_factor(
        self, record: StepRecord, per_rank: list[_RankStats] | None = None
    ) -> float | None:
        # The pool holds factor x (balanced peak pages). The step's demanded peak over its
        # balanced peak, max over ranks and keys, is the factor that would have fitted it.
        ratios = [
            figures.demand / figures.balanced
            for r in per_rank or []
            for figures in r.pools.values()
            if figures.balanced and figures.demand
        ]
        if not ratios:  # no pool this step (the host tier spilled?): bound it by the tokens
            if not self.managers or not record.balanced_tokens or not record.peak_tokens:
                return None
            ratios = [record.peak_tokens / record.balanced_tokens]
        return math.ceil(100 * max(ratios) * _MARGIN) / 100

    def _page_bytes(self, key: StashKey) -> int:
        manager = self.managers[0]
        return manager.page_size * key.row_bytes

    def _check_pool_bound(self, record: StepRecord, per_rank: list[_RankStats]) -> None:
        """Every rank decides from the same reduced figures: all raise, or none does."""
        needs = [sum(f.demand * self._page_bytes(k) for k, f in r.pools.items()) for r in per_rank]
        over = [rank for rank, need in enumerate(needs) if need > self.max_pool_bytes]
        if over:
            raise PoolLimitError(
                f"step {record.step}: the stash overflowed and rank(s) {over} needed "
                f"{max(needs) / 2**20:.2f} MiB of device pool at the step's peak "
                f"({', '.join(f'{k} {v} pages' for k, v in record.pool_demand_pages.items())}), "
                f"more than max_pool_bytes={self.max_pool_bytes} "
                f"({self.max_pool_bytes / 2**20:.2f} MiB) allows: raise max_pool_bytes, add a "
                "host tier (moe_paged_stash_buffer_size_factor_cpu) or balance the routing"
            )

    def _grow(
        self, record: StepRecord, needs: dict[StashKey, int], why: str, *, every: bool = False
    ) -> None:
        """Grow this rank's pools to ``needs`` (pages per key) times the headroom, never past
        the largest static peak of a step so far (``manager.static_peak_pages``: the step that
        needed them included) nor, with ``max_pool_bytes``, past the bound (the headroom is
        dropped there); a pool already that large is left alone. Records it; logs it, except
        after an overflow, whose rerun warning says it (:meth:`_pool_outcome`)."""
        self._capped: list[str] = []
        for manager in self.managers:
            want = {}
            for key in manager.keys:
                if key in needs:
                    static = manager.static_peak_pages(key)
                    want[key] = min(math.ceil(needs[key] * self.grow_headroom), static)
            if self.max_pool_bytes is not None:
                total = sum(pages * self._page_bytes(k) for k, pages in want.items())
                if total > self.max_pool_bytes:  # the need fits (checked): drop the headroom
                    want = {k: needs[k] for k in want}
            wanted = {k: pages for k, pages in want.items() if pages}
            grown = manager.grow(wanted, reallocate_all=every)
            held = {k: b.num_pages for k, b in manager.buffers.items()}
            self._capped += [  # needed more than held, yet held at the static bound: said
                str(k) for k in want if k not in grown and needs[k] > held.get(k, needs[k])
            ]
            for key, (old, new) in grown.items():
                record.pool_growth[str(key)] = {
                    "from": old, "to": new, "needed": needs[key], "why": why,
                }  # fmt: skip
        self._check_planned_pools(record)
        if record.pool_growth and why != "overflow":
            pools = self._growth_text(record)
            self._log(
                logging.INFO,
                f"PagedStashRunner: step {record.step}: {_GROWTH_WHY[why]}, so the pools grow "
                f"to that x grow_headroom {self.grow_headroom:g}: {pools} (rank "
                f"{self._world()[0]}; an expert-parallel group's ranks take their largest); "
                "allocated at the next step",
            )

    @staticmethod
    def _growth_text(record: StepRecord) -> str:
        return "; ".join(
            f"{k} {g['from']} -> {g['to']} pages (needed {g['needed']})"
            for k, g in record.pool_growth.items()
        )

    def _pool_outcome(self, record: StepRecord) -> str:
        """What the pools become after a step that overflowed, for its rerun warning: grown
        (to how many pages), or not grown and why; never a growth that did not happen."""
        if not self.grow_pool:
            return "the pools stay as they are (grow_pool=False)"
        if not record.enabled:
            return "the pools stay as they are (the stash was off in the step)"
        if record.pool_growth:
            return (
                f"the pools grow to this step's need x grow_headroom {self.grow_headroom:g} "
                f"from the next step: {self._growth_text(record)} (rank {self._world()[0]}; "
                "an expert-parallel group's ranks take their largest)"
            )
        if getattr(self, "_capped", None):
            return (
                f"the pools stay as they are: {', '.join(self._capped)} already hold the "
                "largest static peak of any step, where paging saves nothing (rank "
                f"{self._world()[0]})"
            )
        return (
            f"rank {self._world()[0]}'s pools already hold what its step needed, so they stay "
            "as they are here (the ranks that overflowed grow theirs; an expert-parallel "
            "group's ranks take their largest)"
        )

    def _grow_ahead(self, record: StepRecord, per_rank: list[_RankStats]) -> None:
        """After a step that kept its result with the stash, grow before anything overflows:
        if any rank's step needed more than its pool / headroom, every rank grows to its own
        need x headroom and frees its pools (all ranks decide alike from the reduced figures,
        so an expert-parallel group reallocates, and agrees, together). Nothing is rerun.
        """
        short = [
            rank
            for rank, r in enumerate(per_rank)
            if any(math.ceil(f.demand * self.grow_headroom) > f.pages for f in r.pools.values())
        ]
        if not short:
            return
        # Every rank reallocates at the next reset(), so a group allocates, and agrees, together.
        self._grow(record, per_rank[self._world()[0]].demand(), "headroom", every=True)
