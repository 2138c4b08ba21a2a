"""What ``te-paged ab`` reports, without torch: the per-step and per-rank results, the run's
memory and wire figures against the capacity model, and the table. The engines fill these in
(:mod:`te_paged.tools.ab` for the default and Megatron engines, ``jax_ab`` and
``torchtitan_ab``); ``te-paged ab --engine jax`` and the run record use them where only the
``jax`` extra is installed."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from te_paged.runtime.planner import RoutingProfile
from te_paged.runtime.pool_plan import capacity_model_saving, reload_adjusted_saving

__all__ = [
    "NOT_MEASURED",
    "ABResult",
    "RankResult",
    "StepResult",
    "format_table",
    "measured_step",
    "measures",
    "rank_result",
    "step_label",
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
        """The measured step's peaks over the ranks (of ``stage``, or all), and the capacity
        model; None when no step after the capture step kept paged stash.

        A peak is the lower median over the ranks of one pipeline stage, the highest over
        stages. The ranks of a stage run the same static shapes, so their peaks agree to the
        byte, except where a communication backend's thread still held a collective's buffers
        after the collective returned: on CPU, with more ranks than cores, gloo's worker can be
        descheduled between completing a collective and dropping its references, and that
        rank's peak gains the buffers (benchmarks/results/gloo-linger-2026-12-05.md). The lower
        median ignores such a rank wherever fewer
        than half of a stage's ranks have one; ``peak_on_rank_spread_bytes`` and
        ``peak_off_rank_spread_bytes`` report the largest spread of a stage (0 when every rank
        agrees). The pool is the largest rank's. A ratio
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
        pool = max(r.pool_bytes for r in ranks)
        on_peak, on_spread = _stage_peak(ranks, lambda r: r.on[step].peak_bytes)
        off, off_spread = _stage_peak(ranks, lambda r: r.off[step].peak_bytes)
        on = on_peak + pool
        s = max(r.s_bytes for r in ranks)
        cfg = self.config
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
            "peak_on_rank_spread_bytes": on_spread,
            "peak_off_rank_spread_bytes": off_spread,
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


def _stage_peak(ranks: list[RankResult], peak: Callable[[RankResult], int]) -> tuple[int, int]:
    """``(peak, spread)`` of ``ranks``: per pipeline stage the lower median of ``peak`` over its
    ranks and its spread (max − min); the highest median and the largest spread over stages
    (:meth:`ABResult.memory`)."""
    stages: dict[int, list[int]] = {}
    for r in ranks:
        stages.setdefault(r.stage, []).append(peak(r))
    return (
        max(statistics.median_low(p) for p in stages.values()),
        max(max(p) - min(p) for p in stages.values()),
    )


def _same(a: float, b: float) -> bool:
    """Equal floats, NaN included (a pipeline stage without the loss reports NaN in both)."""
    return a == b or (a != a and b != b)


def measured_step(steps: list[StepResult]) -> int | None:
    """The step the saving is measured on: the last whose kept attempt ran with the stash,
    other than the capture step (which has no pool yet), among those with the largest
    microbatch (a variable-length run). ``None`` if there is none. Example:
    steps ``[capture, paged, fallback]`` → 1; ``[capture, fallback, fallback]`` → None."""
    kept = [i for i, s in enumerate(steps) if s.enabled and not s.capture]
    if not kept:
        return None
    # A variable-length run: the last of the kept steps with the largest microbatch (the run's
    # peak memory is there; a pool sized for it costs more than it saves on a small step).
    largest = max(steps[i].record.get("max_microbatch_tokens", 0) for i in kept)
    return [i for i in kept if steps[i].record.get("max_microbatch_tokens", 0) == largest][-1]


#: ``memory_method`` of a run none of whose steps was measured.
NOT_MEASURED = "not measured"


def measures(step: int, capture: bool) -> bool:
    """Whether ``ab`` measures the memory of ``step`` (of the ON or the OFF run): neither the
    first step (ON's is always a capture step: a manager starts in capture mode) nor any other
    capture step can be the measured step (:func:`measured_step`), so neither is measured. On
    CPU that halves the run: torch's ``MemTracker`` costs about as much as the step it watches
    (its dispatch mode sees every op). A step not measured reports ``peak_bytes`` 0."""
    return step > 0 and not capture


