"""``te-paged ab``: the same model and data with paged stash ON and OFF, on every rank.

Per step it records loss and gradient norm of both runs (and whether they, and every single
gradient, are bitwise equal), the runner's record (attempt, enabled, flags); per run the peak
memory of each captured step, measured by torch's trackers (the ON figure includes the pool,
allocated at the step boundary), and the capacity model's prediction ``(cf − bf) × S`` with ``S``
the balanced-case bytes of the paged tensors. :func:`run_ab` runs on one rank (inside a process
group or not); :func:`gather` collects every rank's result on each rank; :func:`format_table`
renders it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from te_paged.runtime.memory import (
    PeakMemoryMeter,
    capacity_model_saving,
    reload_adjusted_saving,
)
from te_paged.runtime.planner import RoutingProfile
from te_paged.runtime.runner import PagedStashRunner
from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

__all__ = ["ABResult", "RankResult", "format_table", "gather", "run_ab"]


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
    record: dict


@dataclasses.dataclass
class RankResult:
    rank: int
    on: list[StepResult]
    off: list[StepResult]
    grads_equal: list[bool]  # per step: every gradient of this rank bitwise equal
    pool_bytes: int
    host_pool_bytes: int
    s_bytes: int  # balanced-case bytes of the paged tensors
    stashes: int
    pops: int
    memory_method: str
    timeline: list[dict]
    routing: RoutingProfile | None = None  # the OFF run's, recorded by its runner
    #: The step the memory table reports (pool and S are this step's); None: no step after
    #: the capture step kept paged stash (each was rerun without it), so nothing to report.
    memory_step: int | None = -1


@dataclasses.dataclass
class ABResult:
    config: dict
    world_size: int
    ranks: list[RankResult]

    @property
    def equal(self) -> bool:
        return all(
            all(r.grads_equal)
            and all(a.loss == b.loss and a.grad_norm == b.grad_norm for a, b in zip(r.on, r.off))
            for r in self.ranks
        )

    def memory(self) -> dict[str, float] | None:
        """Max over ranks of the reported step's peak (by default the last, a captured one),
        and the capacity model; None when no step kept paged stash."""
        if any(r.memory_step is None for r in self.ranks):
            return None
        on = max(r.on[r.memory_step].peak_bytes + r.pool_bytes for r in self.ranks)
        off = max(r.off[r.memory_step].peak_bytes for r in self.ranks)
        s = max(r.s_bytes for r in self.ranks)
        cfg = self.config
        cf, bf = cfg["capacity_factor"], cfg["buffer_factor_cuda"]
        predicted = capacity_model_saving(cf, bf, s)
        adjusted = reload_adjusted_saving(cf, bf, s, cfg["layers"])
        saving = off - on
        return {
            "peak_on_bytes": on,
            "peak_off_bytes": off,
            "pool_bytes": max(r.pool_bytes for r in self.ranks),
            "S_bytes": s,
            "saving_bytes": saving,
            "predicted_saving_bytes": predicted,
            "measured_over_predicted": saving / predicted if predicted else math.nan,
            "reload_adjusted_saving_bytes": adjusted,
            "measured_over_reload_adjusted": saving / adjusted if adjusted > 0 else math.nan,
        }


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
) -> tuple[list[StepResult], list[list[torch.Tensor]], ToyMoEModel, PagedStashRunner]:
    model = ToyMoEModel(cfg, paged=paged, group=group, device=device, record_timeline=timeline)
    if cfg.skew and rank == 0:
        for layer in model.layers:
            layer.router.set_skew([0], cfg.skew)
    runner = PagedStashRunner(
        model,
        model.manager,
        group=group,
        measure_fallback_memory=False,
        record_routing=record_routing,  # a host read and a collective per step: OFF run only
    )
    steps, grads = [], []
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
        with PeakMemoryMeter(device) as meter:
            runner.before_rerun = meter.new_iteration
            loss, record = runner.step(step_fn)
        mem = meter.report
        grads.append(_grad_vector(model))
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads[-1]]))
        steps.append(
            StepResult(
                float(loss),
                float(norm),
                record.attempt,
                record.enabled,
                record.stash_overflow_ranks,
                record.overbudget_ranks,
                record.host_spill_ranks,
                mem.peak_bytes,
                dataclasses.asdict(record),
            )
        )
        if progress is not None:
            progress(f"{'ON ' if paged else 'OFF'} step {step + 1}/{cfg.steps}")
    steps[-1].record["memory_method"] = mem.method
    return steps, grads, model, runner


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
    off, off_grads, _, off_runner = _run(
        cfg, False, group, device, rank, progress, False, record_routing
    )
    on, on_grads, model, _ = _run(cfg, True, group, device, rank, progress, rank == 0)
    equal = [
        len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        for a, b in zip(on_grads, off_grads)
    ]
    stats = model.manager.stats()
    s_bytes = 0
    for key, buf in model.manager.buffers.items():
        rows = stats.capture_peak_balanced_rows[str(key)]
        s_bytes += rows * key.hidden * buf.pool_NH.element_size()
    timeline = [dataclasses.asdict(e) for e in (model.manager.timeline or [])]
    return RankResult(
        rank,
        on,
        off,
        equal,
        stats.pool_bytes,
        stats.host_pool_bytes,
        s_bytes,
        stats.stashes,
        stats.pops,
        on[-1].record["memory_method"],
        timeline,
        off_runner.routing_profile() if record_routing else None,
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


def format_table(result: ABResult) -> str:
    """A reviewer's table: per step ON/OFF loss and grad norm, attempts and flags; memory."""
    r0 = result.ranks[0]
    rows = [
        "| step | loss ON | loss OFF | grad norm ON | grad norm OFF | bitwise equal | attempt "
        "| enabled | overflow ranks | over-budget ranks | host-spill ranks |",
        "| ---: | ---: | ---: | ---: | ---: | :---: | ---: | :---: | ---: | ---: | ---: |",
    ]
    for i, (a, b) in enumerate(zip(r0.on, r0.off)):
        eq = all(r.grads_equal[i] and r.on[i].loss == r.off[i].loss for r in result.ranks)
        rows.append(
            f"| {i} | {a.loss:.6f} | {b.loss:.6f} | {a.grad_norm:.6f} | {b.grad_norm:.6f} "
            f"| {'yes' if eq else 'NO'} | {a.attempt} | {a.enabled} | {a.stash_overflow_ranks} "
            f"| {a.overbudget_ranks} | {a.host_spill_ranks} |"
        )
    m = result.memory()
    cfg = result.config
    if m is None:
        rows += [
            "",
            "Memory: every step after the capture step was rerun without paged stash, so no "
            "step shows its saving (raise the factors the runner suggests, or run more steps).",
            "",
        ]
    else:
        step = r0.memory_step if r0.memory_step >= 0 else len(r0.on) + r0.memory_step
        which = (
            "last step" if step == len(r0.on) - 1 else f"step {step}, the last that kept the stash"
        )
        rows += [
            "",
            f"Memory, {which}, max over {result.world_size} rank(s) ({r0.memory_method}):",
            "",
            "| peak ON (incl. pool) | peak OFF | pool | saving | predicted (cf − bf) × S "
            "| measured / predicted | less one layer's reload (cf − bf − cf/L) × S "
            "| measured / that |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {_mib(m['peak_on_bytes'])} | {_mib(m['peak_off_bytes'])} "
            f"| {_mib(m['pool_bytes'])} | {_mib(m['saving_bytes'])} "
            f"| {_mib(m['predicted_saving_bytes'])} "
            f"(cf {cfg['capacity_factor']}, bf {cfg['buffer_factor_cuda']}, "
            f"S {_mib(m['S_bytes'])}) "
            f"| {100 * m['measured_over_predicted']:.1f} % "
            f"| {_mib(m['reload_adjusted_saving_bytes'])} (L {cfg['layers']}) "
            f"| {100 * m['measured_over_reload_adjusted']:.1f} % |",
            "",
        ]
    rows += [
        f"stashes/pops (rank 0, last step): {r0.stashes}/{r0.pops}; "
        f"ON and OFF {'bitwise equal' if result.equal else 'DIFFER'}.",
    ]
    return "\n".join(rows)
