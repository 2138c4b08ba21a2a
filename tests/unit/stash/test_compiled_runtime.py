"""The paged stash under torch.compile at run time: recompiles, a rerun, what the graphs hold,
the tickets, and the steps that page nothing saying why (compiled and eager)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

from te_paged.markers import MarkerKind, mark_grouped_tensor
from te_paged.moe import TEGroupedMLP
from te_paged.runtime import PagedStashRunner
from te_paged.stash import PagedStashManager, StashMode

from ..moe.harness import EXPERTS, ROWS, step_inputs
from ..runtime.test_runner import grads, make, step_fn
from .test_compiled import _config, assert_bitwise

BACKEND = "aot_eager"


def _stack(paged: bool, layers: int = 2, **kw):
    cfg = _config(paged, **kw)
    torch.manual_seed(0)
    manager = PagedStashManager.from_config(cfg) if paged else None
    mlps = [TEGroupedMLP(EXPERTS, cfg, manager=manager, layer_number=i + 1) for i in range(layers)]
    return cfg, manager, mlps


def _step(cfg, manager, forward, step: int, around=None):
    if manager is not None:
        manager.reset()
    x, tokens, probs = step_inputs(cfg, step)
    x = x.detach().to(cfg.params_dtype).requires_grad_()
    if around is None:
        out = forward(x, tokens, probs)
    else:
        with around():
            out = forward(x, tokens, probs)
    out.float().square().sum().backward()
    return x.grad


# ----------------------------------------------------------------------------- recompiles


def test_layers_compiled_one_by_one_share_one_graph_and_keep_their_numbers() -> None:
    """torchtitan compiles each block on its own (one code object): the layer number is read
    when the scope opens (a StashSite), not traced, so four layers make one graph."""
    cfg, manager, mlps = _stack(True, layers=4)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(BACKEND)
    for mlp in mlps:
        mlp.compile(backend=counter, fullgraph=True)
    for step in range(3):
        manager.reset()
        x, tokens, probs = step_inputs(cfg, step)
        h = x.to(cfg.params_dtype).requires_grad_()
        for mlp in mlps:
            h, _ = mlp(h, tokens, probs)
        h.float().sum().backward()
        assert [layer for layer, _, _ in manager._step_counts] == [1, 2, 3, 4]
    assert counter.frame_count == 1
    assert manager.stats().stashes == 4 * 4  # x, the activation's two, FC2's input: a layer


def _compiled_experts(model, counter):
    for layer in model:
        layer.experts.compile(backend=counter, fullgraph=True)


def test_a_rerun_compiles_once_and_equals_a_run_that_never_overflowed() -> None:
    """fp32 (te_paged::grouped_mm: torch's fake kernel takes bf16 only). The capture step and
    the paged steps share a graph, the dropless rerun (stash off: a guard) compiles one more,
    and nothing compiles after."""
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(BACKEND)
    _compiled_experts(model, counter)
    runner = PagedStashRunner(model, manager, grow_pool=False)
    runner.step(step_fn(model, 0))  # capture
    frames = counter.frame_count
    model.zero_grad()
    _, rec = runner.step(step_fn(model, 1))
    assert rec.stash_overflow_ranks == 1, (
        "the overflow flag the stash kernel set was lost: did a compiled graph write the "
        "manager's flags back over it?"
    )
    assert rec.attempt == 2 and not rec.enabled
    # Each graph once more, with no stash ops (two graphs: the first layer's input needs no
    # gradient); the rerun's memory measured without a dispatch-mode tracker.
    assert frames == 2 and counter.frame_count == 2 * frames
    assert rec.fallback_peak_bytes > 0 and "profiler" in rec.fallback_memory_method
    rerun_grads = grads(model)

    reference, ref_manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    _compiled_experts(reference, CompileCounterWithBackend(BACKEND))
    with ref_manager.disabled():
        step_fn(reference, 1)()
    assert all(torch.equal(a, b) for a, b in zip(rerun_grads, grads(reference)))

    frames = counter.frame_count
    runner.grow_pool = True  # step 2 overflows again, grows the pools and reruns; then paged
    records = []
    for step in range(2, 5):
        model.zero_grad()
        records.append(runner.step(step_fn(model, step))[1])
    assert [r.attempt for r in records] == [2, 1, 1] and records[0].pool_growth
    assert counter.frame_count == frames  # a grown pool is no graph input: nothing compiles
    assert manager.mode is StashMode.CAPTURED and manager.stats().stashes > 0


def _compiled_function(model, fullgraph: bool):
    def forward(h, tokens, probs):
        for layer in model:
            h = layer.experts(h, tokens, probs)[0]
        return h

    return torch.compile(forward, backend=BACKEND, fullgraph=fullgraph)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks"])
def test_a_compiled_function_is_found_by_its_traced_scopes_and_reruns_exactly(fullgraph) -> None:
    """The usual train-step style: ``torch.compile`` of a function that calls the layers, no
    module compiled. The manager's traced scopes are the evidence; the rerun after a forced
    overflow runs without a dispatch-mode tracker (under one, Dynamo raises in fullgraph code
    and silently runs eager otherwise) and equals a run that never overflowed."""
    cfg = {"moe_paged_stash_buffer_size_factor_cuda": 0.2}
    model, manager = make(cfg)
    torch._dynamo.reset()
    forward = _compiled_function(model, fullgraph)
    runner = PagedStashRunner(model, manager, grow_pool=False)
    assert not runner.compiled()  # before a step: no module of the model is compiled
    runner.step(step_fn(model, 0, forward))  # capture
    assert manager.traced_scopes == 2, "the compiled graph's scopes were not counted as traced"
    model.zero_grad()
    try:
        _, rec = runner.step(step_fn(model, 1, forward))
    except RuntimeError as e:  # what Dynamo raises in fullgraph code under a dispatch mode
        pytest.fail(f"the rerun of a compiled step ran under a dispatch-mode tracker: {e}"[:600])
    assert rec.stash_overflow_ranks == 1 and rec.attempt == 2 and not rec.enabled
    assert runner.compiled(), "a step whose scopes a compiled graph opened was not compiled"
    assert "profiler" in rec.fallback_memory_method, (
        "the rerun of a compiled step was measured under a dispatch-mode tracker "
        f"({rec.fallback_memory_method!r})"
    )
    reference, ref_manager = make(cfg)
    with ref_manager.disabled():
        step_fn(reference, 1, _compiled_function(reference, fullgraph))()
    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(reference)))


# ----------------------------------------------------------------------- what the graphs hold


def test_the_graphs_hold_te_pageds_ops_and_no_host_read() -> None:
    graphs = {}

    def keep(name):
        def compiler(gm, example_inputs):
            graphs.setdefault(name, gm.code)
            return gm

        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    cfg, manager, mlps = _stack(True)

    def forward(h, tokens, probs):
        for mlp in mlps:
            h, _ = mlp(h, tokens, probs)
        return h

    torch._dynamo.reset()
    compiled = torch.compile(forward, backend=backend, fullgraph=True)
    for step in range(2):
        _step(cfg, manager, compiled, step)
    fw, bw = graphs["forward"], graphs["backward"]
    for op in ("scope_enter", "save", "flag_add"):
        assert fw.count(f"te_paged.{op}.default") >= 2, op  # one per layer at least
    assert fw.count("te_paged.save.default") == manager.stats().stashes
    assert bw.count("te_paged.load.default") == manager.stats().pops
    for read in ("_local_scalar_dense", "aten.item", "nonzero", "tolist"):
        assert read not in fw and read not in bw, read


# ----------------------------------------------------------------------------------- tickets


def _open(manager, rows=ROWS) -> int:
    return manager._open_traced_scope(rows, torch.tensor([ROWS // 2]), ROWS // 2, None, True)


def test_a_traced_save_refers_to_nothing_the_graph_may_reuse() -> None:
    """Inductor hands a dead buffer's storage to a later tensor without a free or a version
    bump: a traced save must neither deduplicate by storage (the later tensor wears the same
    address) nor keep the tensor itself (kept unpaged: a copy)."""
    manager = PagedStashManager(page_size=8)  # skip_immediate_backward: the scope is kept
    x = torch.randn(ROWS, 16)
    view = x.view_as(x)
    tid = manager._save_ticket(view, MarkerKind.TOKEN_ROWS, _open(manager))
    manager._load_ticket(tid, (ROWS, 16), torch.float32)  # popped first: an immediate scope
    manager.reset()  # the capture step learnt it; the paged step keeps it
    sid = _open(manager)
    t1 = manager._save_ticket(view, MarkerKind.TOKEN_ROWS, sid)
    t2 = manager._save_ticket(view, MarkerKind.TOKEN_ROWS, sid)  # the same bytes: two handles
    assert manager.stats().stashes_skipped == 2
    x.fill_(3.0)  # the graph writes into the buffer it handed over
    a = manager._load_ticket(t1, (ROWS, 16), torch.float32)
    b = manager._load_ticket(t2, (ROWS, 16), torch.float32)
    assert not torch.equal(a, x) and torch.equal(a, b)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="loaded twice"):
        manager._load_ticket(t1, (ROWS, 16), torch.float32)


def test_a_load_hands_out_memory_no_other_tensor_shares() -> None:
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    x = torch.randn(ROWS, 16)
    for _ in range(2):  # capture, then paged
        manager.reset()
        tid = manager._save_ticket(x.view_as(x), MarkerKind.TOKEN_ROWS, _open(manager))
        out = manager._load_ticket(tid, (ROWS, 16), torch.float32)
        assert torch.equal(out[: ROWS // 2], x[: ROWS // 2]) and not out[ROWS // 2 :].any()
        assert torch._C._storage_Use_Count(out.untyped_storage()._cdata) <= 3  # no clone
    keep = out[:4]  # another tensor on the reload's storage: the next load of it is a copy
    assert not te_exclusive(out)
    del keep


def te_exclusive(t):
    from te_paged.stash.packing import _exclusive

    return _exclusive(t)


def test_a_ticket_saved_into_a_scope_that_is_gone_or_loaded_after_reset_is_refused() -> None:
    manager = PagedStashManager(page_size=8)
    with pytest.raises(RuntimeError, match="which is gone"):
        manager._save_ticket(torch.randn(ROWS, 4), MarkerKind.TOKEN_ROWS, 7)
    with pytest.raises(RuntimeError, match="no paged-stash scope was open"):
        manager._save_ticket(torch.randn(ROWS, 4), MarkerKind.TOKEN_ROWS, None)
    tid = manager._save_ticket(torch.randn(ROWS, 4), MarkerKind.TOKEN_ROWS, _open(manager))
    manager.reset()
    with pytest.raises(RuntimeError, match="reset\\(\\) or release\\(\\) ran between"):
        manager._load_ticket(tid, (ROWS, 4), torch.float32)


# ------------------------------------------------------------------------------ never silent


def _compiled_stack(paged: bool):
    cfg, manager, mlps = _stack(paged)

    def forward(h, tokens, probs):
        for mlp in mlps:
            h, _ = mlp(h, tokens, probs)
        return h

    torch._dynamo.reset()
    return cfg, manager, torch.compile(forward, backend=BACKEND, fullgraph=True)


@pytest.mark.parametrize("outer", ["save_on_cpu", "checkpoint"])
def test_an_outer_hooks_context_owns_the_compiled_saves_and_the_step_says_so(outer, caplog):
    """Under save_on_cpu (or a non-reentrant checkpoint around the compiled model) the outer
    context gets what the layers saved, as in eager; the step pages nothing and says why."""
    results = {}
    for paged in (True, False):
        cfg, manager, compiled = _compiled_stack(paged)
        if outer == "checkpoint":

            def forward(x, t, p, compiled=compiled):
                return torch.utils.checkpoint.checkpoint(compiled, x, t, p, use_reentrant=False)

            around = None
        else:
            forward, around = compiled, torch.autograd.graph.save_on_cpu
        with caplog.at_level(logging.WARNING, logger="te_paged.stash.manager"):
            results[paged] = [[_step(cfg, manager, forward, s, around)] for s in range(3)]
        if paged:
            assert "outer saved_tensors_hooks context" in manager.paged_nothing()
            assert manager.stats().stashes == 0
    assert_bitwise(results[True], results[False])
    said = [r for r in caplog.records if "paged nothing" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING  # once per manager


def test_a_compiled_region_whose_marks_no_te_paged_function_saves_is_named() -> None:
    """A marked tensor a plain op saves inside compiled code: the compiler, not the marked
    object, decides what is saved; te_paged's scope (eager here) pages nothing, and says that
    torch.compile is the likely cause."""
    manager = PagedStashManager(page_size=8)
    w = torch.randn(16, 16, requires_grad=True)

    @torch.compile(backend=BACKEND, fullgraph=True)
    def layer(x):
        x = x.view_as(x)
        mark_grouped_tensor(x)
        return (x @ w).relu()

    for _ in range(2):
        manager.reset()
        with manager.scope(ROWS, torch.tensor([ROWS]), ROWS):
            layer(torch.randn(ROWS, 16)).sum().backward()
    cause = manager.paged_nothing()
    assert "none marked" in cause and "torch.compile ran" in cause


def test_an_eager_step_whose_producers_mark_nothing_is_named(monkeypatch) -> None:
    monkeypatch.setattr("te_paged.stash.manager.compile_used", lambda: False)
    manager = PagedStashManager(page_size=8)
    lin = nn.Linear(16, 16)
    with manager.scope(ROWS, torch.tensor([ROWS]), ROWS):
        lin(torch.randn(ROWS, 16)).sum().backward()
    assert "producers marked nothing" in manager.paged_nothing()


def test_a_step_that_pages_says_nothing_and_the_record_carries_the_cause(caplog) -> None:
    model, manager = make()
    runner = PagedStashRunner(model, manager)
    with caplog.at_level(logging.WARNING, logger="te_paged.stash.manager"):
        _, rec = runner.step(step_fn(model, 0))
        assert rec.paged_nothing is None
        with torch.autograd.graph.save_on_cpu():
            _, rec = runner.step(step_fn(model, 1))
    assert "outer saved_tensors_hooks" in rec.paged_nothing
    assert '"paged_nothing": "an outer' in rec.to_json()
    assert sum("paged nothing" in r.getMessage() for r in caplog.records) == 1
    model.zero_grad()
    _, rec = runner.step(step_fn(model, 2))
    assert rec.paged_nothing is None


# --------------------------------------------------- GroupedLinear on its own, scope inside or out


def _linear_run(where: str, paged: bool) -> tuple[list[torch.Tensor], object]:
    """Two steps of one bias-less GroupedLinear in bf16, compiled with the scope inside the
    compiled function (``traced``) or opened eagerly around it (``eager``)."""
    from te_paged.grouped import GroupedLinear

    torch.manual_seed(0)
    linear = GroupedLinear(4, 32, 48, bias=False, params_dtype=torch.bfloat16)
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False) if paged else None
    splits = torch.tensor([5, 0, 17, 9])
    n = splits.sum().reshape(1)

    def traced(x):
        if manager is None:
            return linear(x, splits)
        with manager.scope(ROWS, n, ROWS // 2):
            return linear(x, splits)

    torch._dynamo.reset()
    compiled = torch.compile(traced if where == "traced" else linear, backend=BACKEND,
                             fullgraph=True)  # fmt: skip
    out = []
    for step in range(2):
        if manager is not None:
            manager.reset()
        x = torch.randn(ROWS, 32, generator=torch.Generator().manual_seed(step))
        x = x.bfloat16().requires_grad_()
        if where == "traced" or manager is None:
            y = compiled(x) if where == "traced" else compiled(x, splits)
        else:
            with manager.scope(ROWS, n, ROWS // 2):
                y = compiled(x, splits)
        y.float().square().sum().backward()
        out.append([y.detach(), x.grad, linear.weight0.grad.clone()])
        linear.zero_grad(set_to_none=True)
    return out, manager


@pytest.mark.parametrize("where", ["traced", "eager"])
def test_grouped_linear_compiled_pages_its_input_with_the_scope_inside_or_around(where) -> None:
    """The device-initiated GroupedLinear on its own: its saved input paged whether the scope
    opens inside the compiled function or eagerly around it (the compiled function was traced
    inside that scope: it pages into it)."""
    on, manager = _linear_run(where, True)
    off, _ = _linear_run(where, False)
    assert_bitwise(on, off)
    stats = manager.stats()
    assert stats.mode is StashMode.CAPTURED and (stats.stashes, stats.pops) == (1, 1)