def step_label(step: StepResult) -> str:
    """How the ON run's kept attempt of a step ran: ``capture``, ``paged``, ``fallback`` (rerun
    without the stash after an overflow or over-budget attempt 1) or ``unpaged``."""
    if step.attempt > 1:
        return "capture, fallback" if step.capture else "fallback"
    if not step.enabled:
        return "unpaged"
    return "capture" if step.capture else "paged"


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


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def _over_ranks(world_size: int) -> str:
    return "one rank" if world_size == 1 else f"lower median over {world_size} ranks"


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


def _pools_text(pages: dict[str, int]) -> str:
    """Pool pages per key, keys of the same size said once."""
    by_size: dict[int, list[str]] = {}
    for key, n in pages.items():
        by_size.setdefault(n, []).append(key)
    return "; ".join(f"{n} ({', '.join(keys)})" for n, keys in by_size.items()) or "none"


def _growth_text(growth: dict[str, dict]) -> str:
    """``record.pool_growth``, keys that grew alike said once."""
    alike: dict[tuple, list[str]] = {}
    for key, g in growth.items():
        alike.setdefault((g["from"], g["to"], g["needed"], g["why"]), []).append(key)
    return (
        "; ".join(
            f"{a} -> {b} (needed {need}, {why}: {', '.join(keys)})"
            for (a, b, need, why), keys in alike.items()
        )
        or "none"
    )


def _variable_length_rows(result: ABResult, r0: RankResult) -> list[str]:
    """The ON run's steps of a variable-length schedule: microbatch sizes, rerun, pools."""
    declared = result.config.get("max_tokens_per_rank")
    return [
        f"Variable-length steps, ON (rank {r0.rank}'s microbatches, tokens per rank; "
        + (f"declared maximum {declared}" if declared else "no declared maximum")
        + "): pool pages the step ran with, and their growth after it",
        "",
        "| step | microbatches | largest, any rank | attempt | pool pages | pools grow |",
        "| ---: | :--- | ---: | ---: | :--- | :--- |",
        *(
            f"| {i} ({step_label(a)}) | {' + '.join(map(str, a.record['microbatch_tokens']))} "
            f"| {a.record['max_microbatch_tokens']} | {a.attempt} "
            f"| {_pools_text(a.record['pool_pages'])} | {_growth_text(a.record['pool_growth'])} |"
            for i, a in enumerate(r0.on)
        ),
    ]


def _which(counted: int, r0: RankResult, cfg: dict) -> str:
    if cfg.get("token_schedule") or cfg.get("seq_schedule"):
        return "the last step with the largest microbatch that ran with the stash"
    return "the last step" if counted == len(r0.on) - 1 else "the last that ran with the stash"


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
    if cfg.get("token_schedule") or cfg.get("seq_schedule"):
        rows += ["", *_variable_length_rows(result, r0)]
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
        which = _which(counted, r0, cfg)
        rows += [
            "",
            f"Memory of step {counted} ({which}), {_over_ranks(result.world_size)} "
            f"({r0.memory_method}):",
            "",
            *header,
            _memory_row(m, cfg, cfg["layers"], reloads=reloads),
            "",
        ]
    else:
        counted = m["step"]
        which = _which(counted, r0, cfg)
        rows += [
            "",
            f"Memory of step {counted} ({which}) per pipeline stage, lower median over the "
            f"stage's ranks ({r0.memory_method}); L: the layers a stage holds at its peak "
            "(in-flight microbatch-chunks x layers per chunk):",
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
    if m is not None and (m["peak_on_rank_spread_bytes"] or m["peak_off_rank_spread_bytes"]):
        rows += [
            f"Ranks of one stage disagreed on a peak by up to "
            f"{_mib(m['peak_on_rank_spread_bytes'])} ON, {_mib(m['peak_off_rank_spread_bytes'])} "
            "OFF: buffers a communication thread held past its collective (their shapes are "
            "static); the table takes the lower median.",
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
