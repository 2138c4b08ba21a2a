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
   at the expert factor) is set once, after ``auto_wire_steps`` training steps (8), to the
   largest demand of those steps x ``capacity_headroom``, lower or higher: routing moves most
   while the routers first learn, so one step is too few to size from (by te_paged's runners:
   under Megatron-LM's own, which cannot grow it ahead of need, it stays at the expert factor).
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
import dataclasses
import datetime
import functools
import json
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from te_paged.config.checks import require_bool, require_int, require_real
from te_paged.kernels.layout import Flag, State
from te_paged.moe import MoELayer, StaticBudgetDispatcher
from te_paged.moe.participant import PagedStashParticipant, Participants, find_participants
from te_paged.runtime.memory import measure_peak
from te_paged.runtime.planner import RoutingProfile
from te_paged.runtime.step_state import ModuleState, ModuleStateSnapshot
from te_paged.stash import PagedStashManager, StashKey, StashMode
from te_paged.stash.buffer import MAX_KEYS, key_code, key_from_code
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

_MARGIN = 1.05  # headroom on suggested factors, so a repeat of the same peak fits
_FLAGS = 3  # per rank: stash overflow, over budget, host spill
_HEAD = 8  # per rank: step, stage, invalid, the _FLAGS flags, peak tokens, peak pair tokens
_MAX_KEYS = MAX_KEYS  # pool keys (dtype, row width) a rank may hold: the reduction's fixed room
_PER_KEY = 5  # per pool key: code, pages, high-water pages, demanded pages, balanced pages
_GROWTH_WHY = {
    "capture": "the capture step held more than the pools' factor gives",
    "overflow": "the stash overflowed",
    "headroom": "a rank's step left less than the headroom free",
}
_RECEIVE_WHY = {
    "capture": "the capture step's peak x capacity_headroom did not fit the receive budget",
    "over budget": "a rank went over its receive budget",
    "headroom": "a rank's peak left less than capacity_headroom free",
}
_SLOT = _HEAD + _PER_KEY * _MAX_KEYS  # one rank's entries in the per-step reduction
_CAPACITY_WHY = {
    "capture": "the capture step's largest pair demand x capacity_headroom did not fit the wire",
    "over budget": "a rank went over the wire budget",
    "headroom": "a rank's largest pair demand left less than capacity_headroom free",
    "warm-up": "the auto wire is sized from its first steps' largest pair demand",
}


logger = logging.getLogger(__name__)


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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


class StepDesyncError(RuntimeError):
    """The ranks reduced flags of different steps: one of them skipped or repeated a step."""


class InvalidCountsError(RuntimeError):
    """A rank's layers saw token counts or expert ids that cannot be right (not an overflow: a
    rerun would see them again)."""


class _PoolFigures(NamedTuple):
    """One pool key's figures of one rank's step, from the per-step reduction."""

    pages: int  # the pool's device pages
    high_water: int  # pages in use at the peak (State.HWM)
    demand: int  # pages needed at the peak, stored or not (State.DEMAND_HWM)
    balanced: int  # the capture step's balanced-case peak pages


class _RankStats(NamedTuple):
    stage: int
    peak_tokens: int
    peak_pair_tokens: int
    pools: dict[StashKey, _PoolFigures]

    def demand(self) -> dict[StashKey, int]:
        """The pages each pool key's step needed at its peak."""
        return {k: f.demand for k, f in self.pools.items()}


@dataclasses.dataclass
class StepState:
    """What a step consumes or changes that a rerun must give back: every random generator it
    draws from (torch's CPU generator, each CUDA device's), the model's buffers, FP8 metas and
    :class:`~te_paged.runtime.step_state.Restorable` s (``modules``), and whatever a subclass
    adds in ``extra``."""

    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None
    modules: ModuleStateSnapshot | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class PagedStashRunner:
    """Wraps one training step's forward-backward; see the module docstring.

    ``PagedStashRunner(model, manager=None, *, group=None, max_consecutive_fallbacks=3,
    grow_pool=True, grow_headroom=1.10, per_rank_pools=False, max_pool_bytes=None,
    grow_capacity=True, capacity_headroom=1.10, max_capacity_factor=None, auto_wire_steps=8,
    measure_fallback_memory=True, record_routing=False, before_rerun=None)``.
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

    Pool sizing (docs/choosing-factors.md): with ``grow_pool`` (the default) every pool keeps
    at least the largest need seen times ``grow_headroom`` (routing varies from step to step):
    the capture step's observed peak, the pages a step that overflowed needed
    (``StepRecord.pool_demand_pages``; it grows once, after the rerun), and those of a step that
    left less than the headroom free (no rerun); never past the capture step's static peak (a
    pool that large saves nothing). The next step allocates a grown pool. ``grow_pool=False``
    keeps the pools as the factors size them. The ranks of each expert-parallel group agree on
    pool sizes at allocation (the manager's ``pool_group``: one collective per allocation);
    ``per_rank_pools`` lets each rank size its own. ``max_pool_bytes`` bounds one rank's device
    pools in all: an overflow whose step needed more raises :class:`PoolLimitError` on every
    rank (before any rerun), and growth's headroom is dropped where it would pass the bound.

    Wire sizing: with ``grow_capacity`` (the default) the dispatchers' ``a2a_capacity_factor``
    keeps the largest pair demand seen x ``capacity_headroom`` (module docstring, item 6), up to
    the expert buffer's ``capacity_factor``, and sizes an auto wire once, from the largest
    demand of its first ``auto_wire_steps`` training steps;
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
    ) -> None:
        require_int("keep_records", keep_records, minimum=0)
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
        self.record_routing = record_routing
        self.layers = [m for c in self.chunks for m in c.modules() if isinstance(m, MoELayer)]
        self._route_calls: list[tuple[int, torch.Tensor]] = []  # (layer, tokens_per_expert_E)
        self._routing: list[torch.Tensor] = []  # per step, CPU int64 [pass, layer, source, expert]
        self._routed_tokens = 0
        if record_routing:
            if not self.layers:
                raise ValueError(
                    "record_routing needs te_paged MoE layers (their router reports "
                    "tokens_per_expert); the model has none"
                )
            for i, layer in enumerate(self.layers):
                layer.router.register_forward_hook(functools.partial(self._on_route, i))

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

    # ---------------------------------------------------------------------------- collective

    def _world(self) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def _local_stats(self, device: torch.device) -> torch.Tensor:
        """This rank's slot, a device vector of :data:`_SLOT` entries whatever pools the rank
        holds: [step, stage, invalid, overflow, overbudget, spill, peak_tokens, peak_pair],
        then :data:`_MAX_KEYS` pairs (key code, high-water pages), zero-padded. Ranks whose
        pipeline stages hold different pool keys (an FP8 layer on one stage only, say) reduce
        vectors of one length; the key codes say which pool each high-water mark is of."""
        zero = torch.zeros((), dtype=torch.int64, device=device)
        overflow = spill = invalid = zero
        hwm: dict[StashKey, torch.Tensor] = {}  # (HWM, DEMAND_HWM) per key, on the device
        const: dict[StashKey, tuple[int, int]] = {}  # (pages, balanced pages): host constants
        keys = list(dict.fromkeys(k for m in self.managers for k in m.buffers))
        if len(keys) > _MAX_KEYS:
            raise ValueError(
                f"this rank holds {len(keys)} paged-stash pools ({', '.join(map(str, keys))}); "
                f"the runner's per-step reduction has room for {_MAX_KEYS} (one pool per "
                "dtype and row width)"
            )
        for manager in self.managers:
            manager.join_side_streams()  # the flags and pool states are the side streams' too
            overflow = overflow + (manager.flags[Flag.OVERFLOW] > 0).long()
            spill = spill + (manager.flags[Flag.HOST_SPILL] > 0).long()
            invalid = invalid + (manager.flags[Flag.INVALID] > 0).long()
            for key, buf in manager.buffers.items():
                # Basic indexing: a list index would copy the index to the device first.
                h = torch.stack([buf.state[State.HWM], buf.state[State.DEMAND_HWM]]).to(device)
                hwm[key] = torch.maximum(hwm[key], h) if key in hwm else h
                figures = (buf.num_pages, manager.capture_peaks(key)[0])
                const[key] = max(const.get(key, (0, 0)), figures)
        over = peak = peak_pair = zero
        for d in self.dispatchers:
            over = over + (d.over_budget > 0).long().to(device)
            invalid = invalid + (d.invalid_indices > 0).long().to(device)
            peak = torch.maximum(peak, d.peak_tokens.to(device).long())
            peak_pair = torch.maximum(peak_pair, d.peak_pair_tokens.to(device).long())
        for flag in self.participants.invalid_flags:
            invalid = invalid + (flag > 0).long().to(device)
        flags = [(overflow > 0).long(), (over > 0).long(), (spill > 0).long()]
        step = torch.tensor([self.step_index, self.stage], dtype=torch.int64, device=device)
        mine = [step, (invalid > 0).long().reshape(1), *(f.reshape(1) for f in flags)]
        mine += [peak.reshape(1), peak_pair.reshape(1)]
        if hwm:  # (code, pages, hwm, demand, balanced): one host-to-device copy, no read
            host = [(key_code(k), *const[k]) for k in hwm]
            host = torch.tensor(host, dtype=torch.int64, device=device)
            per_key = torch.cat([host[:, :2], torch.stack(list(hwm.values())), host[:, 2:]], 1)
            mine.append(per_key.reshape(-1))
        out = torch.cat(mine)
        return torch.cat([out, out.new_zeros(_SLOT - out.numel())])

    def _reduce(self) -> tuple[list[list[int]], list[_RankStats]]:
        """One ``all_reduce(SUM)`` over one slot per rank (zero elsewhere, so the sum is a
        gather) with its step index, pipeline stage, flags and statistics. Returns, per flag
        [overflow, overbudget, spill], the ranks that raised it; and each rank's statistics
        ``(stage, peak, pair, {pool key: high-water pages})``."""
        device = self._device()
        local = self._local_stats(device)
        rank, world = self._world()
        stats_len = local.numel()
        vec = torch.zeros(world * stats_len, dtype=torch.int64, device=device)
        vec[rank * stats_len : (rank + 1) * stats_len] = local
        if world > 1:
            if device.type == "cpu" and dist.get_backend(self.group) == "nccl":
                raise RuntimeError("the NCCL group needs the manager on a CUDA device")
            work = dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            try:
                work.wait(self.timeout) if self.timeout is not None else work.wait()
            except RuntimeError as e:
                raise StepDesyncError(
                    f"rank {rank}: the flags of step {self.step_index} were not reduced within "
                    f"{self.timeout}: a rank stopped, died or skipped the step ({e})"
                ) from e
        values = vec.tolist()  # the step's one device -> host read
        per_rank = [values[r * stats_len : (r + 1) * stats_len] for r in range(world)]
        self._check_step_indices([r[0] for r in per_rank], rank)
        invalid = [r for r, row in enumerate(per_rank) if row[2]]
        if invalid:
            here = self._invalid_here() if rank in invalid else ""
            raise InvalidCountsError(
                f"rank {rank}: rank(s) {invalid} saw token counts that cannot be right "
                "(tokens_per_expert negative or summing past the expert buffer, an expert id "
                "out of range, or a stash record popped twice): the step's result is wrong and "
                f"a rerun would repeat it{here}. Check what the dispatcher hands the experts"
            )
        flag_ranks = [[r for r, row in enumerate(per_rank) if row[3 + f]] for f in range(_FLAGS)]
        stats = []
        for row in per_rank:
            keys = [row[i : i + _PER_KEY] for i in range(_HEAD, _SLOT, _PER_KEY)]
            pools = {key_from_code(k[0]): _PoolFigures(*k[1:]) for k in keys if k[0]}
            stats.append(_RankStats(row[1], row[3 + _FLAGS], row[4 + _FLAGS], pools))
        return flag_ranks, stats

    def _invalid_here(self) -> str:
        """What this rank saw, for the error (host reads: the error path only)."""
        seen = []
        for manager in self.managers:
            for layer, n, max_tokens in manager.invalid_counts():
                where = "a layer" if layer is None else f"layer {layer}"
                seen.append(f"{where}: num_tokens {n} for a buffer of {max_tokens} tokens")
        for d in self.dispatchers:
            if int(d.invalid_indices) > 0:
                seen.append(f"{int(d.invalid_indices)} expert id(s) out of range")
        reported = sum(int(flag) for flag in self.participants.invalid_flags)
        if reported:
            seen.append(f"{reported} invalid count(s) reported by the layers' grouped GEMMs")
        if any(int(m.flags[Flag.INVALID]) > 0 for m in self.managers) and not seen:
            seen.append("a stash record popped twice")
        return f"; on this rank: {'; '.join(seen)}" if seen else ""

    def _check_step_indices(self, steps: list[int], rank: int) -> None:
        if len(set(steps)) <= 1:
            return
        by_step: dict[int, list[int]] = {}
        for r, s in enumerate(steps):
            by_step.setdefault(s, []).append(r)
        where = "; ".join(f"rank(s) {ranks} at step {s}" for s, ranks in sorted(by_step.items()))
        raise StepDesyncError(
            f"rank {rank}: the ranks reduced the flags of different steps ({where}): a rank "
            "skipped or repeated a step, so its collectives were paired with another step's. "
            "Every rank must call the runner once per step."
        )

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
        if capturing and self.grow_pool and not forward_only:
            self._grow_after_capture(record)
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
        )

    def _grow_after_capture(self, record: StepRecord) -> None:
        """The capture step's observed peak is a need too: no pool starts below it."""
        needs = {k: m.capture_peaks(k)[1] for m in self.managers for k in m.keys}
        self._grow(record, needs, "capture")

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
        if overbudget and not forward_only:
            self._size_capacity(record, "over budget")
        #: A receive budget went over: sized after the rerun (size_receive_after_rerun).
        self._receive_pending = bool(overbudget) and self.grow_capacity and not forward_only
        if self.consecutive_fallbacks >= self.max_consecutive_fallbacks and not forward_only:
            fits = [
                f"{name} to >= {value}"
                for name, value in (
                    (self._factor_name(), record.suggested_capacity_factor),
                    (
                        "moe_paged_stash_buffer_size_factor_cuda",
                        record.suggested_buffer_size_factor_cuda,
                    ),
                )
                if value is not None
            ]
            raise FallbackLimitError(  # the exception is the report: nothing logged
                f"{self.consecutive_fallbacks} consecutive steps needed the dropless "
                f"fallback (stash overflow on {overflow} rank(s), over budget on "
                f"{overbudget}): raise {' and '.join(fits) or 'the static budgets'}"
            )
        if not forward_only:
            self.consecutive_fallbacks += 1
        self._log(logging.WARNING, self._fallback_message(record, flag_ranks, len(per_rank)))

    # ------------------------------------------------------------------------------ logging

    def _log(self, level: int, message: str) -> None:
        """Every rank knows every rank's flags: rank 0 of the group says it at ``level``, the
        others at DEBUG (one line per event, not one per rank)."""
        logger.log(level if self._world()[0] == 0 else logging.DEBUG, message)

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
        expert_fit = record.suggested_capacity_factor
        held = [getattr(d, "capacity_factor", None) for d in self.dispatchers]
        held = [f for f in held if f is not None]
        if expert_fit is not None and held and expert_fit <= min(held):
            expert_fit = None  # the expert buffer held it: the wire was the limit
        suggested = {
            self._factor_name(): expert_fit,
            "moe_paged_stash_buffer_size_factor_cuda": record.suggested_buffer_size_factor_cuda,
        }
        fits = [f"{name} >= {value}" for name, value in suggested.items() if value is not None]
        if record.capacity_growth:
            growth = record.capacity_growth
            fits.append(f"{growth['factor']} {growth['to']:g}, which it now has")
        growing = self.grow_pool and bool(overflow)
        return (
            f"PagedStashRunner: step {record.step} reruns dropless without the paged stash "
            f"({world} rank(s): {'; '.join(why)}); its result equals a run without the stash. "
            f"Fallback {self.consecutive_fallbacks} of {self.max_consecutive_fallbacks} allowed "
            "in a row before FallbackLimitError; would have fitted: "
            + (", ".join(fits) or "unknown (no dispatcher reports token counts)")
            + ("; the pools grow to what this step needed (grow_pool)" if growing else "")
        )

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

    def _stash_enabled(self) -> bool:
        return bool(self.managers) and all(m.enabled for m in self.managers)

    def _pool_pages(self) -> dict[str, int]:
        return {str(k): b.num_pages for m in self.managers for k, b in m.buffers.items()}

    def _suggest(
        self, record: StepRecord, peak_pair_tokens: int, per_rank: list[_RankStats]
    ) -> None:
        # te_paged's budget is per (source, destination) pair: size from that peak. A receive
        # budget (HybridEP's) reports what it kept, so only its rerun can tell what it needed.
        d = self.dispatchers[0] if self.dispatchers else None
        if record.overbudget_ranks and d is not None and not getattr(d, "receive_budget", False):
            fit = d.fitting_capacity_factor(
                d.last_num_tokens, math.ceil(peak_pair_tokens * _MARGIN), expert_buffer=True
            )
            record.suggested_capacity_factor = fit
        if record.stash_overflow_ranks:
            record.suggested_buffer_size_factor_cuda = self._fitting_pool_factor(record, per_rank)

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
        <te_paged.moe.StaticBudgetDispatcher.wire_auto>`) only watches until its
        ``auto_wire_steps``-th call, then takes the factor of the largest demand it saw, lower
        too. Records and logs a change."""
        if self.grow_capacity and why != "over budget":  # that one: after the rerun measured it
            self._size_receive_budgets(record, why)
        wire = self._wire()
        if not self.grow_capacity or wire is None or not wire.last_num_tokens:
            return
        n, peak = wire.last_num_tokens, record.peak_pair_tokens
        first = wire.wire_auto
        if first:  # at the expert factor, which holds whatever the expert buffer holds
            self._auto_wire_seen += 1
            peak = self._auto_wire_peak = max(self._auto_wire_peak, peak)
            if self._auto_wire_seen < self.auto_wire_steps:
                return
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
        if not pending or not budgets:
            return
        device = self._device()
        peak = torch.stack([d.peak_tokens.to(device) for d in budgets]).max()
        if self._world()[1] > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        record.peak_tokens = max(record.peak_tokens, int(peak))
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
        a key's static peak nor, with ``max_pool_bytes``, past the bound (the headroom is
        dropped there); a pool already that large is left alone. Records and logs it."""
        for manager in self.managers:
            want = {}
            for key in manager.keys:
                if key in needs:
                    static = manager.capture_peaks(key)[2]
                    want[key] = min(math.ceil(needs[key] * self.grow_headroom), static)
            if self.max_pool_bytes is not None:
                total = sum(pages * self._page_bytes(k) for k, pages in want.items())
                if total > self.max_pool_bytes:  # the need fits (checked): drop the headroom
                    want = {k: needs[k] for k in want}
            wanted = {k: pages for k, pages in want.items() if pages}
            grown = manager.grow(wanted, reallocate_all=every)
            for key, (old, new) in grown.items():
                record.pool_growth[str(key)] = {
                    "from": old, "to": new, "needed": needs[key], "why": why,
                }  # fmt: skip
        if record.pool_growth:
            pools = "; ".join(
                f"{k} {g['from']} -> {g['to']} pages (needed {g['needed']})"
                for k, g in record.pool_growth.items()
            )
            self._log(
                logging.INFO,
                f"PagedStashRunner: step {record.step}: {_GROWTH_WHY[why]}, so the pools grow "
                f"to that x grow_headroom {self.grow_headroom:g}: {pools} (rank "
                f"{self._world()[0]}; an expert-parallel group's ranks take their largest); "
                "allocated at the next step",
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
        self._prepare_rerun(state, record, per_rank)
        with contextlib.ExitStack() as fallback:
            self._enter_fallback(fallback)
            if self.before_rerun is not None:
                self.before_rerun()
            result, peak, method = self._measured(step_fn)
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
        if self.grow_pool and record.stash_overflow_ranks and record.enabled:
            self._grow(record, per_rank[self._world()[0]].demand(), "overflow")
        for manager in self.managers:
            manager.release()  # the pool and the dropless rerun never coexist
        self._route_calls.clear()  # the rerun routes the same tokens again: count them once

    def _enter_fallback(self, stack: contextlib.ExitStack) -> None:
        """The rerun's switches, each its owner's: every manager off, every dispatcher
        dropless, until ``stack`` closes."""
        for manager in self.managers:
            stack.enter_context(manager.disabled())
        for d in self.dispatchers:
            stack.enter_context(d.dropless_block())

    # ------------------------------------------------------------------------------ routing

    def _on_route(self, layer: int, module: nn.Module, inputs: Any, out: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward: this forward was already counted
        self._route_calls.append((layer, out.tokens_per_expert.detach()))

    def _gather_routing(self) -> None:
        calls = [
            [t for i, t in self._route_calls if i == layer] for layer in range(len(self.layers))
        ]
        passes = {len(c) for c in calls}
        if len(passes) != 1:
            raise RuntimeError(
                "record_routing: the MoE layers ran different numbers of times in one step "
                f"({[len(c) for c in calls]}); a profile needs every layer once per forward pass"
            )
        if not calls[0]:
            return
        local = torch.stack([torch.stack(c) for c in calls], dim=1)  # [pass, layer, expert]
        d = self.layers[0].dispatcher
        gathered = [local]
        if d.ep_size > 1:
            gathered = [torch.empty_like(local) for _ in range(d.ep_size)]
            dist.all_gather(gathered, local, group=d.group)
        self._routing.append(torch.stack(gathered, dim=2).cpu())  # the host read
        self._routed_tokens = d.last_num_tokens
        self._route_calls.clear()

    def routing_profile(self) -> RoutingProfile:
        """The routing recorded so far (``record_routing=True``), one profile step per forward
        pass, split by source rank; ``.to_json(path)`` writes it for ``te-paged plan``."""
        if not self.record_routing:
            raise RuntimeError("construct the runner with record_routing=True to record routing")
        if not self._routing:
            raise RuntimeError("no step has been recorded yet")
        d = self.layers[0].dispatcher
        return RoutingProfile(
            num_experts=d.config.num_moe_experts,
            ep_size=d.ep_size,
            top_k=d.config.moe_router_topk,
            tokens_per_rank=self._routed_tokens,
            tokens_by_source=torch.cat(self._routing).tolist(),
        )

    def _measured(self, step_fn: Callable[[], Any]) -> tuple[Any, int | None, str | None]:
        if not self.measure_fallback_memory:
            return step_fn(), None, None
        result, report = measure_peak(step_fn, self._device())
        return result, report.peak_bytes, report.method
