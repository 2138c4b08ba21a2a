"""te_paged beside megatron-core 0.19.2's built-in paged stash (4 gloo ranks, EP 4).

The Megatron launch (``functional_tests/megatron``) runs every case of ``builtin_worker.py``
(see its docstring) against megatron-core 0.19.2; the tests read its per-rank JSON. What they
show:

* one stash system at a time: with ``config.moe_paged_stash=True`` and te_paged's spec,
  Megatron's schedule and model hooks are off under te_paged's runner, and without the runner
  they run but Megatron's global manager allocates and records nothing; te_paged's stash does
  the paging, ON == OFF bitwise;
* Megatron's own ``PagedStashRunner`` (what Megatron-LM's ``pretrain()`` builds) drives
  te_paged's layers through the seams it calls on dispatchers (te_paged's
  ``MegatronLoopAdapter``): ON == OFF and equal to te_paged's runner, forced over-budget and
  stash-overflow reruns bitwise with dropout (not without the RNG restore), evaluations stash
  nothing and are not fallbacks;
* the two wrong pairings (Megatron's runner beside te_paged's runner on the same layers,
  te_paged's runner around Megatron's fused experts with the built-in stash) are refused with
  the fix;
* an evaluation step with autograd on stashes nothing and never counts towards the fallback
  limit (the same evaluation stashed as training did would overflow and trip the limit);
* ``measure_fallback_memory`` works with Megatron's DDP wrapper;
* a forced over-budget step: te_paged's rerun equals a run that never overflowed, bitwise;
  Megatron's ``PagedStashRunner`` restores no random state, so its rerun with dropout does not.
"""

from __future__ import annotations

import pytest

from functional_tests.megatron import DEFAULT_RELEASE, workers_launch

STEPS = 3
LAUNCH = workers_launch("builtin_worker", timeout_s=300, release="0.19.2")
LAUNCHES = [LAUNCH]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    assert DEFAULT_RELEASE == "0.19.2"  # the release with the built-in stash
    return launches.result(LAUNCH)


def test_megatrons_hooks_are_off_under_the_runner_and_inert_without_it(ranks) -> None:
    for rank, result in enumerate(ranks):
        case = result["inert"]
        # Under te_paged's runner none of Megatron's stash code runs.
        assert set(case["under_runner"].values()) == {0}, (rank, case["under_runner"])
        # Without the runner the hooks are live: the schedule resets Megatron's manager every
        # call, GPTModel.forward calls the chunk handler every microbatch (the spies count)...
        direct = case["direct"]
        assert direct["reset"] == 2 and direct["chunk"] == 4, (rank, direct)
        # ...and still: no buffer, no saved tensor, no capture, nothing queued.
        assert direct["buffers"] == direct["saved"] == direct["group"] == 0, (rank, direct)
        assert case["megatron_status"] == "captured", case  # it went through its allocation
        assert case["megatron_stash_buffers"] == {}, case
        assert case["megatron_captured"] is None, case
        assert case["megatron_pending"] == 0, case
        # te_paged's stash did the paging, and ON == OFF.
        stashes, pops = case["te_paged_stashes_pops"]
        assert stashes == pops > 0, case
        assert case["attempt"] == [1] * STEPS, case
        assert case["equal"] == [True] * STEPS, case


def test_megatrons_runner_and_te_pageds_runner_together_are_refused(ranks) -> None:
    for result in ranks:
        message = result["refusals"]["megatron_runner"]
        assert message is not None, "Megatron's runner was built beside te_paged's runner"
        assert "one runner per step" in message and "drop MegatronPagedStashRunner" in message


def test_megatrons_own_runner_drives_te_pageds_layers_bitwise(ranks) -> None:
    """What Megatron-LM's pretrain() builds, in a step of our own: te_paged's layers serve the
    seams Megatron's PagedStashRunner calls, te_paged stashes, Megatron's manager does nothing."""
    for rank, result in enumerate(ranks):
        case = result["megatron_runner"]["parity"]
        assert case["equal"] == [True] * STEPS, (rank, case)  # ON == OFF, both under it
        assert case["equal_te_paged_runner"] == [True] * STEPS, (rank, case)
        assert case["attempt"] == [1] * STEPS, case
        assert all(stashes == pops > 0 for stashes, pops in case["stashes_pops"]), case
        counts = case["megatron_counts"]  # its hooks ran; its manager held nothing
        assert counts["reset"] == STEPS and counts["chunk"] == 2 * STEPS, counts
        assert counts["buffers"] == counts["saved"] == counts["group"] == 0, counts


def test_under_megatrons_runner_reruns_are_bitwise_with_dropout(ranks) -> None:
    for rank, result in enumerate(ranks):
        case = result["megatron_runner"]
        over = case["over_budget"]
        assert over["attempt"] == [2] * STEPS and over["reference_attempt"] == [1] * STEPS, over
        assert all(n >= 1 for n in over["overbudget_ranks"]), over
        assert over["equal"] == [True] * STEPS, (rank, over)
        overflow = case["overflow"]  # a 0.3x pool, grow_pool off: every paged step overflows
        assert overflow["attempt"] == [1, 2, 2], overflow
        assert overflow["stash_overflow_ranks"][1:] == [4, 4], overflow
        assert overflow["equal"] == [True] * STEPS, (rank, overflow)


