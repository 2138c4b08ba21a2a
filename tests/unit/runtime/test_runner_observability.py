"""What the runner logs (level and facts) and which NVTX ranges it opens."""

from __future__ import annotations

import contextlib
import logging
import sys
import types

import pytest
import torch.distributed as dist

from te_paged import telemetry
from te_paged.runtime import FallbackLimitError, PagedStashRunner

from .test_runner import capture_at_factor, make, step_fn

RUNNER = "te_paged.runtime.runner"


def _records(caplog, name: str = RUNNER, level: int | None = None) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name and (level is None or r.levelno == level)]


@pytest.fixture
def logs(caplog):
    caplog.set_level(logging.DEBUG, logger="te_paged")
    return caplog


def test_normal_steps_log_nothing_at_warning(logs) -> None:
    model, manager = make()
    runner = PagedStashRunner(model, manager)
    for step in range(3):  # capture, then paged steps within budget and pool
        _, rec = runner.step(step_fn(model, step))
        assert rec.attempt == 1
    assert [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING] == []
    assert _records(logs) == []  # the runner itself has nothing to say
    # ...but the pool sizing after the capture step is there at INFO
    (sizing,) = _records(logs, "te_paged.stash.manager", logging.INFO)
    assert "pools sized from the capture step" in sizing.getMessage()


def test_stash_overflow_is_a_warning_with_ranks_and_factor_before_the_rerun(logs) -> None:
    warned_before_rerun = []
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    runner = PagedStashRunner(
        model,
        manager,
        grow_pool=False,
        before_rerun=lambda: warned_before_rerun.append(len(_records(logs, level=logging.WARNING))),
    )
    runner.step(step_fn(model, 0))
    _, rec = runner.step(step_fn(model, 1))
    assert rec.attempt == 2
    (warning,) = _records(logs, level=logging.WARNING)
    message = warning.getMessage()
    assert "step 1 reruns dropless without the paged stash (1 rank(s): stash overflow on " \
        "rank(s) [0])" in message  # fmt: skip
    factor = rec.suggested_buffer_size_factor_cuda
    assert f"moe_paged_stash_buffer_size_factor_cuda >= {factor}" in message
    assert "Fallback 1 of 3 allowed in a row before FallbackLimitError" in message
    assert warned_before_rerun == [1]  # said before the rerun, which could run out of memory
    # the next step reallocates the pool freed for the rerun: INFO, not WARNING
    logs.clear()
    runner.step(step_fn(model, 2))
    (realloc,) = _records(logs, "te_paged.stash.manager", logging.INFO)
    assert "reallocated after release()" in realloc.getMessage()


def test_over_budget_warning_names_the_budget_and_the_capacity_factor(logs) -> None:
    model, manager = make()
    runner = PagedStashRunner(model, manager)
    model[1].dispatcher.force_over_budget = True
    _, rec = runner.step(step_fn(model, 0))
    (warning,) = _records(logs, level=logging.WARNING)
    message = warning.getMessage()
    assert "over the token budget on rank(s) [0] (peak 30 tokens routed to a rank, budget 64)" \
        in message  # fmt: skip
    assert f"moe_expert_rank_capacity_factor >= {rec.suggested_capacity_factor}" in message
    assert "stash overflow" not in message


def test_host_spill_is_info_with_the_ranks_and_the_factor_that_fits(logs) -> None:
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2,
                           "moe_paged_stash_buffer_size_factor_cpu": 2.0})  # fmt: skip
    runner = PagedStashRunner(model, manager, grow_pool=False)
    runner.step(step_fn(model, 0))
    _, rec = runner.step(step_fn(model, 1))
    assert rec.host_spill_ranks == 1 and rec.attempt == 1
    assert [r for r in logs.records if r.levelno >= logging.WARNING] == []
    (info,) = _records(logs, level=logging.INFO)
    message = info.getMessage()
    assert "step 1: rank(s) [0] of 1 stashed tensors in the host tier" in message
    # 29 peak tokens over 32 balanced, with 5 % margin: 0.96 (the 0.2 pool was far too small)
    assert "moe_paged_stash_buffer_size_factor_cuda >= 0.96 would keep them" in message


