"""``te-paged ab``: the same model and data with paged stash ON and OFF, on every rank.

Per step it records loss and gradient norm of both runs (and whether they, and every single
gradient, are bitwise equal), the runner's record (attempt, enabled, flags); per run the peak
memory of each step that can be the measured step (not the first, nor a capture step:
:func:`measures`), measured by torch's trackers (the ON figure includes the pool, allocated
at the step boundary), and the capacity model's prediction ``(cf − bf) × S`` with ``S`` the
balanced-case bytes of the paged tensors. The saving is measured on the *measured step*: the
last step after the capture step whose kept attempt ran with the stash (step 0 captures and has
no pool yet; a step that fell back reran without the stash and freed the pool). :func:`run_ab`
runs on one rank (inside a process group or not); :func:`gather` collects every rank's result on
each rank; :func:`format_table` renders it; :mod:`te_paged.tools.run_record` writes it as JSON.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from te_paged.moe import StaticBudgetDispatcher
from te_paged.runtime.memory import (
    PeakMemoryMeter,
    capacity_model_saving,
    reload_adjusted_saving,
)
from te_paged.runtime.planner import RoutingProfile
from te_paged.runtime.runner import PagedStashRunner, StepRecord
from te_paged.stash import PagedStashManager, StashMode
from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

__all__ = [
    "ABResult",
    "RankResult",
    "StepResult",
    "capturing",
    "format_table",
    "gather",
    "measured_step",
    "pool_and_s_bytes",
    "rank_result",
    "run_ab",
    "step_label",
    "step_result",
]


@dataclasses.dataclass
class StepResult:
    loss: float
    grad_norm: float
    attempt: int
    enabled: bool
    stash_overflow_ranks: int
    overbudget_ranks: int
    host_spill_ranks: int
    peak_bytes: int
    record: dict  # the runner's StepRecord, as a dict
    #: The stash's capture step (saved tensors truncated, the peak learned; no pool yet).
    capture: bool = False
    pool_bytes: int = 0  # the stash pools after the step: 0 OFF, at capture, after a fallback
    s_bytes: int = 0  # S after the step (see the module docstring); 0 while no pool exists
    stashes: int = 0  # this rank's stash copies and pops in attempt 1 (a rerun stashes none)
    pops: int = 0
    #: This rank's all-to-all bytes in the step (dispatch and combine, forward and backward,
    #: every attempt), and what a dropless, variable-split exchange of the kept attempt's
    #: routing would have sent (te_paged.moe.dispatcher, "Bytes on the wire").
    bytes_sent: int = 0
    dropless_bytes: int = 0
    stashes_skipped: int = 0  # this rank's tensors kept unpaged in attempt 1 (backward came first)


@dataclasses.dataclass
class RankResult:
    rank: int
    on: list[StepResult]
    off: list[StepResult]
    grads_equal: list[bool]  # per step: every gradient of this rank bitwise equal
    pool_bytes: int  # the measured step's (0 when there is none)
    host_pool_bytes: int
    s_bytes: int  # balanced-case bytes of the paged tensors, at the measured step
    stashes: int  # at the measured step (the last step when there is none)
    pops: int
    memory_method: str
    timeline: list[dict]
    routing: RoutingProfile | None = None  # the OFF run's, recorded by its runner
    #: The measured step (see :func:`measured_step`); None: no step after the capture step
    #: kept paged stash (each was rerun without it), so there is no saving to report.
    memory_step: int | None = None
    stage: int = 0  # the rank's pipeline stage (megatron engine; 0 without pipelining)
    #: Layers of static-size reloads live at the peak: 1, or 1 + the look-ahead with streams.
    reload_layers: int = 1
    stashes_skipped: int = 0  # at the measured step: tensors kept unpaged (backward came first)


@dataclasses.dataclass
class ABResult:
    config: dict
    world_size: int
    ranks: list[RankResult]

    @property
    def equal(self) -> bool:
        return all(
            all(r.grads_equal)
            and all(
                _same(a.loss, b.loss) and a.grad_norm == b.grad_norm for a, b in zip(r.on, r.off)
            )
            for r in self.ranks
        )

    @property
    def stages(self) -> int:
        """Pipeline stages (the megatron engine's ``--pipeline-parallel``; 1 otherwise)."""
        return int(self.config.get("pipeline_parallel", 1))

    def memory(self, stage: int | None = None) -> dict[str, int | float | None] | None:
        """Max over ranks (of ``stage``, or all) of the measured step's peaks, and the
        capacity model; None when no step after the capture step kept paged stash. A ratio
        whose model is not positive (``cf ≤ bf``, or one layer's reload ``cf/L`` at least
        ``cf − bf``) is None: there is nothing to compare against. ``L`` is the layers whose
        tensors are live at the peak: every layer without pipelining; a stage's in-flight
        microbatch(-chunk)s' layers with it (:func:`te_paged.runtime.schedules.in_flight`)."""
        ranks = [r for r in self.ranks if stage is None or r.stage == stage]
        steps = {r.memory_step for r in ranks}
        if None in steps:
            return None
        # Reruns are decided by one collective, so every rank kept the same attempts.
        assert len(steps) == 1, f"ranks measured different steps: {sorted(steps)}"
        (step,) = steps
        on = max(r.on[step].peak_bytes + r.pool_bytes for r in ranks)
        off = max(r.off[step].peak_bytes for r in ranks)
        s = max(r.s_bytes for r in ranks)
        cfg = self.config
        pool = max(r.pool_bytes for r in ranks)
        # The factor in effect: the pool the step held over S. Grown pools (grow_pool) hold
        # more than the configured factor gives, and the model must count what they hold.
        cf, bf = cfg["capacity_factor"], (pool / s if s > 0 else cfg["buffer_factor_cuda"])
        predicted = capacity_model_saving(cf, bf, s)
        layers = cfg["layers"] if stage is None else self.live_layers(stage)
        reloads = max(r.reload_layers for r in ranks)
        adjusted = reload_adjusted_saving(cf, bf, s, layers, reloads)
        saving = off - on
        return {
            "step": step,
            "peak_on_bytes": on,
            "peak_off_bytes": off,
            "pool_bytes": pool,
            "S_bytes": s,
            "buffer_factor": bf,
            "saving_bytes": saving,
            "predicted_saving_bytes": predicted,
            "measured_over_predicted": saving / predicted if predicted > 0 else None,
            "reload_adjusted_saving_bytes": adjusted,
            "measured_over_reload_adjusted": saving / adjusted if adjusted > 0 else None,
        }

    def wire(self) -> dict[str, int | float | None] | None:
        """The all-to-all bytes of one step, max over ranks: ON's and OFF's sent at the measured
        step (the last step without one), the dropless reference of the same routing, and
        each's ratio to it; None when no rank exchanged anything (one rank)."""
        if not any(s.bytes_sent for r in self.ranks for s in r.on + r.off):
            return None
        steps = {r.memory_step for r in self.ranks}
        step = steps.pop() if len(steps) == 1 and None not in steps else -1
        on = max(r.on[step].bytes_sent for r in self.ranks)
        off = max(r.off[step].bytes_sent for r in self.ranks)
        ref = max(r.off[step].dropless_bytes for r in self.ranks)
        return {
            "step": step % len(self.ranks[0].on),
            "on_bytes": on,
            "off_bytes": off,
            "dropless_bytes": ref,
            "on_over_dropless": on / ref if ref else None,
            "off_over_dropless": off / ref if ref else None,
        }

    def live_layers(self, stage: int) -> int:
        """Layers whose stashed tensors a pipeline stage holds at its peak: its in-flight
        microbatch-chunks times the layers of a chunk."""
        from te_paged.runtime.schedules import PipelineConfig, in_flight

        cfg = self.config
        pipeline = PipelineConfig(
            self.stages, cfg.get("microbatches", 1), cfg.get("virtual_stages"), None
        )
        per_chunk = pipeline.check_layers(cfg["layers"])
        return in_flight(pipeline, stage).peak * per_chunk

    def memory_per_stage(self) -> list[dict[str, int | float | None] | None] | None:
        """:meth:`memory` of each pipeline stage, stage 0 first; None without pipelining."""
        if self.stages == 1:
            return None
        return [self.memory(stage) for stage in range(self.stages)]


def _same(a: float, b: float) -> bool:
    """Equal floats, NaN included (a pipeline stage without the loss reports NaN in both)."""
    return a == b or (a != a and b != b)


def measured_step(steps: list[StepResult]) -> int | None:
    """The step the saving is measured on: the last whose kept attempt ran with the stash,
    other than the capture step (which has no pool yet). ``None`` if there is none. Example:
    steps ``[capture, paged, fallback]`` → 1; ``[capture, fallback, fallback]`` → None."""
    kept = [i for i, s in enumerate(steps) if s.enabled and not s.capture]
    return kept[-1] if kept else None


#: ``memory_method`` of a run none of whose steps was measured.
NOT_MEASURED = "not measured"


def measures(step: int, capture: bool) -> bool:
    """Whether ``ab`` measures the memory of ``step`` (of the ON or the OFF run): neither the
    first step (ON's is always a capture step: a manager starts in capture mode) nor any other
    capture step can be the measured step (:func:`measured_step`), so neither is measured. On
    CPU that halves the run: torch's ``MemTracker`` costs about as much as the step it watches
    (its dispatch mode sees every op). A step not measured reports ``peak_bytes`` 0."""
    return step > 0 and not capture


class StepMeter:
    """A step's memory as ``ab`` takes it: a :class:`PeakMemoryMeter` around the step when
    ``measure`` and :func:`measures` allow, else nothing (``peak_bytes`` 0, ``method`` None,
    ``new_iteration`` None: the runner's ``before_rerun`` when nothing is measured)."""

    def __init__(self, device: torch.device, step: int, capture: bool, measure: bool = True):
        self._meter = PeakMemoryMeter(device) if measure and measures(step, capture) else None
        self.new_iteration = None if self._meter is None else self._meter.new_iteration

    def __enter__(self) -> StepMeter:
        if self._meter is not None:
            self._meter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._meter is not None:
            self._meter.__exit__(*exc)

    @property
    def peak_bytes(self) -> int:
        return 0 if self._meter is None else self._meter.report.peak_bytes

    @property
    def method(self) -> str | None:
        return None if self._meter is None else self._meter.report.method


def step_label(step: StepResult) -> str:
    """How the ON run's kept attempt of a step ran: ``capture``, ``paged``, ``fallback`` (rerun
    without the stash after an overflow or over-budget attempt 1) or ``unpaged``."""
    if step.attempt > 1:
        return "capture, fallback" if step.capture else "fallback"
    if not step.enabled:
        return "unpaged"
    return "capture" if step.capture else "paged"


def pool_and_s_bytes(managers: list[PagedStashManager]) -> tuple[int, int]:
    """``(pool bytes, S bytes)`` of the managers now (0, 0 while no pool is allocated)."""
    pool = s_bytes = 0
    for manager in managers:
        stats = manager.stats()
        pool += stats.pool_bytes
        for key, buf in manager.buffers.items():
            rows = stats.capture_peak_balanced_rows[str(key)]
            s_bytes += rows * key.hidden * buf.pool_NH.element_size()
    return pool, s_bytes


def step_result(
    loss: float | torch.Tensor,
    grad_norm: float | torch.Tensor,
    record: StepRecord,
    peak_bytes: int,
    capture: bool,
    managers: list[PagedStashManager],
    dispatchers: list[StaticBudgetDispatcher] = (),
) -> StepResult:
    """One step's :class:`StepResult` from the runner's record and the managers and
    dispatchers as they are after the step (pool, ``S``, stash copies and pops, bytes)."""
    pool, s_bytes = pool_and_s_bytes(managers)
    dropless = sum(int(d.dropless_bytes) for d in dispatchers)  # a host read: after the step
    stats = [m.stats() for m in managers]
    return StepResult(
        float(loss),
        float(grad_norm),
        record.attempt,
        record.enabled,
        record.stash_overflow_ranks,
        record.overbudget_ranks,
        record.host_spill_ranks,
        peak_bytes,
        dataclasses.asdict(record),
        capture,
        pool,
        s_bytes,
        sum(s.stashes for s in stats),
        sum(s.pops for s in stats),
        record.bytes_sent,
        dropless,
        sum(s.stashes_skipped for s in stats),
    )


def capturing(managers: list[PagedStashManager]) -> bool:
    """Whether the step about to run (after ``reset()``) is a capture step."""
    return any(m.enabled and m.mode is StashMode.CAPTURE for m in managers)


def _grad_vector(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _run(
    cfg: ModelConfig,
    paged: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
    rank: int,
    progress: Callable[[str], None] | None,
    timeline: bool,
    record_routing: bool = False,
) -> tuple[list[StepResult], list[list[torch.Tensor]], ToyMoEModel, PagedStashRunner, str]:
    model = ToyMoEModel(cfg, paged=paged, group=group, device=device, record_timeline=timeline)
    if cfg.skew and rank == 0:
        for layer in model.layers:
            layer.router.set_skew([0], cfg.skew)
    runner = PagedStashRunner(
        model,
        model.manager,
        group=group,
        grow_pool=cfg.grow_pool,
        grow_capacity=cfg.grow_capacity,
        measure_fallback_memory=False,
        record_routing=record_routing,  # a host read and a collective per step: OFF run only
    )
    steps, grads, method = [], [], NOT_MEASURED
    for step in range(cfg.steps):
        x, target = make_batch(cfg, step, rank, device)
        model.zero_grad(set_to_none=False)  # gradients stay allocated: not part of the peak

        def step_fn(x: torch.Tensor = x, target: torch.Tensor = target) -> torch.Tensor:
            loss = model(x, target)
            loss.backward()
            return loss.detach()

        if model.manager is not None:
            # The first reset after the capture step allocates the pool: do it outside the
            # measurement (the pool is added to ON's figure explicitly).
            model.manager.reset()
        managers = [] if model.manager is None else [model.manager]
        capture = capturing(managers)
        with StepMeter(device, step, capture) as meter:
            runner.before_rerun = meter.new_iteration
            loss, record = runner.step(step_fn)
        method = meter.method or method
        grads.append(_grad_vector(model))
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads[-1]]))
        steps.append(
            step_result(loss, norm, record, meter.peak_bytes, capture, managers, runner.dispatchers)
        )
        if progress is not None:
            progress(f"{'ON ' if paged else 'OFF'} step {step + 1}/{cfg.steps}")
    return steps, grads, model, runner, method


