"""PagedStashRunner in one process: flags, rerun, restore, runaway guard, records."""

from __future__ import annotations

import contextlib
import json
import math
import types

import pytest
import torch
from torch import nn

from te_paged.moe import PagedStashParticipant, TEGroupedMLP
from te_paged.runtime import (
    FallbackLimitError,
    PagedStashRunner,
    PoolLimitError,
    StepDesyncError,
)
from te_paged.stash import PagedStashManager

from ..moe.harness import ROWS, config


class FakeDispatcher:
    """Routes a fixed prefix; can be told to report (and apply) an over-budget drop. Has the
    parts of :class:`StaticBudgetDispatcher` the runner uses."""

    def __init__(self) -> None:
        self.over_budget = torch.zeros((), dtype=torch.int64)
        self.peak_tokens = torch.zeros((), dtype=torch.int64)
        self.peak_pair_tokens = torch.zeros((), dtype=torch.int64)
        self.invalid_indices = torch.zeros((), dtype=torch.int64)
        self.budget_tokens, self.last_num_tokens = ROWS, ROWS // 4  # top-2: 32 balanced rows
        self.config = types.SimpleNamespace(moe_router_topk=2)
        self.dropless = False
        self.force_over_budget = False
        self.bytes_sent, self.a2a_capacity_factor, self.ep_size = 0, None, 1  # no wire

    def reset_traffic(self, *, sent: bool = True) -> None:
        self.bytes_sent = 0

    @contextlib.contextmanager
    def dropless_block(self):
        self.dropless = True
        try:
            yield
        finally:
            self.dropless = False

    def reset_flags(self) -> None:
        self.invalid_indices.zero_()
        self.over_budget.zero_()
        self.peak_tokens.zero_()
        self.peak_pair_tokens.zero_()

    def fitting_capacity_factor(
        self, num_tokens: int, peak_pair_tokens: int, *, expert_buffer: bool = False
    ) -> float:
        return round(peak_pair_tokens / (num_tokens * 2), 2)


class FakeMoELayer(nn.Module, PagedStashParticipant):
    def __init__(self, cfg, manager, dropout: float = 0.0) -> None:
        super().__init__()
        self.experts = TEGroupedMLP(4, cfg, manager=manager)
        self.dispatcher = FakeDispatcher()
        self.dropout = nn.Dropout(dropout)

    def budget_dispatchers(self):
        return (self.dispatcher,)

    def forward(self, x, tokens, probs):
        demand = int(tokens.sum())
        self.dispatcher.peak_tokens.fill_(max(int(self.dispatcher.peak_tokens), demand))
        self.dispatcher.peak_pair_tokens.copy_(self.dispatcher.peak_tokens)
        if self.dispatcher.force_over_budget and not self.dispatcher.dropless:
            self.dispatcher.over_budget += 1
            tokens = tokens.clone()
            tokens[0] = 0  # this attempt drops expert 0's tokens: a wrong result
        return self.dropout(self.experts(x, tokens, probs)[0])


def make(cfg_kw=None, layers=2, seed=0, dropout=0.0):
    cfg = config(moe_paged_stash=True, **(cfg_kw or {}))
    torch.manual_seed(seed)
    manager = PagedStashManager.from_config(cfg)
    model = nn.ModuleList([FakeMoELayer(cfg, manager, dropout) for _ in range(layers)])
    return model, manager


