"""Variable-length workloads under ``PagedStashRunner``: microbatches whose token counts change
from step to step (growing, shrinking, alternating, mixed within a step, in flight together as
under 1F1B) train paged after at most one rerun per new maximum, none with a declared
``max_tokens_per_rank``; bitwise to OFF every step; the runner's log and records say what the
pools became, and ``FallbackLimitError`` names what would have fitted."""

from __future__ import annotations

import functools
import logging

import pytest
import torch

from te_paged.config import MoEConfig
from te_paged.runtime import FallbackLimitError, PagedStashRunner
from te_paged.stash import PagedStashManager
from te_paged.tools.engine_configs import ModelConfig
from te_paged.tools.model import ToyMoEModel, make_batch

CFG = ModelConfig(layers=2, experts=4, hidden=32, ffn=64, page_size=8)


def _step_fn(model, batches, in_flight: bool):
    def step_fn():
        if in_flight:  # 1F1B's steady state on one stage: every forward, then the backwards
            losses = [model(x, t) for x, t in batches]
            for loss in losses:
                loss.backward()
        else:
            losses = []
            for x, t in batches:
                losses.append(model(x, t))
                losses[-1].backward()
        return torch.stack([loss.detach() for loss in losses]).sum()

    return step_fn


def _run(schedule, paged: bool, *, in_flight: bool = False, cfg: ModelConfig = CFG, **kw):
    torch.manual_seed(0)
    model = ToyMoEModel(cfg, paged=paged, group=None)
    runner = PagedStashRunner(model, model.manager, measure_fallback_memory=False,
                              **(kw if paged else {}))  # fmt: skip
    out = []
    for step, sizes in enumerate(schedule):
        batches = [make_batch(cfg, step, 0, tokens=n, microbatch=i) for i, n in enumerate(sizes)]
        model.zero_grad(set_to_none=False)
        loss, record = runner.step(_step_fn(model, batches, in_flight))
        grads = [p.grad.clone() for p in model.parameters()]
        out.append((loss, grads, record))
    return out, runner


@functools.cache
def _off(schedule, in_flight: bool = False):
    return _run(schedule, False, in_flight=in_flight)[0]


def _check_bitwise(on, schedule, in_flight: bool = False) -> None:
    for step, ((a, ga, _), (b, gb, _)) in enumerate(zip(on, _off(schedule, in_flight))):
        assert torch.equal(a, b), f"step {step}: loss ON {a} != OFF {b}"
        assert all(torch.equal(x, y) for x, y in zip(ga, gb)), f"step {step}: gradients differ"


def _reruns(on) -> list[int]:
    return [r.step for _, _, r in on if r.attempt == 2]


def _new_maxima(schedule, measure=max) -> list[int]:
    """The steps whose size (``measure`` of its microbatches) is above every step's before."""
    steps, top = [], measure(schedule[0])
    for step, sizes in enumerate(schedule[1:], 1):
        if measure(sizes) > top:
            steps.append(step)
            top = measure(sizes)
    return steps


GROWING = ((16,), (32,), (32,), (64,), (64,), (16,), (128,), (128,), (64,))
SHRINKING = ((128,), (64,), (32,), (16,), (64,))
ALTERNATING = ((16,), (64,), (16,), (64,), (16,), (64,))
MIXED = ((16, 16), (32, 8), (8, 64), (64, 64), (4, 32), (128, 16), (16, 128))


@pytest.mark.parametrize(
    "schedule", [GROWING, SHRINKING, ALTERNATING, MIXED], ids=["growing", "shrinking",
                                                               "alternating", "mixed"]
)  # fmt: skip
def test_one_rerun_per_new_maximum_then_paged_and_bitwise(schedule, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="te_paged.runtime.runner"):
        on, runner = _run(schedule, True)
    _check_bitwise(on, schedule)
    reruns = _reruns(on)
    # A step whose largest microbatch is not above every earlier step's never reruns: the
    # pools grew to the last maximum's need (x headroom) and stay there.
    assert set(reruns) <= set(_new_maxima(schedule)), (reruns, _new_maxima(schedule))
    for _, _, record in on:
        assert record.microbatch_tokens == list(schedule[record.step])
        assert record.max_microbatch_tokens == max(schedule[record.step])
        assert record.enabled == (record.attempt == 1), record
    for step in reruns:  # every rerun grew the pools to what its step needed, and said so
        record = on[step][2]
        assert record.pool_growth, f"step {step} reran without its pools growing"
        following = on[step + 1][2] if step + 1 < len(on) else None
        for key, growth in record.pool_growth.items():
            assert growth["to"] >= growth["needed"] == record.pool_demand_pages[key]
            if following is not None:
                assert following.pool_pages[key] >= growth["to"], "grown pool not allocated"
        said = [m for m in caplog.messages if f"step {step} reruns dropless" in m]
        assert len(said) == 1 and "the pools grow" in said[0], said
        for key, growth in record.pool_growth.items():
            assert f"{key} {growth['from']} -> {growth['to']} pages" in said[0], said[0]
    # Paging still saves memory on the last steps: the pools hold less than the static
    # buffers of the largest step would.
    manager = runner.manager
    for key in manager.keys:
        assert on[-1][2].pool_pages[str(key)] < manager.static_peak_pages(key)


