"""te_paged inside Megatron-LM's own training loop: ``megatron.training.pretrain()`` of
megatron-core 0.19.2 with Megatron's own paged-stash flags, on 4 gloo ranks.

The Megatron launch runs every ``pretrain()`` of ``pretrain_worker.py`` (see its docstring);
the tests read its per-rank JSON. "Equal" is bitwise per iteration: the loss, the grad norm and
every parameter after the optimizer step. Megatron's own ``PagedStashRunner`` (which
``pretrain()`` builds whenever ``moe_expert_rank_capacity_factor`` is set) drives te_paged's
layers through :class:`~te_paged.integrations.megatron.MegatronLoopAdapter`.
"""

from __future__ import annotations

import pytest

from functional_tests.megatron import workers_launch
from functional_tests.megatron.pretrain_worker import STEPS

# A launch of its own: beside the other workers the first test of either would wait for both.
LAUNCH = workers_launch("pretrain_worker", timeout_s=420, release="0.19.2", own_launch=True)
LAUNCHES = [LAUNCH]
#: The records of a run: 3 iterations, the evaluation at iteration 2, the last validation and
#: test evaluations.
TRAINING = [0, 1, 3]
EVALUATIONS = [2, 4, 5]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    return launches.result(LAUNCH)


def _run(result: dict, name: str) -> dict:
    return result["runs"][name]


@pytest.mark.parametrize("pair", ["gpt", "gpt_spec_flag", "pp2", "hybrid"])
def test_pretrain_on_off_bitwise_with_dropout(ranks, pair) -> None:
    """GPT, GPT with te_paged's layer spec named by ``--spec``, pipeline parallel 2 (1F1B),
    ``HybridModel``: paged stash ON equals OFF, every iteration and evaluation."""
    on = {"gpt": "gpt_on", "gpt_spec_flag": "gpt_spec_flag", "pp2": "pp2_on",
          "hybrid": "hybrid_on"}[pair]  # fmt: skip
    for rank, result in enumerate(ranks):
        assert result["equal"][pair] == [True] * STEPS, (rank, pair, result["equal"][pair])
        assert result["eval_equal"][pair], (rank, pair)
        run = _run(result, on)
        assert run["attempt"] == [1] * 6, run["attempt"]  # kept at once: no rerun
        assert [run["enabled"][i] for i in TRAINING] == [True] * STEPS, run["enabled"]
        # te_paged stashed and popped every training step (or kept unpaged the layer whose
        # backward came at once: pp2's last stage holds one layer), nothing in the evaluations.
        for i, per_manager in enumerate(run["stashes_pops"]):
            for stashes, pops, kept in per_manager:
                assert stashes == pops and (stashes + kept > 0) == (i in TRAINING), run
        if pair != "pp2":  # 4 layers a rank: three of them paged in every training step
            assert all(s > 0 for i in TRAINING for s, _, _ in run["stashes_pops"][i]), run


def test_megatrons_own_stash_allocates_and_records_nothing(ranks) -> None:
    for result in ranks:
        for name in ("gpt_on", "pp2_on", "hybrid_on"):
            run = _run(result, name)
            counts = run["megatron_counts"]
            # Megatron built its runner for training and for each of the 3 evaluations...
            assert counts["runner"] == 4, counts
            # ...its schedules reset its manager every call, and it saw no tensor.
            assert counts["reset"] == 6, counts
            assert counts["buffers"] == counts["saved"] == counts["group"] == 0, counts
            assert run["megatron_state"] == {"buffers": 0, "captured": False}, run


def test_forced_over_budget_reruns_bitwise_equal_to_a_run_that_never_overflowed(ranks) -> None:
    for rank, result in enumerate(ranks):
        assert _run(result, "reference")["attempt"] == [1] * 6, rank
        run = _run(result, "over_budget")  # capacity factor 1.0: every call goes over budget
        assert run["attempt"] == [2] * 6, run["attempt"]
        assert run["fallbacks"] == STEPS, run  # the evaluations' reruns are not fallbacks
        assert result["equal"]["over_budget"] == [True] * STEPS, (rank, result["equal"])
        assert result["eval_equal"]["over_budget"], rank


def test_forced_stash_overflow_reruns_bitwise(ranks) -> None:
    for rank, result in enumerate(ranks):
        run = _run(result, "overflow")  # a 0.3x pool, grow_pool off: each paged step overflows
        assert [run["attempt"][i] for i in TRAINING] == [1, 2, 2], run["attempt"]
        assert [run["attempt"][i] for i in EVALUATIONS] == [1, 1, 1], run["attempt"]
        assert run["fallbacks"] == 2, run
        assert result["equal"]["overflow"] == [True] * STEPS, (rank, result["equal"])


def test_without_the_random_state_restore_the_rerun_is_not_exact(ranks) -> None:
    for result in ranks:
        assert _run(result, "mutation_rng")["attempt"] == [2] * 6
        assert result["equal"]["mutation_rng"] == [False] * STEPS, result["equal"]


def test_save_at_iteration_2_and_resume_bitwise(ranks) -> None:
    for rank, result in enumerate(ranks):
        # gpt_on saved at iteration 2 (and equals gpt_off: saving changes nothing).
        resumed = _run(result, "resume")  # --load, --ckpt-step 2: iteration 3 alone
        assert len(resumed["loss"]) == 1 and resumed["attempt"][0] == 1, resumed
        assert result["equal"]["resume"] == [True], (rank, result["equal"]["resume"])
        assert resumed["eval_loss"] == _run(result, "gpt_on")["eval_loss"][1:], resumed


def test_the_fallbacks_and_pool_bytes_are_logged_every_log_interval(ranks) -> None:
    rank0 = ranks[0]
    lines = _run(rank0, "overflow")["log"]
    assert [line.split(":")[1] for line in lines] == [" iteration 1", " iteration 2",
                                                       " iteration 3"], lines  # fmt: skip
    assert "0 fallback(s) in the last 1 iteration(s), 0 in all" in lines[0], lines
    assert "1 fallback(s) in the last 1 iteration(s), 2 in all" in lines[2], lines
    assert all("paged-stash pools" in line and "MiB on this rank" in line for line in lines)
    assert _run(rank0, "gpt_off")["log"][0].endswith("pools 0.00 MiB on this rank")
    for other in ranks[1:]:  # rank 0 says it for the run
        assert _run(other, "overflow")["log"] == []
