"""te_paged inside torchtitan 0.3.0's own Trainer and DeepSeek-V3 model, on 4 CPU ranks.

One launch runs every case of ``worker.py``; the tests read its per-rank JSON. ON
and OFF are compared bitwise per step: the loss, every gradient shard and every parameter shard
after torchtitan's optimizer step (AdamW, gradient clipping, the load-balancing hook).
"""

from __future__ import annotations

import json

import pytest

from functional_tests.launch import forkrun
from functional_tests.prelaunch import alone
from functional_tests.torchtitan import worker
from te_paged.tools.ab_result import ABResult, RankResult, StepResult

pytest.importorskip("torchtitan")  # installed by scripts/test.sh; never skipped in CI

WORLD_SIZE = 4


def _launch(out) -> list[dict]:
    # The ranks are forked from a process that imported torchtitan's Trainer once (8 to 9 s
    # of CPU a rank otherwise).
    forkrun(
        ["-m", "functional_tests.torchtitan.worker", "--out", str(out)],
        nproc=WORLD_SIZE,
        timeout_s=480,
        preload=("te_paged.tools.preload_torchtitan",),
        env={"PYTHONWARNINGS": "ignore"},
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    assert all(r["world_size"] == WORLD_SIZE for r in ranks)
    return ranks


LAUNCH = alone("torchtitan", _launch)
LAUNCHES = [LAUNCH]


@pytest.fixture(scope="module")
def results(launches):
    return launches.result(LAUNCH)


def _steps(results, case):
    return [(r["rank"], s) for r in results for s in r["cases"][case]]


@pytest.mark.parametrize("case", list(worker.CASES))
def test_on_equals_off_bitwise_every_step(results, case):
    steps = _steps(results, case)
    cfg = worker.CASES[case][1]
    assert len(steps) == WORLD_SIZE * cfg.get("steps", worker.STEPS)
    for rank, s in steps:
        assert s["loss_equal"] and s["grads_equal"] and s["params_equal"], (case, rank, s)
        assert s["params"] > 0


@pytest.mark.parametrize("case", ["ep4", "ep2_dp2"])
def test_in_budget_steps_are_paged_without_a_rerun(results, case):
    for _rank, s in _steps(results, case):
        assert s["attempt"] == 1 and s["enabled"]
        assert s["stashes"] > 0 and s["stashes"] == s["pops"]
        assert s["overflow_ranks"] == 0 and s["overbudget_ranks"] == 0


@pytest.mark.parametrize("case", ["overflow", "compiled_overflow"])
def test_a_pool_too_small_overflows_and_reruns(results, case):
    for _rank, s in _steps(results, case):
        if s["capture"]:
            continue
        assert s["attempt"] == 2 and s["overflow_ranks"] > 0 and not s["enabled"]


@pytest.mark.parametrize(("case", "reruns"), [("variable", [1]), ("variable_declared", [])])
def test_variable_lengths_rerun_once_per_new_maximum_and_not_when_declared(results, case, reruns):
    """Batches of 32, 64, 32 and 32 tokens a sequence (2 sequences a rank): one rerun, at the
    64-token step, whose pools then hold the smaller steps after it; none with the largest
    declared."""
    by_rank: dict[int, list] = {}
    for rank, s in _steps(results, case):
        by_rank.setdefault(rank, []).append(s)
    for rank, steps in by_rank.items():
        assert [s["record"]["microbatch_tokens"] for s in steps] == [[64], [128], [64], [64]]
        flags = [(s["attempt"], s["overflow_ranks"], s["overbudget_ranks"]) for s in steps]
        assert [i for i, s in enumerate(steps) if s["attempt"] == 2] == reruns, (rank, flags)
        assert all(s["enabled"] and s["stashes"] > 0 for s in steps[2:]), (rank, steps)
        if reruns:
            assert steps[1]["record"]["pool_growth"], (rank, steps[1])


def test_compiled_blocks_page_every_step_and_save_memory(results):
    """torchtitan's compile.enable (each TransformerBlock fullgraph=True, aot_eager): paged,
    nothing said, the steps bitwise to the compiled OFF run (test_on_equals_off_bitwise_every_
    step), and the saving >= 0.95 of the reload-adjusted model, as `te-paged ab --engine
    torchtitan --compile aot_eager --seq-length 256` measures it (the profiler's allocation
    events: compiled code runs under no dispatch-mode tracker)."""
    for _rank, s in _steps(results, "compiled"):
        assert s["attempt"] == 1 and s["enabled"] and s["paged_nothing"] is None
        assert s["stashes"] > 0 and s["stashes"] == s["pops"]
    ranks = [_rank_result(r["ab"]["compiled"]["rank"]) for r in results]
    ab = ABResult(results[0]["ab"]["compiled"]["config"], WORLD_SIZE, ranks)
    assert ab.equal and all("profiler" in r.memory_method for r in ranks)
    memory = ab.memory()
    assert memory["S_bytes"] > 0 and memory["pool_bytes"] > 0
    assert memory["measured_over_reload_adjusted"] >= 0.95, memory


def _rank_result(d: dict) -> RankResult:
    steps = {k: [StepResult(**s) for s in d[k]] for k in ("on", "off")}
    return RankResult(**{**d, **steps})


def test_tokens_over_budget_rerun_dropless(results):
    steps = _steps(results, "over_budget")
    assert all(s["overbudget_ranks"] > 0 and s["attempt"] == 2 for _r, s in steps), steps


def test_selective_activation_checkpointing_leaves_checkpointed_blocks_to_torch(results):
    # torchtitan's SAC wraps every block in torch's non-reentrant checkpoint, whose hooks own
    # the blocks' saved tensors: the stash stands aside (nothing paged twice), ON == OFF.
    for _rank, s in _steps(results, "sac"):
        assert s["attempt"] == 1 and s["stashes"] == s["pops"] == 0