def run_ab(
    cfg: ModelConfig,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
    record_routing: bool = False,
) -> RankResult:
    """Run OFF then ON on this rank; compare; measure. ``record_routing`` keeps the OFF run's
    routing profile (tokens per expert per layer, by source rank) for the planner."""
    device = torch.device(device)
    rank = 0 if group is None else dist.get_rank(group)
    off, off_grads, _, off_runner, _ = _run(
        cfg, False, group, device, rank, progress, False, record_routing
    )
    on, on_grads, model, _, method = _run(cfg, True, group, device, rank, progress, rank == 0)
    equal = [
        len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        for a, b in zip(on_grads, off_grads)
    ]
    timeline = [dataclasses.asdict(e) for e in (model.manager.timeline or [])]
    return rank_result(
        rank,
        on,
        off,
        equal,
        model.manager.stats().host_pool_bytes,
        method,
        timeline,
        off_runner.routing_profile() if record_routing else None,
        reload_layers=model.manager.reload_layers,
    )


def rank_result(
    rank: int,
    on: list[StepResult],
    off: list[StepResult],
    equal: list[bool],
    host_pool_bytes: int,
    memory_method: str,
    timeline: list[dict],
    routing: RoutingProfile | None = None,
    *,
    reload_layers: int = 1,
) -> RankResult:
    """A rank's result, its pool, ``S`` and counts taken at the measured step."""
    step = measured_step(on)
    at = on[-1 if step is None else step]
    return RankResult(
        rank,
        on,
        off,
        equal,
        at.pool_bytes if step is not None else 0,
        host_pool_bytes,
        at.s_bytes if step is not None else 0,
        at.stashes,
        at.pops,
        memory_method,
        timeline,
        routing,
        step,
        reload_layers=reload_layers,
        stashes_skipped=at.stashes_skipped,
    )


