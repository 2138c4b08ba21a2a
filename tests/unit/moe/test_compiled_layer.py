"""``MoELayer`` with te_paged's dispatcher under torch.compile (one process; expert parallelism
in tests/distributed/test_compiled_ep.py): ON equals OFF bitwise, pages as eager, and the
runner's reruns (a stash overflow: the compiled graph with the stash off; over budget: dropless,
eagerly)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from te_paged.moe import MoELayer
from te_paged.runtime import PagedStashRunner
from te_paged.stash import PagedStashManager

from ..stash.test_compiled import _config, _paging, assert_bitwise

TOKENS, LAYERS = 32, 2


def _model(paged: bool, **kw):
    cfg = _config(paged, moe_router_topk=2, **kw)
    manager = PagedStashManager.from_config(cfg) if paged else None
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        MoELayer(cfg, None, manager, seed=1, layer_number=i + 1) for i in range(LAYERS)
    )
    return cfg, manager, layers


def _inputs(cfg, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(TOKENS, cfg.hidden_size, generator=g).to(cfg.params_dtype)


def _step_fn(layers, x, out):
    def fn():
        h, aux = x.clone().requires_grad_(), 0.0
        inp = h
        for layer in layers:
            h, a = layer(h)
            aux = aux + a
        (h.float().square().sum() + aux).backward()
        out.append([h.detach(), inp.grad] + [p.grad.clone() for p in layers.parameters()])

    return fn


def _run(paged: bool, backend: str | None, steps: int = 3, **kw):
    cfg, manager, layers = _model(paged, **kw)
    counter = None
    if backend is not None:
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        for layer in layers:
            layer.compile(backend=counter, fullgraph=True)
    results, stats = [], []
    for step in range(steps):
        if manager is not None:
            manager.reset()
        _step_fn(layers, _inputs(cfg, step), results)()
        layers.zero_grad(set_to_none=True)
        if manager is not None:
            stats.append(manager.stats())
    return results, stats, counter


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_moe_layer_compiles_bitwise_and_pages_as_eager(backend) -> None:
    on, on_stats, counter = _run(True, backend)
    off, _, _ = _run(False, backend)
    assert_bitwise(on, off)
    _, eager_stats, _ = _run(True, None)
    assert _paging(on_stats) == _paging(eager_stats) and on_stats[-1].stashes > 0
    assert counter.frame_count == 1  # the layers share one graph, capture and paged steps too


def _runner_steps(factor_kw, steps, skew=None, backend="aot_eager"):
    cfg, manager, layers = _model(True, **factor_kw)
    if skew is not None:
        for layer in layers:
            layer.router.set_skew(*skew)
    if backend is not None:
        torch._dynamo.reset()
        for layer in layers:
            layer.compile(backend=backend, fullgraph=True)
    runner = PagedStashRunner(layers, manager, grow_pool=False)
    results, records = [], []
    for step in range(steps):
        layers.zero_grad(set_to_none=True)
        records.append(runner.step(_step_fn(layers, _inputs(cfg, step), results))[1])
    return results, records, runner


def test_a_stash_overflow_reruns_the_compiled_graph_with_the_stash_off() -> None:
    """Nothing dropped: the rerun keeps the static budget, so it runs the very graph of a
    compiled run with the stash off (one compile) and equals it bit for bit."""
    small = {"moe_paged_stash_buffer_size_factor_cuda": 0.2}
    results, records, runner = _runner_steps(small, 2)
    assert runner.compiled()
    assert records[1].stash_overflow_ranks == 1 and records[1].attempt == 2
    assert not records[1].overbudget_ranks
    cfg, manager, layers = _model(True, **small)
    torch._dynamo.reset()
    for layer in layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    reference = []
    with manager.disabled():
        for step in range(2):
            layers.zero_grad(set_to_none=True)
            _step_fn(layers, _inputs(cfg, step), reference)()
    assert len(results) == 3  # step 0, step 1 and its rerun
    assert_bitwise(results[2:], reference[1:])


def test_an_over_budget_step_reruns_dropless_eagerly_and_equals_the_dropless_reference() -> None:
    """Dropless rows are data-dependent: the rerun runs eagerly (fullgraph could not trace the
    host read), and equals an eager dropless run."""
    tight = {"moe_expert_rank_capacity_factor": 0.75, "moe_a2a_capacity_factor": 0.75}
    results, records, _ = _runner_steps(tight, 2)
    assert [r.overbudget_ranks for r in records] == [1, 1] and records[1].attempt == 2
    cfg, manager, layers = _model(True, **tight)
    reference = []
    with manager.disabled():
        for layer in layers:
            layer.set_dropless(True)
        for step in range(2):
            layers.zero_grad(set_to_none=True)
            _step_fn(layers, _inputs(cfg, step), reference)()
    assert len(results) == 4  # each step and its rerun
    assert_bitwise(results[1::2], reference)