def test_a_pool_growth_after_an_overflow_is_said_by_the_rerun_warning_with_its_pages(logs) -> None:
    # One line per event: the rerun's warning says what the pools become, with the figures of
    # the record; no second line at INFO repeats it.
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    runner = PagedStashRunner(model, manager)
    capture_at_factor(runner, model)
    _, rec = runner.step(step_fn(model, 1))
    assert not [r for r in _records(logs, level=logging.INFO) if "pools grow" in r.getMessage()]
    assert rec.pool_growth
    (warning,) = _records(logs, level=logging.WARNING)
    assert "the pools grow to this step's need x grow_headroom 1.1" in warning.getMessage()
    for key, growth in rec.pool_growth.items():
        pages = f"{key} {growth['from']} -> {growth['to']} pages (needed {growth['needed']})"
        assert pages in warning.getMessage()


def test_guard_trip_is_reported_by_its_exception_only(logs) -> None:
    model, manager = make()
    runner = PagedStashRunner(model, manager, max_consecutive_fallbacks=2)
    model[0].dispatcher.force_over_budget = True
    for _ in range(2):
        runner.step(step_fn(model, runner.step_index))
    messages = [r.getMessage() for r in _records(logs, level=logging.WARNING)]
    assert ["Fallback 1 of 2" in messages[0], "Fallback 2 of 2" in messages[1]] == [True, True]
    logs.clear()
    with pytest.raises(FallbackLimitError, match="2 consecutive steps"):
        runner.step(step_fn(model, 2))
    assert [r for r in logs.records if r.name == RUNNER] == []  # no double report


def test_other_ranks_log_the_same_event_at_debug(logs, monkeypatch) -> None:
    # This process plays rank 1 of 2; the reduction is a no-op, so rank 0's slot stays zero
    # (step 0, no flags) and only rank 1 is over budget.
    class Done:
        def wait(self, timeout=None) -> None:
            pass

    model, manager = make()
    runner = PagedStashRunner(model, manager)
    monkeypatch.setattr(PagedStashRunner, "_world", lambda self: (1, 2))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: Done())
    model[0].dispatcher.force_over_budget = True
    _, rec = runner.step(step_fn(model, 0))
    assert rec.overbudget_ranks == 1 and rec.attempt == 2
    assert [r for r in logs.records if r.levelno >= logging.WARNING] == []
    (debug,) = [r for r in _records(logs, level=logging.DEBUG) if "reruns" in r.getMessage()]
    assert "(2 rank(s): over the token budget on rank(s) [1] " in debug.getMessage()


@pytest.fixture
def nvtx_names(monkeypatch):
    """The names of the NVTX ranges opened, in order (the nvtx package patched in)."""
    seen: list[str] = []

    @contextlib.contextmanager
    def annotate(name, domain):
        assert domain == "te_paged"
        seen.append(name)
        yield

    monkeypatch.setitem(sys.modules, "nvtx", types.SimpleNamespace(annotate=annotate))
    monkeypatch.setattr(telemetry.importlib.util, "find_spec", lambda name: object())
    telemetry._nvtx.cache_clear()
    yield seen
    telemetry._nvtx.cache_clear()


def test_runner_marks_the_reduction_every_step_and_the_rerun_and_allocation(nvtx_names) -> None:
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    for i, layer in enumerate(model):
        layer.experts.set_layer_number(i + 1)
    runner = PagedStashRunner(model, manager)
    steps = []
    for step in range(3):  # capture; overflow and rerun; the grown pool allocated, no rerun
        start = len(nvtx_names)
        if step == 0:
            capture_at_factor(runner, model)
        else:
            runner.step(step_fn(model, step))
        per_layer = ("te_paged.stash", "te_paged.pop")
        steps.append([n for n in nvtx_names[start:] if not n.startswith(per_layer)])
    assert steps == [
        ["te_paged.reduce"],
        ["te_paged.allocate", "te_paged.reduce", "te_paged.rerun"],
        ["te_paged.allocate", "te_paged.reduce"],
    ]
    # per-layer stash and pop ranges carry the experts' layer numbers
    assert {"te_paged.stash.layer1", "te_paged.stash.layer2"} <= set(nvtx_names)
    assert {"te_paged.pop.layer1", "te_paged.pop.layer2"} <= set(nvtx_names)
    assert "te_paged.stash" not in nvtx_names