def step_fn(model, step: int, forward=None):
    """One step's forward and backward through ``model``'s layers, or through ``forward(x,
    tokens, probs)`` where given (a compiled function, say)."""

    def fn():
        g = torch.Generator().manual_seed(step)
        x = torch.randn(ROWS, 32, generator=g)
        probs = torch.rand(ROWS, generator=g)
        tokens = torch.tensor([10, 0, 7, 13] if step % 2 == 0 else [1, 20, 5, 3])
        if forward is None:
            h = x
            for layer in model:
                h = layer(h, tokens, probs)
        else:
            h = forward(x, tokens, probs)
        loss = h.square().sum()
        loss.backward()
        return loss.detach()

    return fn


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_in_budget_steps_run_once_with_stash() -> None:
    model, manager = make()
    runner = PagedStashRunner(model, manager)
    for step in range(3):
        model.zero_grad()
        _, rec = runner.step(step_fn(model, step))
        assert (rec.attempt, rec.enabled, rec.will_retry) == (1, True, False)
        assert rec.stash_overflow_ranks == rec.overbudget_ranks == rec.host_spill_ranks == 0
        assert rec.peak_tokens == 30 if step % 2 == 0 else 29
        assert (rec.budget_tokens, rec.balanced_tokens) == (ROWS, ROWS // 2)
        if step:
            assert sum(rec.pool_high_water_pages.values()) > 0
    assert json.loads(rec.to_json())["step"] == 2


def _reference(step: int, **kw):
    model, manager = make(**kw)
    with manager.disabled():
        step_fn(model, step)()
    return grads(model)


def test_stash_overflow_reruns_dropless_and_matches_reference() -> None:
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    runner = PagedStashRunner(model, manager, grow_pool=False)
    _, rec0 = runner.step(step_fn(model, 0))  # capture step: nothing paged for real yet
    assert rec0.attempt == 1
    model.zero_grad()
    _, rec = runner.step(step_fn(model, 1))
    assert rec.stash_overflow_ranks == 1 and rec.will_retry and rec.attempt == 2
    assert not rec.enabled and rec.suggested_buffer_size_factor_cuda is not None
    assert rec.fallback_peak_bytes and rec.fallback_memory_method
    assert all(torch.equal(a, b) for a, b in zip(grads(model), _reference(1)))
    assert manager.enabled and manager.buffers == {}  # restored; the pool comes back at reset


def test_over_budget_reruns_and_gradients_equal_the_dropless_reference() -> None:
    model, manager = make()
    runner = PagedStashRunner(model, manager)
    model[1].dispatcher.force_over_budget = True
    _, rec = runner.step(step_fn(model, 0))
    assert rec.overbudget_ranks == 1 and rec.attempt == 2
    assert rec.suggested_capacity_factor == round(math.ceil(30 * 1.05) / 32, 2)
    assert all(torch.equal(a, b) for a, b in zip(grads(model), _reference(0)))
    assert not model[1].dispatcher.dropless  # settings restored


def test_host_spill_needs_no_rerun() -> None:
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2,
                           "moe_paged_stash_buffer_size_factor_cpu": 2.0})  # fmt: skip
    runner = PagedStashRunner(model, manager, grow_pool=False)
    runner.step(step_fn(model, 0))
    model.zero_grad()
    _, rec = runner.step(step_fn(model, 1))
    assert rec.host_spill_ranks == 1 and rec.attempt == 1 and not rec.will_retry
    assert all(torch.equal(a, b) for a, b in zip(grads(model), _reference(1)))


def test_runaway_guard_raises_with_suggested_factors() -> None:
    model, manager = make()
    runner = PagedStashRunner(model, manager, max_consecutive_fallbacks=2)
    model[0].dispatcher.force_over_budget = True
    for step in range(2):
        _, rec = runner.step(step_fn(model, step))
        assert rec.attempt == 2
    with pytest.raises(FallbackLimitError, match=r"moe_expert_rank_capacity_factor to >= \d"):
        runner.step(step_fn(model, 2))


def test_a_good_step_resets_the_fallback_count() -> None:
    model, manager = make()
    runner = PagedStashRunner(model, manager, max_consecutive_fallbacks=1)
    model[0].dispatcher.force_over_budget = True
    runner.step(step_fn(model, 0))
    model[0].dispatcher.force_over_budget = False
    runner.step(step_fn(model, 1))
    assert runner.consecutive_fallbacks == 0
    model[0].dispatcher.force_over_budget = True
    _, rec = runner.step(step_fn(model, 2))  # allowed again
    assert rec.attempt == 2


def capture_at_factor(runner: PagedStashRunner, model: nn.Module) -> None:
    """The capture step with growth off, so the pools start at the factor (0.2: far too
    small) rather than at the capture step's observed peak x headroom: the next step overflows."""
    grow, runner.grow_pool = runner.grow_pool, False
    runner.step(step_fn(model, 0))
    runner.grow_pool = grow


