"""A variable-length workload over 2 gloo ranks whose microbatches differ in size within a step
(each rank packs its own sequences): with ``moe_max_tokens_per_rank`` declared, te_paged's
dispatcher sizes its static buffers for it on every rank (blocks of one size, no collective to
agree) and the stash its pools from the capture step, so nothing reruns; ON equals OFF bitwise
on every rank and step; the records carry each rank's microbatches and the group's largest."""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from te_paged.runtime import PagedStashRunner
from te_paged.tools.engine_configs import ModelConfig
from te_paged.tools.model import ToyMoEModel, make_batch

from .spawn import run_ranks

WORLD = 2
CFG = ModelConfig(layers=2, experts=4, hidden=32, ffn=64, page_size=8, max_tokens_per_rank=64)
# Per step, each rank's microbatches (tokens per rank): two a step, their sizes differing
# between the ranks and the steps; the capture step is the smallest.
SCHEDULE = {
    0: ((16, 16), (32, 16), (16, 64), (64, 64), (8, 40)),
    1: ((16, 16), (16, 48), (64, 8), (40, 64), (64, 16)),
}
pytestmark = pytest.mark.timeout(240)


def _run(rank: int, paged: bool) -> list[dict]:
    torch.manual_seed(0)
    model = ToyMoEModel(CFG, paged=paged, group=dist.group.WORLD)
    runner = PagedStashRunner(model, model.manager, group=dist.group.WORLD,
                              measure_fallback_memory=False)  # fmt: skip
    steps = []
    for step, sizes in enumerate(SCHEDULE[rank]):
        batches = [make_batch(CFG, step, rank, tokens=n, microbatch=i) for i, n in enumerate(sizes)]
        model.zero_grad(set_to_none=False)

        def step_fn(batches=batches):
            losses = []
            for x, t in batches:
                losses.append(model(x, t))
                losses[-1].backward()
            return torch.stack([loss.detach() for loss in losses])

        loss, record = runner.step(step_fn)
        steps.append({
            "loss": loss, "grads": [p.grad.clone() for p in model.parameters()],
            "record": dataclasses.asdict(record),
        })  # fmt: skip
    return steps


def _worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=(Path(out_dir) / "store").as_uri(), rank=rank,
        world_size=WORLD, timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        res = {"on": _run(rank, True), "off": _run(rank, False)}
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(__name__, _worker, tmp_path_factory.mktemp("variable_length_ep"), WORLD)


def test_ranks_of_different_sizes_train_paged_bitwise_without_a_rerun(ranks) -> None:
    for rank, r in enumerate(ranks):
        for step, (on, off) in enumerate(zip(r["on"], r["off"], strict=True)):
            assert torch.equal(on["loss"], off["loss"]), f"rank {rank}, step {step}: loss"
            for i, (a, b) in enumerate(zip(on["grads"], off["grads"], strict=True)):
                assert torch.equal(a, b), f"rank {rank}, step {step}, gradient {i}: ON != OFF"
            record = on["record"]
            assert record["attempt"] == 1 and record["enabled"], (rank, step, record)
            assert record["microbatch_tokens"] == list(SCHEDULE[rank][step])
            largest = max(max(SCHEDULE[q][step]) for q in range(WORLD))
            assert record["max_microbatch_tokens"] == largest, (rank, step)
        assert r["on"][-1]["record"]["pool_pages"], "nothing paged"
        assert r["on"][-1]["record"]["pool_pages"] == ranks[0]["on"][-1]["record"]["pool_pages"]
