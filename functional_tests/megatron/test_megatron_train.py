"""A real Megatron-core training step with paged stash: ``MegatronPagedStashRunner`` around
``forward_backward_func``, Megatron DDP (grad buffers), Megatron's optimizer, dropout.

The Megatron launch (4 CPU ranks, gloo; ``functional_tests/megatron``) runs every case of
``train_worker.py``; the tests read its per-rank JSON. "Equal" is bitwise, per optimizer step:
loss, grad norm, every parameter after the step and Megatron's MoE aux-loss tracker.
"""

from __future__ import annotations

import pytest

from functional_tests.megatron import DEFAULT_RELEASE, RELEASES, train_worker, workers_launch

LAUNCH_TIMEOUT_S = 300
PARITY = [f"ep{ep}-overlap_{o}" for ep in (2, 4) for o in (False, True)]
#: megatron-core 0.16.1 runs the training step and the reruns (train_worker.RELEASE_CASES);
#: the default release runs every case.
EARLIER = [r for r in RELEASES if r != DEFAULT_RELEASE]
LAUNCH = workers_launch("train_worker", timeout_s=LAUNCH_TIMEOUT_S)
EARLIER_LAUNCHES = {
    release: workers_launch(
        "train_worker",
        timeout_s=LAUNCH_TIMEOUT_S,
        release=release,
        env={train_worker.CASES_ENV: "release"},
    )
    for release in EARLIER
}
LAUNCHES = [LAUNCH, *EARLIER_LAUNCHES.values()]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    """Every case, on the default release (0.19.2)."""
    return launches.result(LAUNCH)


@pytest.fixture(scope="module", params=EARLIER)
def earlier_ranks(request, launches) -> list[dict]:
    """The training-step and rerun cases, on the earlier release."""
    return launches.result(EARLIER_LAUNCHES[request.param])


def test_the_earlier_release_trains_on_off_bitwise_and_reruns_bitwise(earlier_ranks) -> None:
    for result in earlier_ranks:
        assert set(result["parity"]) == set(train_worker.RELEASE_PARITY), result["parity"]
    for name in train_worker.RELEASE_PARITY:
        _check_parity(earlier_ranks, name)
    test_forced_over_budget_reruns_and_equals_a_run_that_never_overflowed(earlier_ranks)
    test_forced_stash_overflow_reruns_and_equals_a_run_that_never_overflowed(earlier_ranks)


def _all_equal(case: dict) -> bool:
    return len(case["equal"]) == train_worker.STEPS and all(case["equal"])


def _check_parity(ranks: list[dict], name: str) -> None:
    for rank, result in enumerate(ranks):
        case = result["parity"][name]
        assert _all_equal(case), (rank, name, case["equal"])
        assert case["attempt"] == [1] * train_worker.STEPS, case  # the stash really ran...
        stashes, pops = case["stashes_pops"]
        assert stashes == pops > 0, case  # ...and gave every page back


@pytest.mark.parametrize("name", PARITY)
def test_paged_stash_on_off_bitwise_with_dropout(ranks, name) -> None:
    _check_parity(ranks, name)


def test_forced_over_budget_reruns_and_equals_a_run_that_never_overflowed(ranks) -> None:
    for rank, result in enumerate(ranks):
        assert result["reference_skewed"]["attempt"] == [1] * train_worker.STEPS, rank
        case = result["over_budget"]
        assert case["attempt"] == [2] * train_worker.STEPS, case  # every rank reran
        assert all(n >= 1 for n in case["overbudget_ranks"]), case
        assert _all_equal(case), (rank, case["equal"])


def test_forced_stash_overflow_reruns_and_equals_a_run_that_never_overflowed(ranks) -> None:
    for rank, result in enumerate(ranks):
        assert result["reference"]["attempt"] == [1] * train_worker.STEPS, rank
        case = result["overflow"]
        # Step 0 captures (no pool yet); every later step overflows the 0.3x pool.
        assert case["attempt"][1:] == [2] * (train_worker.STEPS - 1), case
        assert all(n >= 1 for n in case["stash_overflow_ranks"][1:]), case
        assert _all_equal(case), (rank, case["equal"])


def test_host_spill_on_one_rank_needs_no_rerun(ranks) -> None:
    for rank, result in enumerate(ranks):
        case = result["spill"]
        assert case["attempt"] == [1] * train_worker.STEPS, case
        assert case["host_spill_ranks"][1:] == [1] * (train_worker.STEPS - 1), case
        assert _all_equal(case), (rank, case["equal"])


@pytest.mark.parametrize("guard", ["rng", "grad_buffer"])
def test_mutation_removing_a_guard_breaks_the_rerun(ranks, guard) -> None:
    # The same forced over-budget rerun, with the runner's RNG restore or its zeroing of
    # DDP's grad buffers removed: the result must no longer equal the reference.
    for rank, result in enumerate(ranks):
        case = result[f"mutation_{guard}"]
        assert case["attempt"] == [2] * train_worker.STEPS, case
        assert not any(case["equal"]), (rank, case["equal"])


def test_a_rank_that_skips_a_step_makes_every_rank_raise_naming_it(ranks) -> None:
    for rank, result in enumerate(ranks):
        message = result["desync"]
        assert message is not None, f"rank {rank} did not detect the desync"
        assert "rank(s) [0, 1, 2] at step 1" in message and "rank(s) [3] at step 2" in message


@pytest.mark.parametrize("recompute", ["full", "moe"])
def test_layer_recompute_with_paged_stash_is_bitwise_and_holds_one_layer(ranks, recompute):
    # Megatron's full-layer / "moe" recompute uses a reentrant checkpoint: its first forward
    # saves nothing, the recomputation in backward pages and pops one layer at a time. So the
    # captured peak is one of the two layers' pages (not both, and not twice), and every
    # stashed tensor is popped.
    for rank, result in enumerate(ranks):
        case = result[f"recompute_{recompute}"]
        assert case["attempt"] == [1] * train_worker.STEPS, case
        assert _all_equal(case), (rank, case["equal"])
        stashes, pops = case["stashes_pops"]
        assert stashes == pops > 0, case
        layers = train_worker.SMALL["layers"]
        # the reference (the default) pages every layer but the last, whose backward follows
        paged_peak = result["reference"]["capture_peak_pages"]
        assert case["capture_peak_pages"] * (layers - 1) == paged_peak, (case, paged_peak)
        # With the default, every recomputed layer is popped at once: all kept, none paged.
        default = result["recompute_full_default"]
        assert _all_equal(default) and default["attempt"] == [1] * train_worker.STEPS, default
        assert default["stashes_pops"] == [0, 0] and default["stashes_skipped"] > 0, default