@pytest.mark.parametrize("grow_pool", [True, False])
def test_an_overflow_grows_the_pool_to_what_the_step_needed(grow_pool) -> None:
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    runner = PagedStashRunner(
        model, manager, grow_pool=grow_pool, grow_headroom=1.0, max_consecutive_fallbacks=5
    )
    capture_at_factor(runner, model)
    _, rec = runner.step(step_fn(model, 1))
    assert rec.attempt == 2 and rec.stash_overflow_ranks == 1
    demand = rec.pool_demand_pages
    assert demand and all(v > rec.pool_pages[k] for k, v in demand.items())  # the pool was short
    if not grow_pool:
        assert rec.pool_growth == {}
        _, rec = runner.step(step_fn(model, 1))  # the same step again: overflows again
        assert rec.attempt == 2
        return
    for key, growth in rec.pool_growth.items():  # grow_headroom 1: exactly the need
        assert growth == {
            "from": rec.pool_pages[key], "to": demand[key], "needed": demand[key], "why": "overflow"
        }  # fmt: skip
    _, rec = runner.step(step_fn(model, 1))  # the very step that overflowed now fits
    assert rec.attempt == 1 and rec.stash_overflow_ranks == 0
    assert rec.pool_pages == demand and rec.pool_growth == {}
    stats = manager.stats()
    assert stats.pages_demanded == stats.pages_high_water == demand  # exactly full


@pytest.mark.parametrize("headroom", [1.1, 1.5, 100.0])
def test_growth_adds_headroom_up_to_the_static_peak(headroom) -> None:
    # A grown pool holds the need x grow_headroom, but never more than the capture step's
    # static peak (every tensor at its full rows: a pool that large saves nothing).
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    runner = PagedStashRunner(model, manager, grow_headroom=headroom)
    capture_at_factor(runner, model)
    _, rec = runner.step(step_fn(model, 1))
    assert rec.pool_growth.keys() == {str(k) for k in manager.keys}
    capped = 0
    for key in manager.keys:
        need = rec.pool_demand_pages[str(key)]
        static = manager.capture_peaks(key)[2]
        assert rec.pool_growth[str(key)]["to"] == min(math.ceil(need * headroom), static)
        capped += math.ceil(need * headroom) > static
    assert bool(capped) == (headroom == 100.0)  # the ceiling did cap, and only there


def test_a_step_that_leaves_less_than_the_headroom_free_grows_the_pool_without_a_rerun() -> None:
    # A 1.5 pool holds step 1 (8 of 12 pages needed), but not with a headroom of 1.6 (13): the
    # pool grows for the next step, and nothing reruns.
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 1.5})
    runner = PagedStashRunner(model, manager, grow_headroom=1.6)
    capture_at_factor(runner, model)
    _, rec = runner.step(step_fn(model, 1))
    assert rec.attempt == 1 and rec.stash_overflow_ranks == 0  # it fitted
    pages, need = rec.pool_pages, rec.pool_demand_pages
    assert all(math.ceil(n * 1.6) > pages[k] for k, n in need.items())  # the case at hand
    statics = {str(k): manager.capture_peaks(k)[2] for k in manager.keys}
    assert rec.pool_growth == {
        k: {"from": pages[k], "to": min(math.ceil(n * 1.6), statics[k]), "needed": n,
            "why": "headroom"}
        for k, n in need.items()
    }  # fmt: skip
    assert pages == {str(k): b.num_pages for k, b in manager.buffers.items()}  # kept till reset
    _, after = runner.step(step_fn(model, 1))
    assert after.attempt == 1
    assert after.pool_pages == {k: g["to"] for k, g in rec.pool_growth.items()}


