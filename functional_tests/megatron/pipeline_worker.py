"""Worker of the pipeline-parallel functional test: ``run_cases`` on every rank.

Run by ``test_megatron_pipeline.py`` through ``launch_workers.py`` (4 CPU ranks, gloo):
Megatron-core's 1F1B schedule (``forward_backward_pipelining_without_interleaving``) and its
interleaved one (2 virtual stages per rank), each with pipeline parallelism 2 × expert
parallelism 2, 4 microbatches, dropout 0.1, te_paged's MoE spec with the static-budget
dispatcher, Megatron's DDP and Adam, driven by :class:`MegatronPagedStashRunner` — the model of
``functional_tests/megatron/train_worker.py`` cut into pipeline stages. Cases per schedule:

* ``parity``: paged stash ON vs OFF, 3 steps, every parameter after each optimizer step;
* ``over_budget``: rank 0 (stage 0) routes past a 1.5 capacity factor, so every step reruns
  (all microbatches, every stage) — vs a run that never goes over budget or overflows.

Each rank's results hold its stage, the runs' summaries, its pool and the
capture step's peak pages.
"""

from __future__ import annotations

from pathlib import Path

import torch

from functional_tests.megatron.train_worker import (
    NEVER_OVERFLOWS,
    PARITY,
    config,
    summary,
)

STEPS = 3
PIPELINE = {"layers": 4, "microbatches": 4, "steps": STEPS, "pipeline_parallel": 2}
SCHEDULES = {"1f1b": {}, "interleaved": {"virtual_stages": 2}}


def planned_pools(cfg) -> list[dict[str, int]]:
    """Each stage's pool as ``te-paged plan`` predicts it for this model and schedule."""
    from te_paged.runtime.planner import expert_mlp_saved_tensors, pipeline_pool_plan

    plan = pipeline_pool_plan(
        pipeline_parallel=cfg.pipeline_parallel,
        microbatches=cfg.microbatches,
        virtual_stages=cfg.virtual_stages,
        num_layers=cfg.layers,
        balanced_rows=cfg.tokens * cfg.topk,
        saved=expert_mlp_saved_tensors(cfg.hidden, cfg.ffn, itemsize=4),
        page_size=cfg.page_size,
        buffer_factor=cfg.buffer_factor_cuda,
        capacity_factor=cfg.capacity_factor,
    )
    return [s.pool_pages for s in plan]


def pools(run, cfg) -> dict:
    stats = run.managers[0].stats()
    record = run.steps[-1].record
    return {
        "planned_pool_pages": planned_pools(cfg),
        "pool_pages": stats.pool_pages,
        "capture_peak_balanced_pages": stats.capture_peak_balanced_pages,
        "pages_high_water": stats.pages_high_water,
        "stage_pool_high_water_pages": record["stage_pool_high_water_pages"],
    }


def run_cases(rank: int, world: int, out: Path) -> dict:
    from megatron.core import parallel_state

    from te_paged.tools.megatron_ab import megatron_parallel, train

    cpu, ep = torch.device("cpu"), 2
    results: dict = {}
    for name, schedule in SCHEDULES.items():
        kw = {**PIPELINE, **schedule}
        with megatron_parallel(ep, kw["pipeline_parallel"], kw.get("virtual_stages")):
            stage = parallel_state.get_pipeline_model_parallel_rank()
            cfg = config(**kw, **PARITY)
            off = train(cfg, False, ep, cpu, rank)
            on = train(cfg, True, ep, cpu, rank)
            case = {"stage": stage, "parity": summary(on, off), **pools(on, cfg)}
            skew = {"skew": 2.0}
            reference = train(config(**kw, **skew, **NEVER_OVERFLOWS), True, ep, cpu, rank)
            scenario = config(**kw, **skew, capacity_factor=1.5)
            case["reference_skewed"] = summary(reference)
            case["over_budget"] = summary(train(scenario, True, ep, cpu, rank), reference)
            results[name] = case
    return results
