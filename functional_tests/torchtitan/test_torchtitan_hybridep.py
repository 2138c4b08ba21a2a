"""torchtitan's HybridEP dispatcher kept by te_paged: dropped tokens rerun, never kept.

One launch of ``hybridep_worker.py`` (4 CPU ranks, EP 4, the HybridEP stand-in); the tests read
its per-rank JSON. torchtitan alone never reads HybridEP's overflow flag, so a step over its
``non_blocking_capacity_factor`` trains on fewer tokens; under ``PagedStashTrainer`` that step
reruns dropless, bitwise equal to a run whose budget never dropped anything.
"""

from __future__ import annotations

import json
import re

import pytest

from functional_tests.launch import forkrun
from functional_tests.prelaunch import alone
from functional_tests.torchtitan import hybridep_worker

pytest.importorskip("torchtitan")  # installed by scripts/test.sh; never skipped in CI

WORLD_SIZE = 4


def _launch(out) -> list[dict]:
    forkrun(
        ["-m", "functional_tests.torchtitan.hybridep_worker", "--out", str(out)],
        nproc=WORLD_SIZE,
        timeout_s=360,
        preload=("te_paged.tools.preload_torchtitan",),
        env={"PYTHONWARNINGS": "ignore"},
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


LAUNCH = alone("torchtitan hybridep", _launch)
LAUNCHES = [LAUNCH]


@pytest.fixture(scope="module")
def results(launches):
    return launches.result(LAUNCH)


def _steps(results, case):
    steps = [(r["rank"], s) for r in results for s in r["cases"][case]]
    assert len(steps) == WORLD_SIZE * hybridep_worker.STEPS
    return steps


@pytest.mark.parametrize(
    "case", ["parity", "overflow", "overflow_fixed", "everywhere", "padded_everywhere"]
)
def test_every_step_equals_a_run_that_dropped_nothing(results, case):
    for rank, s in _steps(results, case):
        assert s["loss_equal"] and s["grads_equal"] and s["params_equal"], (case, rank, s)


def test_in_budget_steps_are_paged_without_a_rerun(results):
    for _rank, s in _steps(results, "parity"):
        assert s["attempt"] == 1 and s["overbudget_ranks"] == 0
        assert s["stashes"] == s["pops"] > 0


def test_a_dropping_step_reruns_and_the_budget_grows_to_what_the_rerun_measured(results):
    by_rank = {}
    for rank, s in _steps(results, "overflow"):
        by_rank.setdefault(rank, []).append(s)
    for rank, steps in by_rank.items():
        first = steps[0]
        assert first["attempt"] == 2 and first["overbudget_ranks"] > 0, (rank, first)
        growth = first["capacity_growth"]
        assert growth["factor"] == "non_blocking_capacity_factor", growth
        assert growth["why"] == "over budget" and growth["from"] == 0.25 < growth["to"] <= 1.0
        # Measured by the rerun: the peak is past the budget the attempt had.
        assert first["peak_tokens"] > first["budget_tokens"], first
        assert steps[-1]["attempt"] == 1, steps  # the grown budget holds a later step


def test_without_growth_every_dropping_step_reruns(results):
    for _rank, s in _steps(results, "overflow_fixed"):
        assert s["attempt"] == 2 and s["overbudget_ranks"] > 0 and s["capacity_growth"] == {}


@pytest.mark.parametrize("case", ["everywhere", "padded_everywhere"])
def test_reruns_where_some_ranks_receive_almost_nothing_finish_and_grow(results, case):
    # Every rank's routing skewed to expert 0: a step reruns dropless on every rank together
    # (over the budget, or over the pool). With HybridEP's blocking mode the rerun hung (a
    # rank that received no rows passed combine no probabilities: its router got no
    # gradient, FSDP's reduce-scatter another size); the rerun's own budget
    # (PagedHybridEPTokenDispatcher.rerun_factor) gives every rank the same non-empty buffer.
    # Equality with OFF is the test above.
    by_rank = {}
    for rank, s in _steps(results, case):
        by_rank.setdefault(rank, []).append(s)
    for rank, steps in by_rank.items():
        assert [s["attempt"] for s in steps].count(2) >= 1, (rank, steps)  # a rerun ran
        if case == "everywhere":  # factor 0.25: over budget at once, then grown
            assert steps[0]["attempt"] == 2 and steps[0]["overbudget_ranks"] > 0, steps[0]
            assert steps[0]["capacity_growth"]["why"] == "over budget", steps[0]
            assert steps[-1]["attempt"] == 1, steps
        else:  # factor 1.0 holds the padded demand: the rerun is the pool's (stash overflow)
            assert all(s["overbudget_ranks"] == 0 for s in steps), steps
            assert max(s["peak_tokens"] for s in steps) <= steps[0]["budget_tokens"], steps


def test_a_rerun_that_drops_rows_raises_on_every_rank_naming_them(results) -> None:
    """The dropless rerun reads its own overflow flag: sized too small (on purpose), it
    dropped rows, and every rank raised, naming the rows kept and needed (before: a rerun that
    dropped was kept, e.g. 1032 of 1056 rows with the padding left out of its factor, and every
    other test of this file passed)."""
    for r in results:
        error = r["rerun_undersized"]
        assert error is not None, f"rank {r['rank']}: a rerun that dropped rows was kept"
        assert "the dropless rerun's HybridEP dispatch dropped rows" in error, error
        kept, needed = (
            int(x) for x in re.findall(r"kept (\d+) rows a rank, and a rank needed (\d+)", error)[0]
        )
        assert kept < needed, error