def test_max_pool_bytes_bounds_the_growth_and_refuses_a_step_that_needs_more() -> None:
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    runner = PagedStashRunner(model, manager, max_pool_bytes=10**9, grow_headroom=2.0)
    capture_at_factor(runner, model)
    page_bytes = {str(k): manager.page_size * k.hidden * 4 for k in manager.keys}  # float32
    _, rec = runner.step(step_fn(model, 1))
    need = rec.pool_demand_pages
    need_bytes = sum(need[k] * page_bytes[k] for k in need)
    manager.release()
    manager._floors.clear()  # back to the 0.2 pool
    runner.max_pool_bytes = need_bytes  # the need fits, its headroom does not
    _, rec = runner.step(step_fn(model, 1))
    assert {k: g["to"] for k, g in rec.pool_growth.items()} == need  # no headroom at the bound
    manager.release()
    manager._floors.clear()
    runner.max_pool_bytes = need_bytes - 1  # the step itself needs more
    with pytest.raises(PoolLimitError, match=r"needed .* MiB .*max_pool_bytes="):
        runner.step(step_fn(model, 1))
    with pytest.raises(ValueError, match="max_pool_bytes"):
        PagedStashRunner(model, manager, max_pool_bytes=0)
    with pytest.raises(TypeError, match="grow_pool"):
        PagedStashRunner(model, manager, grow_pool="yes")
    with pytest.raises(ValueError, match="grow_headroom"):
        PagedStashRunner(model, manager, grow_headroom=0.9)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_consecutive_fallbacks"):
        PagedStashRunner(nn.Linear(2, 2), PagedStashManager(), max_consecutive_fallbacks=0)
    with pytest.raises(ValueError, match="no paged-stash participant"):
        PagedStashRunner(nn.Linear(2, 2))


def test_finds_managers_and_dispatchers_through_the_protocol_only() -> None:
    model, manager = make()
    runner = PagedStashRunner(model)  # no manager given: the experts report it
    assert runner.managers == [manager]
    assert runner.dispatchers == [layer.dispatcher for layer in model]

    class LooksLikeALayer(nn.Module):  # has the attributes, but does not take part
        def __init__(self) -> None:
            super().__init__()
            self.dispatcher, self.manager = FakeDispatcher(), manager

    with pytest.raises(ValueError, match="no paged-stash participant"):
        PagedStashRunner(nn.ModuleList([LooksLikeALayer()]))


def _rerun_with_dropout(cause: str):
    """Step 1 reruns (``cause``: "overflow" of a 0.2x pool, or "over_budget" with a dropped
    expert); the model draws dropout masks in forward."""
    factor = 0.2 if cause == "overflow" else 1.1
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": factor}, dropout=0.5)
    runner = PagedStashRunner(model, manager, grow_pool=False)
    runner.step(step_fn(model, 0))
    model.zero_grad()
    model[1].dispatcher.force_over_budget = cause == "over_budget"
    torch.manual_seed(77)  # the state the step starts from, here and in the reference
    _, rec = runner.step(step_fn(model, 1))
    assert rec.attempt == 2
    reference, ref_manager = make(dropout=0.5)
    torch.manual_seed(77)
    with ref_manager.disabled():
        step_fn(reference, 1)()
    return [torch.equal(a, b) for a, b in zip(grads(model), grads(reference))]


@pytest.mark.parametrize("cause", ["overflow", "over_budget"])
def test_rerun_with_dropout_equals_a_run_that_never_overflowed(cause) -> None:
    assert all(_rerun_with_dropout(cause))


@pytest.mark.parametrize("cause", ["overflow", "over_budget"])
def test_mutation_without_rng_restore_the_rerun_differs(monkeypatch, cause) -> None:
    monkeypatch.setattr(PagedStashRunner, "restore_state", lambda self, state: None)
    assert not all(_rerun_with_dropout(cause))


def test_mutation_without_gradient_zeroing_the_rerun_differs(monkeypatch) -> None:
    # Over budget: the failed attempt computed real (wrong) gradients, which would be added.
    # (An overflowed stash reloads nothing, so that attempt's weight gradients are all zero.)
    monkeypatch.setattr(PagedStashRunner, "clear_gradients", lambda self: None)
    assert not all(_rerun_with_dropout("over_budget"))


def test_before_rerun_runs_after_the_gradients_were_zeroed() -> None:
    seen = []

    def hook():
        seen.append([p.grad.abs().sum().item() for p in model.parameters()])

    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 0.2})
    runner = PagedStashRunner(model, manager, grow_pool=False, before_rerun=hook)
    runner.step(step_fn(model, 0))
    assert seen == []  # no rerun, no call
    runner.step(step_fn(model, 1))
    assert len(seen) == 1 and all(v == 0 for v in seen[0])


