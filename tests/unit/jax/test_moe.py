"""The ring-of-experts MoE stack with paged stash of moe_mlpwo: 3 training steps bitwise equal
to the same steps without it, a forced skew flagged and rerun, one compilation for every token
count, and XLA's compiled memory analysis against the capacity model."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from te_paged.jax.moe import PagedStepRunner, RingMoEConfig, init_params, make_batch  # noqa: E402
from te_paged.kernels.layout import State  # noqa: E402
from te_paged.runtime.memory import capacity_model_saving  # noqa: E402

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

    r = PagedStepRunner(CFG, on_trace=on_trace)
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


def test_compiled_memory_saving_within_5_percent_of_the_capacity_model(runner) -> None:
    params, batch = init_params(CFG), make_batch(CFG, 0)
    # Lowering the runner's own jitted steps: XLA's compilation cache serves them.
    on = runner.paged_step.lower(params, batch, runner.pool).compile().memory_analysis()
    off = runner.plain_step.lower(params, batch, None).compile().memory_analysis()
    pool_bytes = runner.pool.nbytes  # an argument of the step (donated), not a temporary
    saving = off.temp_size_in_bytes - (on.temp_size_in_bytes + pool_bytes)
    predicted = capacity_model_saving(CFG.capacity_factor, CFG.buffer_factor, CFG.s_bytes())
    assert CFG.capacity_factor == CFG.ep == 4
    assert abs(saving / predicted - 1) < 0.05, (saving, predicted)
    assert runner.traces == {True: 1, False: 1}


def test_config_checks() -> None:
    with pytest.raises(ValueError, match="do not split"):
        RingMoEConfig(experts=6, ep=4)
    with pytest.raises(ValueError, match="topk"):
        RingMoEConfig(topk=9)
    with pytest.raises(ValueError, match="buffer_factor"):
        RingMoEConfig(buffer_factor=0.0)
