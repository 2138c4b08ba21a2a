"""``MoELayer`` expert-parallel over 2 gloo ranks under torch.compile (``fullgraph=True``, each
layer compiled on its own as torchtitan compiles its blocks): compiled ON equals compiled OFF
bitwise on every rank, the stash pages what eager pages, the all-to-all bytes counted as in
eager, and one graph for every layer and step."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from te_paged.config import MoEConfig
from te_paged.moe import MoELayer
from te_paged.stash import PagedStashManager

from .spawn import run_ranks

WORLD, LAYERS, STEPS, N = 2, 2, 3, 24
pytestmark = pytest.mark.timeout(240)


def _config(paged: bool) -> MoEConfig:
    return MoEConfig(
        hidden_size=32, moe_ffn_hidden_size=64, num_moe_experts=4, moe_router_topk=2,
        moe_expert_rank_capacity_factor=2.0, moe_a2a_capacity_factor=2.0,
        expert_model_parallel_size=WORLD, moe_paged_stash=paged, moe_paged_stash_page_size=8,
        params_dtype=torch.bfloat16, moe_use_grouped_tensor=True,
    )  # fmt: skip


def _run(rank: int, paged: bool, compiled: bool) -> dict:
    from torch._dynamo.testing import CompileCounterWithBackend

    cfg = _config(paged)
    manager = PagedStashManager.from_config(cfg) if paged else None
    layers = [MoELayer(cfg, dist.group.WORLD, manager, seed=1, layer_number=i + 1)
              for i in range(LAYERS)]  # fmt: skip
    counter = None
    if compiled:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        for layer in layers:
            layer.compile(backend=counter, fullgraph=True)
    results, paging = [], []
    for step in range(STEPS):
        if manager is not None:
            manager.reset()
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(N, 32, generator=g).to(cfg.params_dtype).requires_grad_()
        h = x
        for layer in layers:
            h, _ = layer(h)
        h.float().square().sum().backward()
        results.append([h.detach(), x.grad] + [p.grad for m in layers for p in m.parameters()])
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        if manager is not None:
            s = manager.stats()
            paging.append((s.stashes, s.pops, s.stashes_skipped, s.pool_pages))
    return {
        "results": results,
        "paging": paging,
        "bytes": [layer.dispatcher.bytes_sent for layer in layers],
        "frames": None if counter is None else counter.frame_count,
    }


def _worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=(Path(out_dir) / "store").as_uri(), rank=rank,
        world_size=WORLD, timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        res = {
            "on": _run(rank, True, True),
            "off": _run(rank, False, True),
            "eager": _run(rank, True, False),
        }
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(__name__, _worker, tmp_path_factory.mktemp("compiled_ep"), WORLD)


def test_compiled_ep_on_equals_off_and_pages_as_eager(ranks) -> None:
    for rank, r in enumerate(ranks):
        for step, (on, off) in enumerate(zip(r["on"]["results"], r["off"]["results"])):
            for i, (a, b) in enumerate(zip(on, off, strict=True)):
                assert torch.equal(a, b), f"rank {rank}, step {step}, tensor {i}: ON != OFF"
        assert r["on"]["paging"] == r["eager"]["paging"], f"rank {rank}"
        assert r["on"]["paging"][-1][0] > 0  # paged
        assert r["on"]["bytes"] == r["eager"]["bytes"] == r["off"]["bytes"]  # the wire counted
        assert r["on"]["frames"] == 1  # both layers, capture and paged steps: one graph