def test_growing_schedule_reruns_at_every_new_maximum_without_growth_past_the_capture() -> None:
    # The figures the issue saw: before the bound followed each step's static buffers, the
    # pools stopped at the capture step's static peak and every larger step reran.
    on, runner = _run(GROWING, True)
    assert _reruns(on) == _new_maxima(GROWING) == [1, 3, 6]
    grown = [max(g["to"] for g in on[s][2].pool_growth.values()) for s in _reruns(on)]
    assert grown == sorted(grown) and grown[-1] > max(
        runner.manager.capture_peaks(k)[2] for k in runner.manager.keys
    ), grown


@pytest.mark.parametrize("where", ["runner", "config"])
def test_a_declared_maximum_sizes_the_first_step_for_it_and_nothing_reruns(where) -> None:
    if where == "runner":
        on, runner = _run(GROWING, True, max_tokens_per_rank=128)
    else:  # MoEConfig.moe_max_tokens_per_rank -> PagedStashManager.from_config
        cfg = ModelConfig(**{**vars(CFG), "max_tokens_per_rank": 128})
        on, runner = _run(GROWING, True, cfg=cfg)
    _check_bitwise(on, GROWING)
    assert _reruns(on) == [], [r.pool_demand_pages for _, _, r in on]
    assert all(not r.pool_growth for _, _, r in on)
    manager = runner.manager
    assert manager.max_tokens_per_rank == 128
    for key in manager.keys:  # sized for 128-token microbatches: 8x the capture step's 16
        assert manager.sizing_peaks(key)[0] >= 8 * manager.capture_peaks(key)[0] - 8


def test_microbatches_of_different_lengths_in_flight_together() -> None:
    # One pipeline stage under 1F1B holds every microbatch of the step at its peak: the need
    # follows their sum, and a declared maximum sizes for all of them at that size.
    schedule = ((16, 16), (16, 64), (64, 16), (64, 64), (16, 64), (64, 64))
    on, _ = _run(schedule, True, in_flight=True)
    _check_bitwise(on, schedule, in_flight=True)
    assert set(_reruns(on)) <= set(_new_maxima(schedule, sum)) == {1, 3}, _reruns(on)
    declared, _ = _run(schedule, True, in_flight=True, max_tokens_per_rank=64)
    _check_bitwise(declared, schedule, in_flight=True)
    assert _reruns(declared) == []


def test_fallback_limit_names_a_setting_that_would_have_fitted() -> None:
    schedule = ((16,), (64,), (64,))
    with pytest.raises(FallbackLimitError) as caught:
        _run(schedule, True, grow_pool=False, max_consecutive_fallbacks=1)
    message = str(caught.value)
    assert "moe_max_tokens_per_rank to >= 64" in message, message
    assert "a microbatch of 16 tokens per rank, the capture step's largest" in message, message
    factor = float(message.split("moe_paged_stash_buffer_size_factor_cuda to >= ")[1].split()[0])
    # Each suggestion fits the step that failed: the declared maximum, or the factor.
    on, _ = _run(schedule, True, grow_pool=False, max_tokens_per_rank=64)
    assert _reruns(on) == []
    cfg = ModelConfig(**{**vars(CFG), "buffer_factor_cuda": factor})
    on, _ = _run(schedule, True, cfg=cfg, grow_pool=False)
    assert _reruns(on) == []


def test_a_rerun_without_growth_says_the_pools_stay(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="te_paged.runtime.runner"):
        on, _ = _run(((16,), (64,)), True, grow_pool=False)
    assert _reruns(on) == [1] and not on[1][2].pool_growth
    (said,) = [m for m in caplog.messages if "reruns dropless" in m]
    assert "the pools stay as they are (grow_pool=False)" in said and "grow to" not in said


def test_declaring_needs_the_top_k_and_comes_before_the_capture_step() -> None:
    with pytest.raises(ValueError, match="needs router_topk"):
        PagedStashManager(device="cpu", max_tokens_per_rank=64)
    with pytest.raises(ValueError, match="max_tokens_per_rank must be >= 1"):
        PagedStashManager(device="cpu", max_tokens_per_rank=0, router_topk=2)
    with pytest.raises(ValueError, match="moe_max_tokens_per_rank must be None"):
        MoEConfig(hidden_size=32, moe_ffn_hidden_size=64, num_moe_experts=4,
                  moe_router_topk=2, moe_max_tokens_per_rank=-1)  # fmt: skip
    _, runner = _run(((16,), (16,)), True)
    with pytest.raises(RuntimeError, match="declared after the capture step began"):
        runner.manager.declare_max_tokens_per_rank(64, 2)
