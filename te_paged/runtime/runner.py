"""``PagedStashRunner``: run a training step on static budgets, rerun it when a budget overflowed.

A step runs with fixed per-rank token budgets (the dispatcher drops assignments over budget and
counts them on the device) and paged stashing (copies that find no free page count an
overflow). Neither may change the result silently, so after the step one collective gathers
every rank's flags and statistics; if any rank overflowed its stash or went over its token
budget, every rank reruns the same step once, dropless and without stashing, so the step's
result equals that of a run that never overflowed. Per step the runner:

1. resets every stash manager of the model (users never call ``reset()``) and zeroes the
   dispatchers' counters; managers and dispatchers are found through the explicit
   :class:`~te_paged.moe.participant.PagedStashParticipant` protocol;
2. snapshots what the step consumes (:meth:`PagedStashRunner.snapshot_state`: torch's CPU and
   CUDA generators; a framework runner adds its own, e.g. Megatron's RNG tracker);
3. runs the step, then one ``all_reduce(SUM)`` over a small vector: one slot per rank with
   its step index, its 0/1 flags [stash overflow, over budget, host spill] and statistics
   (zero elsewhere, so the sum *is* the gather), the same length on every rank whatever pool
   keys it holds (per pool key: its code, pages, high-water, demanded and balanced pages).
   That is the only device→host read
   of a step without fallback. Ranks whose step indices differ skipped or repeated a step:
   :class:`StepDesyncError`, naming them;
4. on overflow or over budget: restores the snapshot, zeroes what the attempt accumulated
   (:meth:`PagedStashRunner.clear_gradients`, then the ``before_rerun`` hook for a framework's
   own buffers), frees the pools and reruns inside ``manager.disabled()`` and the
   dispatchers' ``dropless_block()`` — the one switch each owns; nothing else writes their
   settings. The pool is reallocated at the next step;
5. with ``grow_pool`` (the default), grows the pools that the step needed more of than they
   hold, or than they hold / ``grow_headroom`` (and after the capture step, those smaller than
   its observed peak x headroom), from the reduced figures alone: every rank decides the same,
   and the next step reallocates, agreed across each expert-parallel group (docs/design.md,
   "Pool sizing as routing drifts");
6. with ``grow_capacity`` (the default), raises the dispatchers' wire budget
   (``a2a_capacity_factor``) the same way: to the factor whose pair capacity holds the step's
   largest pair demand (reduced over the group) x ``capacity_headroom``, after the capture step,
   after a step over budget, and after a step that left less than the headroom; never past the
   expert buffer's factor nor ``max_capacity_factor`` (:class:`CapacityLimitError` when a step
   needed more than that limit). An "auto" wire (``moe_a2a_capacity_factor=None``: it starts
   at the expert factor) is set once, lower or higher, to the largest demand of its first
   training steps x ``capacity_headroom``: after the first step whose demand is not above the
   peak of the steps before it, or after ``auto_wire_steps`` (8) steps. Routing moves most
   while the routers first learn, so the first step alone is too few to size from (by
   te_paged's runners: under Megatron-LM's own, which cannot grow it ahead of need, it stays at
   the expert factor).
   ``StepRecord.capacity_growth`` says from, to and why (docs/design.md, "The wire").

With ``record_routing=True`` the runner also records, for ``te-paged plan``, every MoE layer's
tokens per expert on every rank of the expert-parallel group (one ``all_gather`` and one host
read per step, so only while profiling): :meth:`PagedStashRunner.routing_profile` returns them
as a :class:`~te_paged.runtime.planner.RoutingProfile` split by source rank, from which the
planner sizes the dispatcher's per-pair budget exactly. Only the attempt whose result is kept
counts, and a router run again inside backward (activation recomputation) is not counted twice.

A runaway guard stops the prior art's failure mode — a faulty signal that made every step rerun
until the dropless fallback ran out of memory: after ``max_consecutive_fallbacks`` fallbacks in
a row the next one raises :class:`FallbackLimitError` with the factors that would have fitted.

Logging (logger ``te_paged.runtime.runner``, on the group's rank 0; the other ranks log the
same at DEBUG): a fallback at WARNING, before the rerun — the step, why (the ranks that
overflowed, went over budget or spilled), the suggested factors; a host spill without a
rerun, and ``grow_pool`` raising the pool factor, at INFO. A guard trip is reported by its
exception only. NVTX ranges: ``te_paged.reduce`` (the flags' reduction and host read) and
``te_paged.rerun``.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from te_paged.config.checks import require_bool, require_int, require_real
from te_paged.moe import StaticBudgetDispatcher
from te_paged.moe.participant import PagedStashParticipant, Participants, find_participants
from te_paged.runtime.budget_sizing import BudgetSizing
from te_paged.runtime.memory import measure_peak
from te_paged.runtime.pool_sizing import PoolSizing
from te_paged.runtime.records import (
    CapacityLimitError,
    FallbackLimitError,
    InvalidCountsError,
    PoolLimitError,
    StepDesyncError,
    StepRecord,
    paged_nothing,
)
from te_paged.runtime.reduction import StepReduction, _RankStats
from te_paged.runtime.reporting import Reporting
from te_paged.runtime.routing_record import RoutingRecording
from te_paged.runtime.step_state import ModuleState, StepState
from te_paged.stash import PagedStashManager, StashMode
from te_paged.telemetry import nvtx_range

__all__ = [
    "CapacityLimitError",
    "FallbackLimitError",
    "InvalidCountsError",
    "PagedStashRunner",
    "PoolLimitError",
    "StepDesyncError",
    "StepRecord",
    "StepState",
]


logger = logging.getLogger(__name__)


class PagedStashRunner(StepReduction, PoolSizing, BudgetSizing, Reporting, RoutingRecording):
    """Wraps one training step's forward-backward; see the module docstring.

    ``PagedStashRunner(model, manager=None, *, group=None, max_consecutive_fallbacks=3,
    grow_pool=True, grow_headroom=1.10, per_rank_pools=False, max_pool_bytes=None,
    grow_capacity=True, capacity_headroom=1.10, max_capacity_factor=None, auto_wire_steps=8,
    measure_fallback_memory=True, record_routing=False, before_rerun=None, compiled=None)``.
    ``model`` (a module or a list of model chunks) is searched for
    :class:`~te_paged.moe.participant.PagedStashParticipant` modules: their stash managers and
    static-budget dispatchers are what the runner resets, reads and switches; ``manager`` adds
    one the model does not report. ``group`` is the process group the flags are reduced over
    (``None``: the whole world). ``before_rerun`` is called right before a rerun, after the
    runner restored the random generators and zeroed ``param.grad`` (e.g. to zero a
    framework's own gradient buffers, or to tell a memory tracker the modules run again).
    ``records`` keeps the last ``keep_records`` :class:`StepRecord` s; ``on_record`` is called
    with each. ``timeout`` bounds the wait for the step's flags (default: the process group's
    timeout); past it, :class:`StepDesyncError`. Before a rerun the runner also puts back the
    model's buffers, FP8 metas and :class:`~te_paged.runtime.step_state.Restorable` modules;
    ``restorables`` adds objects outside the model (see :mod:`te_paged.runtime.step_state`).
    ``compiled`` (default: found in the model, see :meth:`compiled`) says the step runs
    torch.compile'd code, which changes how a rerun runs and is measured.
    ``max_tokens_per_rank`` declares the largest microbatch of any step, in tokens per rank
    (``MoEConfig.moe_max_tokens_per_rank``, which the layers' managers and te_paged's
    dispatchers also read): the stash managers size their pools for it from the capture step,
    and te_paged's dispatchers their static buffers, so a variable-length run never reruns
    for a larger microbatch and the ranks of a group may bring different token counts
    (docs/choosing-factors.md, "Variable-length workloads").

    Pool sizing (docs/choosing-factors.md): with ``grow_pool`` (the default) every pool keeps
    at least the largest need seen times ``grow_headroom`` (routing varies from step to step):
    the capture step's observed peak, the pages a step that overflowed needed
    (``StepRecord.pool_demand_pages``; it grows once, after the rerun), and those of a step that
    left less than the headroom free (no rerun); never past the largest static peak of any
    step so far (a pool that large saves nothing; it follows a workload whose microbatches
    grow). The next step allocates a grown pool. ``grow_pool=False``
    keeps the pools as the factors size them. The ranks of each expert-parallel group agree on
    pool sizes at allocation (the manager's ``pool_group``: one collective per allocation);
    ``per_rank_pools`` lets each rank size its own. ``max_pool_bytes`` bounds one rank's device
    pools in all: pools the factors (or a growth) would size past it raise
    :class:`PoolLimitError` on every rank before they are allocated (after the capture step,
    naming the factor to lower), an overflow whose step needed more raises it before any
    rerun, and growth's headroom is dropped where it would pass the bound.

    Wire sizing: with ``grow_capacity`` (the default) the dispatchers' ``a2a_capacity_factor``
    keeps the largest pair demand seen x ``capacity_headroom`` (module docstring, item 6), up to
    the expert buffer's ``capacity_factor``, and sizes an auto wire once, from the largest
    demand of its first training steps, once it stops rising (at most ``auto_wire_steps``);
    ``max_capacity_factor`` is a lower limit of the user's, past which a step's need raises
    :class:`CapacityLimitError` on every rank (before any rerun). ``grow_capacity=False`` keeps
    the wire where the config put it (an auto wire: at the expert factor).
    """

    def __init__(
        self,
        model: nn.Module | list[nn.Module],
        manager: PagedStashManager | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        max_consecutive_fallbacks: int = 3,
        grow_pool: bool = True,
        grow_headroom: float = 1.10,
        per_rank_pools: bool = False,
        max_pool_bytes: int | None = None,
        grow_capacity: bool = True,
        capacity_headroom: float = 1.10,
        max_capacity_factor: float | None = None,
        auto_wire_steps: int = 8,
        measure_fallback_memory: bool = True,
        record_routing: bool = False,
        before_rerun: Callable[[], None] | None = None,
        keep_records: int = 1000,
        on_record: Callable[[StepRecord], None] | None = None,
        timeout: datetime.timedelta | None = None,
        restorables: Iterable[object] = (),
        compiled: bool | None = None,
        max_tokens_per_rank: int | None = None,
    ) -> None:
        require_int("keep_records", keep_records, minimum=0)
        if compiled is not None:
            require_bool("compiled", compiled)
        self._compiled = compiled
        require_bool("grow_pool", grow_pool)
        self.grow_headroom = require_real("grow_headroom", grow_headroom, 1.0)
        require_bool("per_rank_pools", per_rank_pools)
        require_bool("grow_capacity", grow_capacity)
        self.grow_capacity = grow_capacity
        self.capacity_headroom = require_real("capacity_headroom", capacity_headroom, 1.0)
        if max_capacity_factor is not None:
            max_capacity_factor = require_real(
                "max_capacity_factor", max_capacity_factor, 0.0, strict=True
            )
        self.max_capacity_factor = max_capacity_factor
        require_int("auto_wire_steps", auto_wire_steps, minimum=1)
        self.auto_wire_steps = auto_wire_steps
        self._auto_wire_seen = 0  # training steps an auto wire has watched
        self._auto_wire_peak = 0  # their largest pair demand
        self._auto_wire_share = 0  # and share (their microbatches' sizes may differ)
        self._auto_wire_varied = False
        self._pair_share, self._varied = 0, False  # the last reduced step's (_record)
        self._recv_share = 0
        self._receive_pending = False  # a receive budget to size after the rerun
        if max_pool_bytes is not None:
            require_int("max_pool_bytes", max_pool_bytes, minimum=1)
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {timeout!r}")
        self.timeout = timeout
        require_int("max_consecutive_fallbacks", max_consecutive_fallbacks, minimum=1)
        self.model = model
        self.chunks = [model] if isinstance(model, nn.Module) else list(model)
        #: What a rerun puts back besides generators: buffers, FP8 metas, ``restorables`` and
        #: the model's own Restorable modules (te_paged/runtime/step_state.py).
        self.module_state = ModuleState(self.chunks, restorables)
        found = find_participants(self.chunks)
        extra = [] if manager is None else [manager]
        self.participants = Participants(
            [*extra, *found.managers], found.dispatchers, found.invalid_flags
        )
        if not self.participants:
            raise ValueError(
                "model has no paged-stash participant (no TEGroupedMLP, MoELayer or other "
                "PagedStashParticipant module) and no manager was given"
            )
        for chunk in self.chunks:
            for module in chunk.modules():
                if isinstance(module, PagedStashParticipant):
                    module.attach_runner(self)
        self.group = group
        self.max_consecutive_fallbacks = max_consecutive_fallbacks
        self.grow_pool = grow_pool
        self.per_rank_pools = per_rank_pools
        self.max_pool_bytes = max_pool_bytes
        if not per_rank_pools:  # the EP group's ranks hold the same pools
            ep_groups = [
                d.group for d in self.dispatchers if getattr(d, "ep_size", 1) > 1 and d.group
            ]
            for manager in self.managers:
                if manager.pool_group is None and ep_groups:
                    manager.pool_group = ep_groups[0]
        #: The capture step's largest microbatch, tokens per rank (max over ranks): what the
        #: pools were sized for, unless a maximum was declared.
        self.capture_tokens = 0
        self.measure_fallback_memory = measure_fallback_memory
        self.consecutive_fallbacks = 0
        self._unrestored: list[str] = []  # buffers the last restore could not put back
        self.before_rerun = before_rerun
        self.step_index = 0
        #: This rank's pipeline stage (its index; 0 without pipelining): the records then
        #: carry each stage's pool high-water marks. The Megatron runner sets it.
        self.stage = 0
        #: The last ``keep_records`` records (older ones are dropped: nothing grows per step);
        #: ``on_record`` sees every one, e.g. to append ``record.to_json()`` to a log file.
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=keep_records)
        self.on_record = on_record
        self._init_routing(record_routing)
        if max_tokens_per_rank is not None:
            self._declare_max_tokens(max_tokens_per_rank)

    def _declare_max_tokens(self, tokens: int) -> None:
        """``max_tokens_per_rank`` on every manager, with the router's top-k from the
        dispatchers' (or layers') config."""
        configs = [d.config for d in self.dispatchers] + [
            m.config
            for c in self.chunks
            for m in c.modules()
            if hasattr(getattr(m, "config", None), "moe_router_topk")
        ]
        if not configs:
            raise ValueError(
                f"max_tokens_per_rank={tokens}: the runner found no MoE config with "
                "moe_router_topk in the model to turn tokens into rows; declare it on the "
                "manager (PagedStashManager(max_tokens_per_rank=..., router_topk=...))"
            )
        for manager in self.managers:
            manager.declare_max_tokens_per_rank(tokens, configs[0].moe_router_topk)
        for d in self.dispatchers:  # te_paged's static sizes, alike on every rank
            if hasattr(d, "max_tokens_per_rank"):
                d.max_tokens_per_rank = tokens

    @property
    def managers(self) -> list[PagedStashManager]:
        return self.participants.managers

    @property
    def dispatchers(self) -> list[StaticBudgetDispatcher]:
        return self.participants.dispatchers

    @property
    def manager(self) -> PagedStashManager | None:
        """The first stash manager (most models have one, shared by every layer)."""
        return self.managers[0] if self.managers else None

    def _device(self) -> torch.device:
        if self.managers:
            return self.managers[0].device
        if self.dispatchers:
            return self.dispatchers[0].over_budget.device
        return self.participants.invalid_flags[0].device

    # ------------------------------------------------------------------------ state and grads

    def snapshot_state(self) -> StepState:
        """What a rerun restores (see :class:`StepState`); taken before the first attempt."""
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        return StepState(torch.get_rng_state(), cuda, self.module_state.snapshot())

    def restore_state(self, state: StepState) -> None:
        """Put back what :meth:`snapshot_state` took, so the rerun draws the same numbers
        (dropout masks, any sampling) as the first attempt did and starts from the same
        buffers and FP8 scaling state."""
        torch.set_rng_state(state.cpu_rng)
        if state.cuda_rng is not None:
            torch.cuda.set_rng_state_all(state.cuda_rng)
        if state.modules is not None:
            self._unrestored = self.module_state.restore(state.modules)

    def clear_gradients(self) -> None:
        """Zero what the failed attempt accumulated: ``param.grad``, in place (the rerun then
        allocates no gradients)."""
        for chunk in self.chunks:
            chunk.zero_grad(set_to_none=False)

    # ---------------------------------------------------------------------------------- step

    def _begin_step(self) -> None:
        for manager in self.managers:
            manager.reset()
        self._zero_counters()
        for d in self.dispatchers:
            d.reset_traffic()
        self._route_calls.clear()

    def _bytes_sent(self) -> int:
        """This rank's all-to-all bytes since the step began (host ints: no read)."""
        return sum(d.bytes_sent for d in self.dispatchers)

    def _zero_counters(self) -> None:
        """The dispatchers' counters and the layers' invalid-count flags, zeroed in place."""
        for d in self.dispatchers:
            d.reset_flags()
        for flag in self.participants.invalid_flags:
            flag.zero_()

    def _budget(self) -> tuple[int, int]:
        if not self.dispatchers:
            return 0, 0
        d = self.dispatchers[0]
        return int(d.budget_tokens), int(d.last_num_tokens * d.config.moe_router_topk)

    def step(
        self, step_fn: Callable[[], Any], *, step: int | None = None, forward_only: bool = False
    ) -> tuple[Any, StepRecord]:
        """Run ``step_fn`` (forward + backward over the step's microbatches); rerun once,
        dropless and without stashing, if any rank overflowed or went over budget.

        ``step`` is the training loop's own iteration number (default: the count of calls so
        far). Pass it to catch a rank that skipped a step: its collectives pair with the next
        step's, so a call count would still agree, but its iteration number does not.

        ``forward_only`` (an evaluation step: no backward follows, whether or not autograd
        records) stashes nothing — there is no backward to pop for — so it can raise no stash
        flag; a token over budget still reruns it dropless, for a correct result. Its
        fallbacks neither count towards ``max_consecutive_fallbacks`` nor end a run of them:
        evaluation says nothing about whether training's budgets fit.
        """
        if step is not None:
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"step must be a non-negative int, got {step!r}")
            self.step_index = step
        self._begin_step()
        capturing = any(m.mode is StashMode.CAPTURE for m in self.managers)
        state = self.snapshot_state()
        with contextlib.ExitStack() as no_stash:
            if forward_only:
                for manager in self.managers:
                    no_stash.enter_context(manager.disabled())
            result = step_fn()
        if state.modules is not None:
            self.module_state.learn(state.modules)
        with nvtx_range("te_paged.reduce"):
            flag_ranks, per_rank = self._reduce()
        record = self._record(flag_ranks, per_rank, forward_only)
        if capturing and not forward_only:
            self._after_capture(record)
        if capturing and not forward_only and not record.overbudget_ranks:
            self._size_capacity(record, "capture")  # over budget: _before_fallback's
        if record.will_retry:
            self._before_fallback(record, flag_ranks, per_rank, forward_only)
            result = self._fallback(step_fn, state, record, per_rank)
        elif not forward_only:
            self.consecutive_fallbacks = 0
            if self.grow_pool and record.enabled and not capturing:
                self._grow_ahead(record, per_rank)
            if not capturing:
                self._size_capacity(record, "headroom")
            if record.host_spill_ranks:
                self._log(logging.INFO, self._spill_message(record, flag_ranks[2], len(per_rank)))
        record.bytes_sent = self._bytes_sent()
        record.stashes_skipped = sum(m.stashes_skipped for m in self.managers)
        record.paged_nothing = paged_nothing(self.managers)
        if self.record_routing:
            self._gather_routing()
        self.step_index += 1
        self.records.append(record)
        if self.on_record is not None:
            self.on_record(record)
        return result, record

    def _record(
        self, flag_ranks: list[list[int]], per_rank: list[_RankStats], forward_only: bool
    ) -> StepRecord:
        """The step's :class:`StepRecord` from the reduced flags and figures (attempt 1)."""
        overflow, overbudget, spill = (len(ranks) for ranks in flag_ranks)
        budget, balanced = self._budget()
        wire = self._wire()
        hwm: dict[str, int] = {}
        demand: dict[str, int] = {}
        for r in per_rank:  # every key any rank holds: max over the ranks with it
            for k, figures in r.pools.items():
                hwm[str(k)] = max(hwm.get(str(k), 0), figures.high_water)
                demand[str(k)] = max(demand.get(str(k), 0), figures.demand)
        #: The step's pair demand relative to each dispatch's balanced count (max over ranks)
        #: and whether any rank's microbatches differed from what the static sizes were for:
        #: the wire is then sized from the share (budget_sizing).
        self._pair_share = max((r.pair_share for r in per_rank), default=0)
        self._varied = any(r.varied for r in per_rank)
        self._recv_share = max((r.share for r in per_rank), default=0)
        stages: dict[str, dict[str, int]] = {}
        if any(r.stage for r in per_rank):  # more than one pipeline stage
            for r in per_rank:
                mine = stages.setdefault(str(r.stage), {})
                for k, figures in r.pools.items():
                    mine[str(k)] = max(mine.get(str(k), 0), figures.high_water)
        return StepRecord(
            step=self.step_index,
            attempt=1,
            enabled=self._stash_enabled() and not forward_only,
            stash_overflow_ranks=overflow,
            overbudget_ranks=overbudget,
            host_spill_ranks=spill,
            will_retry=bool(overflow or overbudget),
            pool_high_water_pages=hwm,
            pool_pages=self._pool_pages(),
            stage_pool_high_water_pages=stages,
            peak_tokens=max((r.peak_tokens for r in per_rank), default=0),
            budget_tokens=budget,
            balanced_tokens=balanced,
            pool_demand_pages=demand,
            a2a_capacity_factor=None if wire is None else wire.a2a_capacity_factor,
            pair_capacity=0 if wire is None else wire.pair_capacity,
            peak_pair_tokens=max((r.peak_pair_tokens for r in per_rank), default=0),
            microbatch_tokens=self.microbatch_tokens(),
            max_microbatch_tokens=max((r.max_tokens for r in per_rank), default=0),
        )

    def _before_fallback(
        self,
        record: StepRecord,
        flag_ranks: list[list[int]],
        per_rank: list[_RankStats],
        forward_only: bool,
    ) -> None:
        """A step will rerun: the factors that would have fitted, the pool bound, the runaway
        guard (training only), the count, and the warning, said before the rerun so that it is
        seen even if the dropless rerun runs out of memory."""
        self._suggest(record, record.peak_pair_tokens, per_rank)
        overflow, overbudget = record.stash_overflow_ranks, record.overbudget_ranks
        if overflow and self.max_pool_bytes is not None and not forward_only:
            self._check_pool_bound(record, per_rank)
        if self.grow_pool and overflow and record.enabled:  # before the warning, which says it
            self._grow(record, per_rank[self._world()[0]].demand(), "overflow")
        if overbudget and not forward_only:
            self._size_capacity(record, "over budget")
        elif not forward_only:  # a stash overflow alone: the wire's demand is this step's own
            self._size_capacity(record, "headroom")
        #: A receive budget went over: sized after the rerun (size_receive_after_rerun).
        self._receive_pending = bool(overbudget) and self.grow_capacity and not forward_only
        if self.consecutive_fallbacks >= self.max_consecutive_fallbacks and not forward_only:
            fits = self._fits_text(self._suggestions(record), "to ")
            raise FallbackLimitError(  # the exception is the report: nothing logged
                f"{self.consecutive_fallbacks} consecutive steps needed the dropless "
                f"fallback (stash overflow on {overflow} rank(s), over budget on "
                f"{overbudget}): raise {fits or 'the static budgets'} (what step "
                f"{record.step} needed)"
            )
        if not forward_only:
            self.consecutive_fallbacks += 1
        self._log(logging.WARNING, self._fallback_message(record, flag_ranks, len(per_rank)))

    # ------------------------------------------------------------------------------ logging

    def _log(self, level: int, message: str) -> None:
        """Every rank knows every rank's flags: rank 0 of the group says it at ``level``, the
        others at DEBUG (one line per event, not one per rank)."""
        logger.log(level if self._world()[0] == 0 else logging.DEBUG, message)

    def _stash_enabled(self) -> bool:
        return bool(self.managers) and all(m.enabled for m in self.managers)

    def _pool_pages(self) -> dict[str, int]:
        return {str(k): b.num_pages for m in self.managers for k, b in m.buffers.items()}

    def _fallback(
        self, step_fn: Callable[[], Any], state: StepState, record: StepRecord,
        per_rank: list[_RankStats],
    ) -> Any:  # fmt: skip
        with nvtx_range("te_paged.rerun"):
            return self._rerun(step_fn, state, record, per_rank)

    def _rerun(
        self, step_fn: Callable[[], Any], state: StepState, record: StepRecord,
        per_rank: list[_RankStats],
    ) -> Any:  # fmt: skip
        compiled = self.compiled()  # before the pools go: the attempt's traced scopes say it
        self._prepare_rerun(state, record, per_rank)
        with contextlib.ExitStack() as fallback:
            self._enter_fallback(fallback, dropless=not compiled or bool(record.overbudget_ranks))
            if compiled and record.overbudget_ranks:
                # Dropless rows are data-dependent (read on the host): not a static graph.
                fallback.enter_context(torch.compiler.set_stance("force_eager"))
            if self.before_rerun is not None:
                self.before_rerun()
            result, peak, method = self._measured(step_fn, compiled)
        self.size_receive_after_rerun(record)
        record.attempt = 2
        record.enabled = False
        record.fallback_peak_bytes, record.fallback_memory_method = peak, method
        return result

    def _prepare_rerun(
        self, state: StepState, record: StepRecord, per_rank: list[_RankStats]
    ) -> None:
        """Before a rerun: the snapshot restored, the gradients zeroed, the pools grown (after
        an overflow) and freed."""
        self._unrestored = []
        self.restore_state(state)
        record.unrestored_state = list(self._unrestored)
        if record.unrestored_state:
            logger.warning(  # this rank's own buffers: every rank says its own
                "PagedStashRunner: step %d reruns from buffers its failed attempt changed for "
                "the first time (%s): they were not copied before the step, so the rerun is not "
                "exactly the step that never overflowed; they are copied before every step "
                "from now on",
                record.step,
                ", ".join(record.unrestored_state),
            )
        self.clear_gradients()
        for d in self.dispatchers:  # the dropless reference: the kept attempt's routing
            d.reset_traffic(sent=False)
        for d in self._receive_budgets():  # what a budget static in the rerun must hold
            d.rerun_rows = record.peak_tokens
        # The rerun's own flags (a static budget's are checked after it); the state restore
        # zeroes those of dispatchers inside the model, this every dispatcher's.
        self._zero_counters()
        for manager in self.managers:
            manager.release()  # the pool and the dropless rerun never coexist
        self._route_calls.clear()  # the rerun routes the same tokens again: count them once

    def _enter_fallback(self, stack: contextlib.ExitStack, dropless: bool = True) -> None:
        """The rerun's switches, each its owner's: every manager off, every dispatcher
        dropless (unless ``dropless`` is False), until ``stack`` closes."""
        for manager in self.managers:
            stack.enter_context(manager.disabled())
        for d in self.dispatchers if dropless else ():
            stack.enter_context(d.dropless_block())

    def compiled(self) -> bool:
        """Whether the step runs compiled code. By evidence first: a manager whose scopes this
        step were opened by a compiled graph (:attr:`~te_paged.stash.PagedStashManager.
        traced_scopes`), whatever the user compiled (a module, a function that calls the
        layers, the whole step). Else a module of the model compiled with
        ``nn.Module.compile`` (torchtitan's blocks) or wrapped by ``torch.compile``, or the
        runner told so (``compiled=``, which overrides both).

        Under compile a rerun after a stash overflow alone keeps the static budget (nothing
        was dropped; a static rerun equals the dropless one bit for bit) and so runs the
        compiled graph with the stash off, the very graph of a run that never paged; an
        over-budget rerun is dropless, whose rows are read on the host, and runs eagerly
        (``torch.compiler.set_stance("force_eager")``). The rerun's memory is then measured
        without a dispatch-mode tracker (:class:`~te_paged.runtime.memory.PeakMemoryMeter`),
        which Dynamo refuses inside ``fullgraph=True`` code."""
        if self._compiled is not None:
            return self._compiled
        if any(m.traced_scopes for m in self.managers):
            return True
        return any(
            getattr(m, "_compiled_call_impl", None) is not None
            or type(m).__name__ == "OptimizedModule"
            for chunk in self.chunks
            for m in chunk.modules()
        )

    def _measured(
        self, step_fn: Callable[[], Any], compiled: bool
    ) -> tuple[Any, int | None, str | None]:
        if not self.measure_fallback_memory:
            return step_fn(), None, None
        result, report = measure_peak(step_fn, self._device(), compiled=compiled)
        return result, report.peak_bytes, report.method
