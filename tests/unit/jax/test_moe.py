"""The ring-of-experts MoE stack with paged stash of moe_mlpwo: 3 training steps bitwise equal
to the same steps without it, a forced skew flagged and rerun, one compilation for every token
count, XLA's compiled memory analysis against the capacity model, and the pool sizing itself
(after the first step and after an overflow, recorded) as the torch runner's does."""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.torch_free  # also run without torch (scripts/jax_env.sh)

from te_paged.jax.moe import (  # noqa: E402
    PagedStepRunner,
    RingMoEConfig,
    check_pool_rows,
    init_params,
    make_batch,
)
from te_paged.kernels.layout import State  # noqa: E402
from te_paged.runtime.pool_plan import capacity_model_saving, reload_adjusted_saving  # noqa: E402

# 4 layers, 8 experts over a ring of 4 (2 local), 64 tokens per rank: a 512-row static buffer
# for 128 balanced rows (capacity factor 4). The pool holds 1.25x the balanced pages.
CFG = RingMoEConfig(layers=4, hidden=32, ffn=32, tokens=64, page_size=8, buffer_factor=1.25)
STEPS = 3


@pytest.fixture(scope="module")
def runner():
    """One runner for the module: each of its two step functions compiles once, here."""
    traces = {True: 0, False: 0}

    def on_trace(paged: bool) -> None:
        traces[paged] += 1

    r = PagedStepRunner(CFG, on_trace=on_trace, grow_pool=False)  # the planner's pool, fixed
    r.traces = traces
    return r


