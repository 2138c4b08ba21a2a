"""``MegatronLoopAdapter``: te_paged's layers under Megatron-LM's own training loop.

Megatron-LM's ``pretrain()`` (``megatron/training/training.py``, 0.19.2) wraps every
``forward_backward_func`` call in Megatron's own ``PagedStashRunner`` whenever
``moe_expert_rank_capacity_factor`` is set — in ``train()`` and in each ``evaluate()`` — and has
no way to substitute another runner. That runner reaches each MoE layer only through its token
dispatcher (``megatron/core/transformer/moe/paged_stash.py``), and te_paged's dispatcher serves
those calls; this adapter, one per :func:`~te_paged.integrations.megatron.get_te_paged_moe_spec`
(shared by the layers built from it), is what they report to:

=============================================  ========================  =========================
Megatron's runner calls                        when                      te_paged's adapter
=============================================  ========================  =========================
``hasattr(dispatcher, "check_over_budget")``   its ``__init__``:         the step boundary's
                                               ``train()`` before the    random state (below)
                                               loop, each ``evaluate``
the layer's forward (not a runner call)        first MoE forward of an   the layers' buffers, FP8
                                               attempt                   metas, aux-loss tracker
``dispatcher.check_over_budget()``             after each attempt,       the rank's te_paged flags
                                               before its one            (over budget, stash
                                               ``all_reduce``            overflow, invalid counts)
                                                                         as one device bool
``_comm_manager.moe_expert_rank_capacity_      ``prepare_for_rerun``     te_paged's own reduction
factor = None``, ``reset_over_budget()``                                 (the rerun path only),
                                                                         guard, growth, restore,
                                                                         pools freed, dropless
                                                                         and stash off
``_comm_manager.moe_expert_rank_capacity_      an attempt it keeps       record, step boundary
factor = config's``                                                      (``manager.reset()``),
                                                                         the next step's random
                                                                         state
=============================================  ========================  =========================

What Megatron's runner does itself and te_paged does not repeat: the data replay (it pre-reads
the microbatches), zeroing the grad buffers and the optimizer's gradients, and turning
``moe_paged_stash`` off on the model's configs for the rerun (te_paged's layers read that field
once, when built; the adapter's own switches turn its stash off).

**Exact reruns.** Megatron's runner restores no random state, so with dropout its rerun draws
other masks (docs/megatron.md). The adapter snapshots what a rerun must give back in two
places, because the first MoE layer's forward comes after the embedding's and the attention's
dropout: the random generators (torch's CPU and CUDA ones and Megatron's RNG tracker) at the
step boundary — when Megatron's runner keeps a step, and when it is built —, and the layers'
own state (buffers such as the routers' ``expert_bias``, FP8 metas, :class:`Restorable`
modules, Megatron's aux-loss tracker, which its training log clears between steps) at the
first MoE forward of the step. Between steps ``pretrain()`` draws no random number (the
optimizer, logging, checkpoints and evaluation in eval mode do not), so the rerun is the step
that never overflowed, bitwise; a loop that draws between steps would make it inexact.

**One host read per step.** Megatron's runner reads its reduced flags once; the adapter adds
none to a step it keeps. Only a step that reruns (whose dropless rerun reads counts anyway)
runs te_paged's own reduction, over the ranks of the pipeline stage: which ranks overflowed or
went over budget, the factors that would have fitted, the pages a pool needs, invalid counts
(every rank of the stage raises :class:`~te_paged.runtime.InvalidCountsError`) and the
consecutive-fallback guard (:class:`~te_paged.runtime.FallbackLimitError`). Pools grow after
the capture step and after an overflow (agreed across the expert-parallel group when they are
allocated); the growth ahead of an overflow that te_paged's runner does from its per-step
reduction has no figures here and is not done. A kept step's :class:`StepRecord` holds no
high-water marks or peak tokens for the same reason.

**Logging.** :attr:`MegatronLoopAdapter.records` keeps the steps' records, ``on_record`` sees
each; every ``log_interval`` training iterations (default: the loop's own, Megatron-LM's
``--log-interval`` or Megatron-Bridge's ``LoggerConfig.log_interval``, :mod:`.log_sources`)
rank 0 logs the fallbacks and the pool bytes, and the rank holding the loop's TensorBoard
writer writes them there (``te_paged/fallbacks``, ``te_paged/pool_bytes``).

**Inference passes between steps.** A forward without autograd that no runner drives (no
Megatron ``PagedStashRunner`` call on the stack, no te_paged runner inside its step) starts no
attempt; in eval mode the layer runs it dropless and unstashed, leaving the step's counters as
they were (:meth:`MegatronLoopAdapter.on_forward`): an RL framework's logprob pass.

Importing this module does not import Megatron.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
import logging
import math
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from te_paged.config.checks import require_bool, require_int, require_real
from te_paged.integrations.megatron.log_sources import find_bridge_state, log_settings
from te_paged.integrations.megatron.runner import MegatronPagedStashRunner
from te_paged.kernels.layout import Flag
from te_paged.runtime import StepRecord, StepState
from te_paged.runtime.records import paged_nothing
from te_paged.runtime.step_state import Restorable
from te_paged.stash import StashMode

if TYPE_CHECKING:
    from torch import nn

    from te_paged.moe import StaticBudgetDispatcher

__all__ = ["MegatronLoopAdapter"]

logger = logging.getLogger(__name__)


class _Phase(enum.Enum):
    UNREAD = "no Megatron runner has probed the layers yet"
    READY = "between steps: the next step's random state is held"
    RUNNING = "an attempt runs"
    CHECKED = "Megatron's runner read the attempt's flags"
    RERUN = "prepared for the dropless rerun"


class _Engine(MegatronPagedStashRunner):
    """te_paged's runner machinery over the adapter's layers, driven by the adapter instead of
    by its own ``__call__``: snapshot and restore, the reduction, growth, the guard."""


class MegatronLoopAdapter:
    """te_paged's side of Megatron's own ``PagedStashRunner``; see the module docstring.

    ``MegatronLoopAdapter(*, max_consecutive_fallbacks=3, grow_pool=True, grow_headroom=1.10,
    max_pool_bytes=None, grow_capacity=True, capacity_headroom=1.10, max_capacity_factor=None,
    keep_records=1000, on_record=None, log_interval=None, restorables=())``: the options of
    :class:`~te_paged.integrations.megatron.MegatronPagedStashRunner` that apply here;
    ``log_interval`` (training iterations; default Megatron's ``--log-interval`` when its
    arguments are parsed, else no interval logging).
    Give one to :func:`~te_paged.integrations.megatron.get_te_paged_moe_spec` (``loop=``) to
    set them or to read :attr:`records`; each spec builds its own otherwise (reach it from a
    layer as ``layer.loop``). Every layer built from the spec registers itself; the adapter
    starts working when Megatron's runner is built around them.
    """

    def __init__(
        self,
        *,
        max_consecutive_fallbacks: int = 3,
        grow_pool: bool = True,
        grow_headroom: float = 1.10,
        max_pool_bytes: int | None = None,
        grow_capacity: bool = True,
        capacity_headroom: float = 1.10,
        max_capacity_factor: float | None = None,
        keep_records: int = 1000,
        on_record: Callable[[StepRecord], None] | None = None,
        log_interval: int | None = None,
        restorables: Iterable[object] = (),
    ) -> None:
        require_int("max_consecutive_fallbacks", max_consecutive_fallbacks, minimum=1)
        require_bool("grow_pool", grow_pool)
        require_real("grow_headroom", grow_headroom, 1.0)
        require_int("keep_records", keep_records, minimum=0)
        if max_pool_bytes is not None:
            require_int("max_pool_bytes", max_pool_bytes, minimum=1)
        require_bool("grow_capacity", grow_capacity)
        require_real("capacity_headroom", capacity_headroom, 1.0)
        if max_capacity_factor is not None:
            require_real("max_capacity_factor", max_capacity_factor, 0.0, strict=True)
        if log_interval is not None:
            require_int("log_interval", log_interval, minimum=1)
        if on_record is not None and not callable(on_record):  # checked here, not at a record
            raise TypeError(f"on_record must be a callable taking a StepRecord, or None; got "
                            f"{on_record!r}")  # fmt: skip
        if restorables is None or isinstance(restorables, (str, bytes)):
            raise TypeError(f"restorables must be an iterable of Restorable objects (default "
                            f"()), got {restorables!r}")  # fmt: skip
        restorables = list(restorables)
        for obj in restorables:
            if not isinstance(obj, Restorable):
                raise TypeError(f"{obj!r} is not Restorable: it needs snapshot() and "
                                "restore(state)")  # fmt: skip
        self._options = {
            "max_consecutive_fallbacks": max_consecutive_fallbacks,
            "grow_pool": grow_pool,
            "grow_headroom": grow_headroom,
            "max_pool_bytes": max_pool_bytes,
            "keep_records": keep_records,
        }
        self._capacity = {
            "grow_capacity": grow_capacity,
            "capacity_headroom": capacity_headroom,
            "max_capacity_factor": max_capacity_factor,
        }  # the engine's attributes (MegatronPagedStashRunner's signature has no such options)
        self.on_record = on_record
        self.log_interval = log_interval
        self._restorables = list(restorables)
        self._layers: list[nn.Module] = []
        self._engine: _Engine | None = None
        #: A te_paged runner (``MegatronPagedStashRunner``) drives the layers: the adapter
        #: stays out of the way and Megatron's runner is refused (two runners, one step).
        self.driven_by: object | None = None
        self.phase = _Phase.UNREAD
        self._state: StepState | None = None
        self._forward_only = False
        self._record: StepRecord | None = None
        self._rerun = contextlib.ExitStack()
        #: The last ``keep_records`` steps' records (training and evaluation).
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=keep_records)
        #: Training steps rerun so far (evaluations are not counted).
        self.fallbacks = 0
        self._interval = {"fallbacks": 0, "steps": 0}
        #: Megatron-Bridge's ``GlobalState`` of the run (weakly held), once found.
        self._bridge_state: weakref.ref | None = None
        # Weakly held: the global hook must not keep the adapter (and its layers) alive.
        on_step = functools.partial(_optimizer_step, weakref.ref(self))
        hook = register_optimizer_step_post_hook(on_step)
        weakref.finalize(self, hook.remove)

    # ---------------------------------------------------------------------------- set-up

    def register(self, layer: nn.Module) -> None:
        """A layer built from the spec (``PagedStashMoELayer`` calls this)."""
        if self._engine is not None:
            raise RuntimeError(
                "a layer was built from this spec after Megatron's PagedStashRunner was built "
                "around the earlier ones: build every model chunk first, then train"
            )
        self._layers.append(layer)

    def note_runner(self, runner: object) -> None:
        """A te_paged step runner was built over the layers (``attach_runner``)."""
        if not isinstance(runner, _Engine):
            self.driven_by = runner

    @property
    def layers(self) -> list[nn.Module]:
        return list(self._layers)

    @property
    def dispatchers(self) -> list[StaticBudgetDispatcher]:
        """The static-budget dispatchers of the adapter's layers (their counters and bytes)."""
        return self._engine_now().dispatchers

    def _engine_now(self) -> _Engine:
        if self._engine is None:
            engine = _Engine(self._layers, None, restorables=self._restorables, **self._options)
            engine.group = _stage_group()
            for name, value in self._capacity.items():
                setattr(engine, name, value)
            self._engine = engine
        return self._engine

    def refuse_if_driven(self) -> None:
        """``TypeError`` when a te_paged runner already drives these layers."""
        if self.driven_by is not None:
            raise TypeError(
                "Megatron's PagedStashRunner and te_paged's MegatronPagedStashRunner were both "
                "built around te_paged's layers: one runner per step. Under Megatron-LM's "
                "training loop (pretrain(), which builds Megatron's runner whenever "
                "moe_expert_rank_capacity_factor is set) drop MegatronPagedStashRunner; in a "
                "training step of your own, call MegatronPagedStashRunner and not Megatron's"
            )

    # ---------------------------------------------------------------------- Megatron's calls

    def probe(self) -> None:
        """Megatron's runner looked the dispatcher up: at its construction (``train()``,
        ``evaluate()``) or right before reading the flags."""
        self.refuse_if_driven()
        if self.phase in (_Phase.UNREAD, _Phase.READY):
            self._engine_now()
            self._take_boundary_state()
            self.phase = _Phase.READY
            found = find_bridge_state()  # Megatron-Bridge's loop: its state logs the steps
            if found is not None:
                self._bridge_state = found

    def on_forward(self, *, training: bool, grad: bool) -> bool:
        """A layer's forward (every microbatch; only the first of an attempt matters): the
        module's training mode and whether autograd records. True for an inference pass no
        runner checks (autograd off and eval mode, outside a runner's step: an RL framework's
        logprob pass between steps, say): the layer then runs it dropless and unstashed, and
        the adapter leaves the step it is between as it was (no attempt, record or flag)."""
        if not grad and not self._in_runner_step():
            return not training  # no attempt; a train-mode pass keeps the static budget
        training = training and grad
        if self.driven_by is not None or self.phase in (_Phase.UNREAD, _Phase.RUNNING):
            return False
        if self.phase is _Phase.CHECKED:
            raise RuntimeError(
                "te_paged's MoE layer ran again after Megatron's PagedStashRunner read its "
                "flags but before it kept the step or prepared a rerun: te_paged's adapter "
                "follows that runner's calls (check_over_budget, then the capacity factor "
                "set back or reset_over_budget); drive the step with one runner, unmodified"
            )
        engine = self._engine_now()
        if self.phase is _Phase.READY:
            self._forward_only = not training
            # The layers' own state, now: the aux-loss tracker is cleared between steps.
            fresh = engine.snapshot_state()
            assert self._state is not None
            self._state.modules = fresh.modules
            self._state.extra["aux_losses"] = fresh.extra["aux_losses"]
        self.phase = _Phase.RUNNING
        return False

    def _in_runner_step(self) -> bool:
        """Whether a runner drives the forward now: te_paged's inside its step, or Megatron's
        ``PagedStashRunner.__call__`` on the call stack (its evaluations run without autograd,
        and it reads their flags)."""
        if self.driven_by is not None:
            return bool(getattr(self.driven_by, "in_step", True))
        megatron = sys.modules.get("megatron.core.transformer.moe.paged_stash")
        runner = getattr(megatron, "PagedStashRunner", None)
        if runner is None:
            return False
        code = runner.__call__.__code__
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is code:
                return True
            frame = frame.f_back
        return False

    def check(self) -> torch.Tensor:
        """``check_over_budget()``: one device bool, any te_paged flag of this rank (no host
        read). Megatron ORs it over the layers and reduces it over the world."""
        self.refuse_if_driven()
        engine = self._engine_now()
        if self.phase is _Phase.RUNNING:
            self.phase = _Phase.CHECKED
            if self._state is not None and self._state.modules is not None:
                engine.module_state.learn(self._state.modules)
        return _any_flag(engine)

    def set_capacity_factor(self, value: float | None) -> None:
        """Megatron's runner writes ``_comm_manager.moe_expert_rank_capacity_factor``: ``None``
        before its rerun, the config's value after an attempt it keeps."""
        self.refuse_if_driven()
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):  # fmt: skip
            raise ValueError(
                f"Megatron's PagedStashRunner wrote moe_expert_rank_capacity_factor={value!r} "
                "into a te_paged dispatcher: it may write None (the dropless rerun) or a "
                "positive finite factor (the attempt is kept); anything else leaves no budget"
            )
        if value is None:
            self.prepare_rerun()
        elif self.phase is _Phase.CHECKED:
            self._keep()

    def prepare_rerun(self) -> None:
        """``reset_over_budget()`` / the factor cleared: the rerun comes next."""
        self.refuse_if_driven()
        if self.phase is _Phase.RERUN:
            return  # the other layers' calls of the same preparation
        if self.phase is not _Phase.CHECKED or self._state is None:
            raise RuntimeError(
                f"Megatron's PagedStashRunner asks for a rerun, but te_paged's adapter is "
                f"{self.phase.name} ({self.phase.value}): a rerun follows an attempt whose "
                "flags that runner read (check_over_budget), of a step whose start te_paged "
                "saw; without that it could not restore what the attempt changed"
            )
        engine = self._engine_now()
        with torch.no_grad():
            flag_ranks, per_rank = engine._reduce()  # the rerun path's own reduction
        record = engine._record(flag_ranks, per_rank, self._forward_only)
        capturing = any(m.mode is StashMode.CAPTURE for m in engine.managers)
        if capturing and not self._forward_only:
            engine._after_capture(record)
        engine._before_fallback(record, flag_ranks, per_rank, self._forward_only)
        engine._forward_only = self._forward_only  # an evaluation zeroes no gradients
        engine._prepare_rerun(self._state, record, per_rank)
        # Megatron's runner reads the rerun's flags too: this attempt's are spent.
        for manager in engine.managers:
            manager.clear_flags()
        engine._zero_counters()
        engine._enter_fallback(self._rerun)
        record.attempt, record.enabled = 2, False
        self._record = record
        if not self._forward_only:
            self.fallbacks += 1
            self._interval["fallbacks"] += 1
        self.phase = _Phase.RERUN

    # ---------------------------------------------------------------------------- internals

    def _keep(self) -> None:
        """Megatron keeps the attempt: record it, end the rerun, reset at the step boundary."""
        engine = self._engine_now()
        record = self._record
        if record is None:  # attempt 1 kept: only host-side figures (see the module doc)
            budget, balanced = engine._budget()
            capturing = any(m.mode is StashMode.CAPTURE for m in engine.managers)
            record = StepRecord(
                step=engine.step_index,
                attempt=1,
                enabled=engine._stash_enabled() and not self._forward_only,
                stash_overflow_ranks=0,
                overbudget_ranks=0,
                host_spill_ranks=0,
                will_retry=False,
                pool_high_water_pages={},
                pool_pages=engine._pool_pages(),
                peak_tokens=0,
                budget_tokens=budget,
                balanced_tokens=balanced,
            )
            if not self._forward_only:
                engine.consecutive_fallbacks = 0
                if capturing:
                    engine._after_capture(record)
        if self._record is not None:  # after Megatron's rerun: what it measured
            engine.size_receive_after_rerun(record)
        wire = engine._wire()
        if wire is not None and record.a2a_capacity_factor is None:
            record.a2a_capacity_factor = wire.a2a_capacity_factor
            record.pair_capacity = wire.pair_capacity
        record.bytes_sent = engine._bytes_sent()
        record.stashes_skipped = sum(m.stashes_skipped for m in engine.managers)
        record.paged_nothing = paged_nothing(engine.managers)
        self._rerun.close()
        self._rerun = contextlib.ExitStack()
        self._record = None
        self.records.append(record)
        if self.on_record is not None:  # before the reset: the managers hold the step's figures
            self.on_record(record)
        engine._begin_step()  # the step boundary: may allocate (and agree on) the pools
        engine.step_index += 1
        if not self._forward_only:
            self._interval["steps"] += 1
            self._log_interval(engine)
        self._take_boundary_state()
        self.phase = _Phase.READY

    def _take_boundary_state(self) -> None:
        self._state = self._engine_now().snapshot_state()

    def on_optimizer_step(self) -> None:
        """Any optimizer stepped (torch's global hook): a training attempt must have been
        checked by then. Raised once: the adapter then waits for Megatron's runner to be built
        again (an optimizer of another model in the process is not stopped twice)."""
        if self.phase is _Phase.RUNNING and not self._forward_only and self.driven_by is None:
            self.phase, self._state = _Phase.UNREAD, None
            raise RuntimeError(
                "an optimizer stepped after a training step of te_paged's layers that Megatron's "
                "PagedStashRunner never checked: its over-budget and stash-overflow flags were "
                "not read, so a step that dropped tokens could have been kept. Megatron's runner "
                "reads the layers it finds as `decoder.layers[i].mlp`; keep te_paged's MoE layer "
                "there, or drive the step with MegatronPagedStashRunner"
            )

    def _log_interval(self, engine: _Engine) -> None:
        interval, iteration, writer = log_settings(self.log_interval, self._bridge_state)
        if interval is None or iteration is None or iteration % interval:
            return
        pool_bytes = sum(b.pool_bytes for m in engine.managers for b in m.buffers.values())
        fallbacks = self._interval["fallbacks"]
        self._interval = {"fallbacks": 0, "steps": 0}
        if writer is not None:  # the loop's writer: on its last rank, Megatron-LM's and Bridge's
            writer.add_scalar("te_paged/fallbacks", fallbacks, iteration)
            writer.add_scalar("te_paged/pool_bytes", pool_bytes, iteration)
        if _rank() != 0:
            return
        logger.info(
            "te_paged: iteration %d: %d fallback(s) in the last %d iteration(s), %d in all; "
            "paged-stash pools %.2f MiB on this rank",
            iteration,
            fallbacks,
            interval,
            self.fallbacks,
            pool_bytes / 2**20,
        )


def _optimizer_step(ref: weakref.ref, optimizer: object, args: object, kwargs: object) -> None:
    adapter = ref()
    if adapter is not None:
        adapter.on_optimizer_step()


def _any_flag(engine: _Engine) -> torch.Tensor:
    """Over budget, stash overflow or invalid counts on this rank, as one device bool."""
    device = engine._device()
    flag = torch.zeros((), dtype=torch.bool, device=device)
    for manager in engine.managers:
        manager.join_side_streams()
        flags = manager.flags
        flag = flag | (flags[Flag.OVERFLOW] > 0) | (flags[Flag.INVALID] > 0)
    for d in engine.dispatchers:
        flag = flag | (d.over_budget > 0).to(device) | (d.invalid_indices > 0).to(device)
    for t in engine.participants.invalid_flags:
        flag = flag | (t > 0).to(device)
    return flag.reshape(1)


def _stage_group() -> dist.ProcessGroup | None:
    """The ranks of this pipeline stage (every one holds the same layers): Megatron's data-
    parallel group with context parallelism (tensor parallelism is 1 with te_paged's
    dispatcher); the world without Megatron's parallel state."""
    from megatron.core import parallel_state

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