def _toy(buffer_factor: float = 1.1):
    from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

    cfg = ModelConfig(
        layers=2, experts=4, topk=2, hidden=16, ffn=32, tokens=24, page_size=4,
        buffer_factor_cuda=buffer_factor, steps=3,
    )  # fmt: skip
    model = ToyMoEModel(cfg, paged=True, group=None)
    seen: list[torch.Tensor] = []  # every router call, reruns and recomputation included
    for layer in model.layers:
        layer.router.register_forward_hook(lambda m, i, o: seen.append(o.tokens_per_expert))
    return cfg, model, seen, make_batch


def test_routing_profile_counts_each_kept_forward_once() -> None:
    cfg, model, seen, make_batch = _toy(buffer_factor=0.3)
    runner = PagedStashRunner(model, model.manager, grow_pool=False, record_routing=True)
    with pytest.raises(RuntimeError, match="no step"):
        runner.routing_profile()
    records = []
    for step in range(2):
        x, target = make_batch(cfg, step, 0)

        def fn(x=x, target=target):
            loss = model(x, target)
            loss.backward()
            return loss.detach()

        records.append(runner.step(fn)[1])
    assert [r.attempt for r in records] == [1, 2]  # step 1 overflowed the 0.3x pool: rerun
    assert len(seen) == 3 * cfg.layers
    profile = runner.routing_profile()
    assert (profile.num_experts, profile.ep_size, profile.top_k) == (4, 1, 2)
    assert profile.tokens_per_rank == 24 and profile.pairwise
    kept = [seen[0:2], seen[4:6]]  # step 0, and step 1's rerun (the attempt kept)
    assert profile.tokens_by_source == [[[t.tolist()] for t in step] for step in kept]
    assert all(sum(c) == 24 * 2 for step in profile.tokens for c in step)


def test_routing_profile_skips_recomputation_in_backward() -> None:
    cfg, model, seen, make_batch = _toy()
    runner = PagedStashRunner(model, model.manager, record_routing=True)
    x, target = make_batch(cfg, 0, 0)

    def fn():
        loss = torch.utils.checkpoint.checkpoint(model, x, target, use_reentrant=False)
        loss.backward()
        return loss.detach()

    runner.step(fn)
    assert len(seen) == 2 * cfg.layers  # the routers ran again in backward
    assert len(runner.routing_profile().tokens) == 1


def test_routing_recording_needs_te_paged_layers() -> None:
    model, manager = make()
    with pytest.raises(ValueError, match="record_routing needs te_paged MoE layers"):
        PagedStashRunner(model, manager, record_routing=True)
    with pytest.raises(RuntimeError, match="record_routing=True"):
        PagedStashRunner(model, manager).routing_profile()


def test_routing_profile_has_one_step_per_forward_pass() -> None:
    # Two microbatches per step: two profile steps, each one forward pass of every layer.
    cfg, model, seen, make_batch = _toy()
    runner = PagedStashRunner(model, model.manager, record_routing=True)
    batches = [make_batch(cfg, i, 0) for i in range(2)]

    def fn():
        for x, target in batches:
            model(x, target).backward()

    runner.step(fn)
    profile = runner.routing_profile()
    assert len(seen) == 2 * cfg.layers and len(profile.tokens_by_source) == 2
    for i, step in enumerate(profile.tokens_by_source):  # calls alternate layer 0, 1 per pass
        assert step == [[seen[2 * i + layer].tolist()] for layer in range(cfg.layers)]


def test_records_are_bounded_and_streamed() -> None:
    model, manager = make()
    seen = []
    runner = PagedStashRunner(model, manager, keep_records=2, on_record=seen.append)
    for step in range(5):
        runner.step(step_fn(model, step))
    assert [r.step for r in runner.records] == [3, 4]  # the last two; nothing grows per step
    assert [r.step for r in seen] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="keep_records must be >= 0"):
        PagedStashRunner(model, manager, keep_records=-1)


def test_fallback_limit_names_only_the_factors_that_would_fit() -> None:
    # Over budget alone: there is no pool factor to suggest (before: "... to >= None").
    model, manager = make()
    runner = PagedStashRunner(model, manager, max_consecutive_fallbacks=1)
    model[0].dispatcher.force_over_budget = True
    runner.step(step_fn(model, 0))
    with pytest.raises(FallbackLimitError) as caught:
        runner.step(step_fn(model, 1))
    message = str(caught.value)
    assert "moe_expert_rank_capacity_factor to >= " in message and "None" not in message
    assert "buffer_size_factor" not in message