def _same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_three_steps_bitwise_on_vs_off_one_compilation(runner) -> None:
    on = off = init_params(CFG)
    counts = []
    for step in range(STEPS):
        batch = make_batch(CFG, step)
        out, record = runner.step(on, batch)
        ref = runner.plain_step(off, batch, None)
        assert (record.attempt, record.enabled, record.stash_overflow_ranks) == (1, True, 0)
        assert _same(out.grads, ref.grads), f"step {step}: gradients differ"
        assert _same(out.params, ref.params) and _same(out.loss, ref.loss)
        state = np.asarray(out.pool.state)  # backward returned every page
        assert state[State.TAIL] - state[State.HEAD] == out.pool.num_pages
        # The pool held each layer's actual rows, page-rounded: never more, never fewer.
        pages = sum(-(-n // CFG.page_size) for n in runner.last_num_tokens)
        assert record.pool_high_water_pages == {CFG.saved.key: pages}
        assert record.pool_pages == {CFG.saved.key: CFG.pool_pages()}
        counts.append(runner.last_num_tokens)
        on, off = out.params, ref.params
    assert len({tuple(c) for c in counts}) == STEPS, "the steps should route differently"
    assert runner.traces == {True: 1, False: 1}
    assert runner.paged_step._cache_size() == runner.plain_step._cache_size() == 1


def test_forced_skew_overflows_is_flagged_and_the_rerun_is_the_unpaged_step(runner) -> None:
    params = init_params(CFG)
    batch = make_batch(CFG, 7, skew=8.0)  # expert 0 (local) takes nearly every token
    out, record = runner.step(params, batch)
    assert (record.attempt, record.enabled, record.stash_overflow_ranks) == (2, False, 1)
    assert record.will_retry and record.suggested_buffer_size_factor_cuda > CFG.buffer_factor
    assert sum(runner.last_num_tokens) > CFG.pool_pages() * CFG.page_size  # it could not fit
    ref = runner.plain_step(params, batch, None)
    assert _same(out.grads, ref.grads) and _same(out.params, ref.params)
    assert float(out.loss) == float(ref.loss)
    # The next step starts from a reset pool and stashes again (the data of step 0 fit).
    out, record = runner.step(params, make_batch(CFG, 0))
    assert (record.attempt, record.enabled) == (1, True)
    assert runner.traces == {True: 1, False: 1}


def test_compiled_memory_saving_between_the_reload_adjusted_and_the_capacity_model(runner):
    """The saving XLA's memory analysis measures lies between the two models (docs/jax.md):
    whether backward's one static-size reload is live at the peak depends on the schedule
    XLA picks, which changes between releases (jax 0.10.2: the capacity model's; 0.12: 83 % of
    it, above the reload-adjusted model)."""
    params, batch = init_params(CFG), make_batch(CFG, 0)
    # Lowering the runner's own jitted steps: XLA's compilation cache serves them.
    on = runner.paged_step.lower(params, batch, runner.pool).compile().memory_analysis()
    off = runner.plain_step.lower(params, batch, None).compile().memory_analysis()
    pool_bytes = runner.pool.nbytes  # an argument of the step (donated), not a temporary
    saving = off.temp_size_in_bytes - (on.temp_size_in_bytes + pool_bytes)
    predicted = capacity_model_saving(CFG.capacity_factor, CFG.buffer_factor, CFG.s_bytes())
    reloads = reload_adjusted_saving(
        CFG.capacity_factor, CFG.buffer_factor, CFG.s_bytes(), CFG.layers
    )
    assert CFG.capacity_factor == CFG.ep == 4
    assert reloads <= saving <= 1.05 * predicted, (reloads, saving, predicted)
    assert runner.traces == {True: 1, False: 1}


def test_an_overflow_grows_the_pool_to_its_need_and_the_step_then_fits() -> None:
    runner = PagedStepRunner(CFG)  # grow_pool: the default
    params, batch = init_params(CFG), make_batch(CFG, 7, skew=8.0)
    out, record = runner.step(params, batch)
    key, pages = CFG.saved.key, CFG.pool_pages()
    need = record.pool_demand_pages[key]
    assert record.attempt == 2 and need > pages  # the rerun kept the step; the need measured
    want = min(math.ceil(need * 1.10), runner.static_pages)
    assert record.pool_growth == {
        key: {"from": pages, "to": want, "needed": need, "why": "overflow"}
    }
    assert runner.pool.num_pages == want
    out, record = runner.step(params, batch)  # the same step again: it fits now
    assert (record.attempt, record.enabled, record.pool_growth) == (1, True, {})
    assert record.pool_pages == {key: want}
    ref = runner.plain_step(params, batch, None)
    assert _same(out.grads, ref.grads) and _same(out.params, ref.params)


def test_a_first_step_that_leaves_less_than_the_headroom_grows_the_pool(runner) -> None:
    """A pool that holds step 0's need exactly (no overflow) but not need x 1.10: grown after
    it, why "capture"; a step that fits with room keeps its pool."""
    params, batch = init_params(CFG), make_batch(CFG, 0)
    _, record = runner.step(params, batch)  # the fixed pool: what step 0 needs
    need = record.pool_demand_pages[CFG.saved.key]
    balanced = CFG.pool_pages() / CFG.buffer_factor  # the planner's pages at factor 1
    tight = RingMoEConfig(**{**CFG.__dict__, "buffer_factor": need / balanced})
    assert tight.pool_pages() == need
    grown = PagedStepRunner(tight)
    _, record = grown.step(params, batch)
    assert record.attempt == 1 and record.pool_high_water_pages == {tight.saved.key: need}
    assert record.pool_growth[tight.saved.key] == {
        "from": need, "to": math.ceil(need * 1.10), "needed": need, "why": "capture",
    }  # fmt: skip
    _, record = grown.step(params, batch)
    assert record.pool_growth == {}


def test_a_count_the_buffer_cannot_hold_is_invalid_not_an_overflow() -> None:
    from te_paged.jax.pool import make_pool, stash
    from te_paged.kernels.layout import Flag
    from te_paged.runtime import InvalidCountsError

    runner = PagedStepRunner(CFG)
    pool = make_pool(4, 8, 3)
    for bad in (-1, 9):  # negative, and more tokens than the 8-row buffer
        pool, _ = stash(pool, jax.numpy.ones((8, 3)), bad)
    assert int(pool.flags[Flag.INVALID]) == 2 and int(pool.flags[Flag.OVERFLOW]) == 0
    out = runner.paged_step(init_params(CFG), make_batch(CFG, 0), runner.pool)
    poisoned = out._replace(flags=out.flags.at[Flag.INVALID].set(1))
    runner.paged_step = lambda *a: poisoned  # a step whose router counted wrong
    with pytest.raises(InvalidCountsError, match=r"outside \[0, 512\].*a rerun would repeat"):
        runner.step(init_params(CFG), make_batch(CFG, 0))


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="do not split"):
        RingMoEConfig(experts=6, ep=4)
    with pytest.raises(ValueError, match="topk"):
        RingMoEConfig(topk=9)
    with pytest.raises(ValueError, match="buffer_factor"):
        RingMoEConfig(buffer_factor=0.0)
    with pytest.raises(ValueError, match="grow_headroom"):
        PagedStepRunner(CFG, grow_headroom=0.9)
    with pytest.raises(TypeError, match="grow_pool must be True or False, got 'no'"):
        PagedStepRunner(CFG, grow_pool="no")  # before: a true string, so the pool grew
    # Numbers only, named (before: Python's "must be real number, not str"; True accepted).
    with pytest.raises(TypeError, match=r"grow_headroom must be a number, got '1\.1'"):
        PagedStepRunner(CFG, grow_headroom="1.1")
    with pytest.raises(TypeError, match=r"buffer_factor must be a number, got '1\.1'"):
        RingMoEConfig(buffer_factor="1.1")
    with pytest.raises(TypeError, match="buffer_factor must be a number, got True"):
        RingMoEConfig(buffer_factor=True)
    # A pool past float32's exact 2**24 rows is refused at construction, not at its growth
    # mid-run: the first pool in the config, the one growth may reach in the runner.
    big = RingMoEConfig(tokens=300000, ep=64, experts=64, topk=8)  # its first pool fits
    with pytest.raises(ValueError, match=r"may grow to 614400000 rows.*below 2\*\*24"):
        PagedStepRunner(big)
    check_pool_rows(big, grow_pool=False)  # never grows: fine (not built: 2.7 GB of pool)
    with pytest.raises(ValueError, match=r"the pool needs \d+ rows"):
        RingMoEConfig(tokens=2_000_000, ep=64, experts=64, topk=8)
