"""Paged stash under Megatron-core's pipeline schedules: 1F1B and interleaved (2 virtual stages),
pipeline 2 × expert parallelism 2 on 4 CPU ranks (gloo), 4 microbatches, dropout on.

The Megatron launch (``functional_tests/megatron``) runs every case of ``pipeline_worker.py``;
the tests read its per-rank JSON. "Equal" is bitwise, per optimizer step: loss (on the last
stage; NaN on the first in both runs), grad norm, every parameter after the step and Megatron's
MoE aux-loss tracker.
"""

from __future__ import annotations

import pytest

from functional_tests.megatron import pipeline_worker as worker
from functional_tests.megatron import workers_launch

SCHEDULES = list(worker.SCHEDULES)
LAUNCH = workers_launch("pipeline_worker", timeout_s=300)
LAUNCHES = [LAUNCH]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    return launches.result(LAUNCH)


def _all_equal(case: dict) -> bool:
    return len(case["equal"]) == worker.STEPS and all(case["equal"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stash_on_off_bitwise_under_the_schedule(ranks, schedule) -> None:
    assert sorted(r[schedule]["stage"] for r in ranks) == [0, 0, 1, 1]
    for rank, result in enumerate(ranks):
        case = result[schedule]["parity"]
        assert _all_equal(case), (rank, case["equal"])
        assert case["attempt"] == [1] * worker.STEPS, case  # the stash ran every step...
        stashes, pops = case["stashes_pops"]
        assert stashes == pops > 0, case  # ...and every page came back, in the schedule's order
        last_stage = result[schedule]["stage"] == 1
        assert all((loss == loss) is last_stage for loss in case["loss"]), case  # NaN: no loss


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_over_budget_stage_reruns_the_whole_step_bitwise(ranks, schedule) -> None:
    for rank, result in enumerate(ranks):
        assert result[schedule]["reference_skewed"]["attempt"] == [1] * worker.STEPS, rank
        case = result[schedule]["over_budget"]
        # Rank 0 (stage 0) went over its budget; every rank of both stages reran every step,
        # replaying all microbatches, and ended where a never-overflowing run ends.
        assert case["attempt"] == [2] * worker.STEPS, (rank, case)
        assert case["overbudget_ranks"] == [1] * worker.STEPS, (rank, case)
        assert _all_equal(case), (rank, case["equal"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_holds_its_in_flight_microbatches(ranks, schedule) -> None:
    """The capture step sizes each stage's pool from the schedule's peak of live rows: stage 0
    holds more microbatches in flight than stage 1 (1F1B: min(stages - rank, microbatches) =
    2 vs 1 microbatches of 2 layers, of which stage 1 pages one: skip_immediate_backward, the
    default, keeps the last layer of each microbatch there, its backward coming at once;
    interleaved: 5 vs 3 microbatch-chunks of 1 layer)."""
    in_flight_layers = {"1f1b": {0: 4, 1: 1}, "interleaved": {0: 5, 1: 3}}[schedule]
    per_layer = None
    for result in ranks:
        case = result[schedule]
        stage, peak = case["stage"], case["capture_peak_balanced_pages"]
        assert len(set(peak.values())) == 1, peak  # every key the same rows here
        pages = next(iter(peak.values()))
        assert pages % in_flight_layers[stage] == 0, (stage, pages)
        layer = pages // in_flight_layers[stage]
        assert per_layer in (None, layer), (per_layer, layer)
        per_layer = layer
        # The record carries each stage's high-water marks; stage 0's are the larger.
        hwm = case["stage_pool_high_water_pages"]
        assert set(hwm) == {"0", "1"}
        assert all(hwm["0"][k] > hwm["1"][k] for k in hwm["0"]), hwm
        mine = hwm[str(stage)]
        assert all(mine[k] <= case["pool_pages"][k] for k in mine), (mine, case["pool_pages"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_stage_pool_is_what_the_planner_predicts(ranks, schedule) -> None:
    """``te-paged plan``'s per-stage figure (pipeline_pool_plan) within one page per key."""
    for result in ranks:
        case = result[schedule]
        planned = case["planned_pool_pages"][case["stage"]]
        measured = case["pool_pages"]
        assert set(planned) == set(measured), (planned, measured)
        assert all(abs(planned[k] - measured[k]) <= 1 for k in planned), (planned, measured)
        assert all(measured[k] <= planned[k] for k in planned), (planned, measured)
