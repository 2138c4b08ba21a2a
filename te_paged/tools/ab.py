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
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from te_paged.moe import StaticBudgetDispatcher
from te_paged.runtime.memory import PeakMemoryMeter
from te_paged.runtime.runner import PagedStashRunner, StepRecord
from te_paged.stash import PagedStashManager, StashMode
from te_paged.tools.ab_result import (
    NOT_MEASURED,
    ABResult,
    RankResult,
    StepResult,
    format_table,
    measured_step,
    measures,
    rank_result,
    step_label,
)
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


class StepMeter:
    """A step's memory as ``ab`` takes it: a :class:`PeakMemoryMeter` around the step when
    ``measure`` and :func:`measures` allow, else nothing (``peak_bytes`` 0, ``method`` None,
    ``new_iteration`` None: the runner's ``before_rerun`` when nothing is measured)."""

    def __init__(
        self,
        device: torch.device,
        step: int,
        capture: bool,
        measure: bool = True,
        compiled: bool = False,
        static: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        self._meter = None
        if measure and measures(step, capture):
            self._meter = PeakMemoryMeter(device, compiled=compiled, static=static)
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
    if cfg.compile is not None:  # each MoE block on its own, fullgraph: torchtitan's way
        torch._dynamo.reset()  # OFF's graphs are not ON's
        for layer in model.layers:
            layer.compile(backend=cfg.compile, fullgraph=True)
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
        max_tokens_per_rank=cfg.max_tokens_per_rank if paged else None,
    )
    steps, grads, method = [], [], NOT_MEASURED
    for step in range(cfg.steps):
        sizes = cfg.microbatches(step)
        batches = [
            make_batch(cfg, step, rank, device, tokens=n, microbatch=i) for i, n in enumerate(sizes)
        ]
        model.zero_grad(set_to_none=False)  # gradients stay allocated: not part of the peak

        def step_fn(batches: list = batches) -> torch.Tensor:
            # Each microbatch's forward and backward in turn, gradients accumulating: the mean
            # of their losses (one microbatch: the loss itself, as without a schedule).
            total = None
            for x, target in batches:
                loss = model(x, target)
                loss = loss / len(batches) if len(batches) > 1 else loss
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            return total

        if model.manager is not None:
            # The first reset after the capture step allocates the pool: do it outside the
            # measurement (the pool is added to ON's figure explicitly).
            model.manager.reset()
        managers = [] if model.manager is None else [model.manager]
        capture = capturing(managers)
        with StepMeter(device, step, capture, compiled=cfg.compile is not None) as meter:
            runner.before_rerun = meter.new_iteration
            loss, record = runner.step(step_fn)
        method = meter.method or method
        grads.append(_grad_vector(model))
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads[-1]]))
        steps.append(
            step_result(loss, norm, record, meter.peak_bytes, capture, managers, runner.dispatchers)
        )
        if cfg.token_schedule is not None and runner.capture_tokens:
            # S of this step's microbatches: the balanced rows scale with the tokens (the peak
            # is the largest microbatch's, each running its forward and backward in turn).
            scale = record.max_microbatch_tokens / runner.capture_tokens
            steps[-1].s_bytes = round(steps[-1].s_bytes * scale)
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


def gather(result: RankResult, cfg: ModelConfig, group: dist.ProcessGroup | None) -> ABResult:
    if group is None:
        return ABResult(dataclasses.asdict(cfg), 1, [result])
    world = dist.get_world_size(group)
    results: list[RankResult | None] = [None] * world
    dist.all_gather_object(results, result, group=group)
    return ABResult(dataclasses.asdict(cfg), world, list(results))