def gather(result: RankResult, cfg: ModelConfig, group: dist.ProcessGroup | None) -> ABResult:
    if group is None:
        return ABResult(dataclasses.asdict(cfg), 1, [result])
    world = dist.get_world_size(group)
    results: list[RankResult | None] = [None] * world
    dist.all_gather_object(results, result, group=group)
    return ABResult(dataclasses.asdict(cfg), world, list(results))


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def _ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _percent(ratio: float | None) -> str:
    return "n/a (model ≤ 0)" if ratio is None else f"{100 * ratio:.1f} %"


def _memory_row(m: dict, cfg: dict, layers: int, stage: int | None = None, reloads: int = 1) -> str:
    # ", R 2" when more than one layer's reloads are live at the peak (stream overlap's
    # look-ahead: the column's model is then (cf − bf − R·cf/L) × S).
    r = f", R {reloads}" if reloads > 1 else ""
    lead = "" if stage is None else f"| {stage} "
    return (
        f"{lead}| {_mib(m['peak_on_bytes'])} | {_mib(m['peak_off_bytes'])} "
        f"| {_mib(m['pool_bytes'])} | {_mib(m['saving_bytes'])} "
        f"| {_mib(m['predicted_saving_bytes'])} "
        f"(cf {cfg['capacity_factor']}, bf {m['buffer_factor']:.2f}, "
        f"S {_mib(m['S_bytes'])}) "
        f"| {_percent(m['measured_over_predicted'])} "
        f"| {_mib(m['reload_adjusted_saving_bytes'])} (L {layers}{r}) "
        f"| {_percent(m['measured_over_reload_adjusted'])} |"
    )