def test_a_flags_reduction_that_times_out_raises_a_desync(monkeypatch) -> None:
    # One rank of two never reaches the reduction: the wait for it is bounded by `timeout`.
    import datetime

    import torch.distributed as dist

    class Stuck:
        def wait(self, timeout=None):
            assert timeout == datetime.timedelta(seconds=2)
            raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

    model, manager = make()
    runner = PagedStashRunner(model, manager, timeout=datetime.timedelta(seconds=2))
    monkeypatch.setattr(PagedStashRunner, "_world", lambda self: (0, 2))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: Stuck())
    with pytest.raises(StepDesyncError, match="flags of step 0 were not reduced within 0:00:02"):
        runner.step(step_fn(model, 0))
    with pytest.raises(TypeError, match=r"timeout must be a datetime\.timedelta"):
        PagedStashRunner(model, manager, timeout=2)


def test_pool_keys_travel_as_codes_in_a_fixed_size_slot() -> None:
    from te_paged.runtime.reduction import _MAX_KEYS, _SLOT, key_code, key_from_code
    from te_paged.stash import StashKey

    keys = [
        StashKey(torch.float32, 4096),
        StashKey(torch.bfloat16, 7168),
        StashKey(torch.float8_e4m3fn, 7168),
        StashKey(torch.float8_e8m0fnu, 224),
    ]
    codes = [key_code(k) for k in keys]
    assert len(set(codes)) == len(codes) and all(c > 0 for c in codes)
    assert [key_from_code(c) for c in codes] == keys
    # One slot's length whatever pools this rank holds (none yet: the capture step).
    model, manager = make()
    runner = PagedStashRunner(model, manager)
    assert runner._local_stats(torch.device("cpu")).numel() == _SLOT
    runner.step(step_fn(model, 0))
    manager.reset()  # allocates this rank's pools
    assert manager.buffers and runner._local_stats(torch.device("cpu")).numel() == _SLOT
    for hidden in range(_MAX_KEYS + 1 - len(manager.buffers)):  # one pool too many
        manager.buffers[StashKey(torch.float64, 1000 + hidden)] = next(
            iter(manager.buffers.values())
        )
    with pytest.raises(ValueError, match=f"holds {_MAX_KEYS + 1} paged-stash pools"):
        runner._local_stats(torch.device("cpu"))


@pytest.mark.parametrize("grow_pool", [True, False])
def test_max_pool_bytes_holds_for_the_pools_the_factor_sizes(grow_pool) -> None:
    # Before: the bound was checked only against an overflowing step's need, so the pools the
    # factor sized after the capture step (here 2.0 x the balanced peak) passed it silently.
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 2.0})
    probe = PagedStashRunner(model, manager)
    probe.step(step_fn(model, 0))  # the capture step, to learn the sizes
    page = {k: manager.page_size * k.row_bytes for k in manager.keys}
    planned = sum(manager.pool_pages_for(k)[0] * page[k] for k in manager.keys)
    needed = sum(manager.capture_peaks(k)[1] * page[k] for k in manager.keys)
    assert needed < planned
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 2.0})
    runner = PagedStashRunner(model, manager, max_pool_bytes=planned - 1, grow_pool=grow_pool)
    with pytest.raises(PoolLimitError, match="lower moe_paged_stash_buffer_size_factor_cuda"):
        runner.step(step_fn(model, 0))
    assert not manager.buffers  # raised before any allocation
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 2.0})
    runner = PagedStashRunner(model, manager, max_pool_bytes=needed - 1, grow_pool=grow_pool)
    with pytest.raises(PoolLimitError, match="itself more than the bound"):
        runner.step(step_fn(model, 0))
    model, manager = make({"moe_paged_stash_buffer_size_factor_cuda": 2.0})
    runner = PagedStashRunner(model, manager, max_pool_bytes=planned, grow_pool=grow_pool)
    runner.step(step_fn(model, 0))
    runner.step(step_fn(model, 1))
    assert manager.stats().pool_bytes <= planned