def test_under_megatrons_runner_the_rng_restore_is_what_makes_the_rerun_exact(ranks) -> None:
    for result in ranks:
        case = result["megatron_runner"]["mutation_rng"]
        assert case["attempt"] == [2] * STEPS, case
        assert case["equal"] == [False] * STEPS, case


def test_under_megatrons_runner_evaluations_stash_nothing_and_are_not_fallbacks(ranks) -> None:
    for rank, result in enumerate(ranks):
        case = result["megatron_runner"]["eval"]
        assert case["error"] is None, case
        # [attempt, adapter's training fallbacks]: every training step reruns (skewed routing)
        assert case["train"] == [[2, 1], [2, 2], [2, 3]], (rank, case)
        for attempt, enabled, stashes, fallbacks, losses in case["eval"]:
            assert attempt == 2 and not enabled and stashes == 0, case  # rerun, nothing stashed
            assert fallbacks == 2 and losses == 2, case  # not counted; four in a row allowed


def test_te_paged_runner_around_megatrons_fused_stashing_experts_is_refused(ranks) -> None:
    for result in ranks:
        refusals = result["refusals"]
        fused = refusals["te_paged_runner_fused_True"]
        assert fused is not None and "Megatron's own TEGroupedMLP on the op-fuser path" in fused
        assert "get_te_paged_moe_spec(config)" in fused  # the fix
        # The unfused path stashes nothing into Megatron's manager: not that refusal (this
        # layer has no te_paged participant at all, which the runner says).
        unfused = refusals["te_paged_runner_fused_False"]
        assert unfused is not None and "no paged-stash participant" in unfused


def test_evaluation_steps_stash_nothing_and_never_trip_the_fallback_limit(ranks) -> None:
    for rank, result in enumerate(ranks):
        case = result["eval"]
        assert case["error"] is None, case
        assert case["train_attempt"] == [1, 1, 1], case  # training around it stays paged
        for ev in case["eval"]:
            assert ev["attempt"] == 1 and ev["stash_overflow_ranks"] == 0, (rank, ev)
            assert ev["stashes"] == 0 and not ev["enabled"], (rank, ev)
            assert ev["consecutive_fallbacks"] == 0, (rank, ev)


def test_evaluation_stashed_as_training_overflows_and_bloats_the_pools(ranks) -> None:
    # What the runner does without the guard above: an evaluation stashed as training pops
    # nothing, so the first one overflows, and its rerun grows the pools to hold every
    # microbatch's tensors at once (a step's static peak bounds a pool, and this step's holds
    # them all), memory the training steps then hold; before pools could grow past the capture
    # step's static peak, every evaluation overflowed until FallbackLimitError.
    for result in ranks:
        case = result["eval_mutation"]
        first, *rest = case["eval"]
        assert first["attempt"] == 2 and first["stash_overflow_ranks"] > 0, case
        assert all(ev["attempt"] == 1 and ev["stashes"] > 0 for ev in rest), case
        assert rest[0]["pool_pages"] > first["pool_pages"], case
        assert case["error"] is None, case


def test_fallback_memory_is_measured_through_megatrons_ddp_wrapper(ranks) -> None:
    for result in ranks:
        capture, overflowed = result["fallback_memory"]["records"]
        assert capture["attempt"] == 1 and capture["fallback_peak_bytes"] is None
        assert overflowed["attempt"] == 2, overflowed
        assert overflowed["fallback_peak_bytes"] > 0, overflowed
        assert "MemTracker" in overflowed["fallback_memory_method"], overflowed


def test_te_paged_reruns_bitwise_where_megatrons_runner_does_not(ranks) -> None:
    for rank, result in enumerate(ranks):
        te_paged, megatron = result["reruns"]["te_paged"], result["reruns"]["megatron"]
        # Both reran every step, their references never.
        for runner in (te_paged, megatron):
            assert runner["attempt"] == [2] * STEPS, (rank, runner)
            assert runner["reference_attempt"] == [1] * STEPS, (rank, runner)
        assert te_paged["equal"] == [True] * STEPS, (rank, te_paged)
        # Megatron's rerun draws new dropout masks: the first step's loss already differs.
        assert megatron["equal"] == [False] * STEPS, (rank, megatron)
        assert megatron["loss"][0] != megatron["reference_loss"][0], (rank, megatron)
        assert all(d > 0 for d in megatron["max_param_diff"]), (rank, megatron)


def test_a_step_that_bypasses_megatrons_runner_cannot_reach_the_optimizer(ranks) -> None:
    for result in ranks:
        message = result["megatron_runner"]["unchecked"]
        assert message is not None and "never checked" in message, message
        assert "a step that dropped tokens could have been kept" in message


@pytest.mark.parametrize("runner", ["te_paged", "megatron"])
def test_hybrid_model_on_off_bitwise_in_a_step_of_our_own(ranks, runner) -> None:
    for rank, result in enumerate(ranks):
        case = result["megatron_runner"][f"hybrid_{runner}"]
        assert case["equal"] == [True] * STEPS, (rank, runner, case)
        assert case["attempt"] == [1] * STEPS, case
        assert all(stashes == pops > 0 for stashes, pops in case["stashes_pops"]), case


def test_under_megatrons_runner_te_pageds_part_of_a_paged_step_reads_nothing_on_the_host(
    ranks,
) -> None:
    # Every layer's forward, Megatron's check of the flags and the kept step's boundary ran
    # under the host-read guard (the step's one read is Megatron's own, after the check).
    for result in ranks:
        assert result["megatron_runner"]["host_reads"] == ["attempt 1, enabled True"], result