def format_table(result: ABResult) -> str:
    """A reviewer's table: per step (labelled with how ON ran: capture, paged, fallback) ON/OFF
    loss and grad norm, attempts and flags; then the memory of the measured step (per pipeline
    stage with pipelining; the step rows show the last stage, which has the loss)."""
    last = result.stages - 1
    r0 = next(r for r in result.ranks if r.stage == last)
    rows = [
        "| step | loss ON | loss OFF | grad norm ON | grad norm OFF | bitwise equal | attempt "
        "| enabled | overflow ranks | over-budget ranks | host-spill ranks |",
        "| ---: | ---: | ---: | ---: | ---: | :---: | ---: | :---: | ---: | ---: | ---: |",
    ]
    for i, (a, b) in enumerate(zip(r0.on, r0.off)):
        eq = all(r.grads_equal[i] and _same(r.on[i].loss, r.off[i].loss) for r in result.ranks)
        rows.append(
            f"| {i} ({step_label(a)}) | {a.loss:.6f} | {b.loss:.6f} | {a.grad_norm:.6f} "
            f"| {b.grad_norm:.6f} | {'yes' if eq else 'NO'} | {a.attempt} | {a.enabled} "
            f"| {a.stash_overflow_ranks} | {a.overbudget_ranks} | {a.host_spill_ranks} |"
        )
    m = result.memory()
    cfg = result.config
    reloads = max(r.reload_layers for r in result.ranks)
    header = [
        "| peak ON (incl. pool) | peak OFF | pool | saving | predicted (cf − bf) × S "
        "| measured / predicted | less one layer's reload (cf − bf − cf/L) × S "
        "| measured / that |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    if m is None:
        rows += [
            "",
            "Memory: every step after the capture step was rerun without paged stash, so no "
            "step shows its saving (raise the factors the runner suggests, or run more steps).",
            "",
        ]
        counted = len(r0.on) - 1
    elif result.stages == 1:
        counted = m["step"]
        which = "the last step" if counted == len(r0.on) - 1 else "the last that ran with the stash"
        rows += [
            "",
            f"Memory of step {counted} ({which}), max over {result.world_size} rank(s) "
            f"({r0.memory_method}):",
            "",
            *header,
            _memory_row(m, cfg, cfg["layers"], reloads=reloads),
            "",
        ]
    else:
        counted = m["step"]
        which = "the last step" if counted == len(r0.on) - 1 else "the last that ran with the stash"
        rows += [
            "",
            f"Memory of step {counted} ({which}) per pipeline stage, max over the stage's "
            f"ranks ({r0.memory_method}); L: the layers a stage holds at its peak (in-flight "
            "microbatch-chunks x layers per chunk):",
            "",
            "| stage " + header[0],
            "| ---: " + header[1],
            *(
                _memory_row(sm, cfg, result.live_layers(stage), stage, reloads)
                for stage, sm in enumerate(result.memory_per_stage() or [])
                if sm is not None
            ),
            "",
        ]
    wire = result.wire()
    if wire is not None:
        rows += [
            f"All-to-all bytes per rank, step {wire['step']} (dispatch and combine, forward "
            f"and backward; max over ranks): ON {_mib(wire['on_bytes'])}, OFF "
            f"{_mib(wire['off_bytes'])}, dropless reference {_mib(wire['dropless_bytes'])}: "
            f"ON {_ratio(wire['on_over_dropless'])} the dropless bytes.",
            "",
        ]
    rows += [
        f"stashes/pops (rank {r0.rank}, step {counted}): {r0.stashes}/{r0.pops}"
        + (
            f", {r0.stashes_skipped} kept unpaged (their backward came first)"
            if r0.stashes_skipped
            else ""
        )
        + f"; ON and OFF {'bitwise equal' if result.equal else 'DIFFER'}.",
    ]
    return "\n".join(rows)
