"""Launch ``runner_worker.py`` on 4 forked gloo ranks and check what each rank saw.

1. in budget, paged stash ON vs OFF: per-step loss, grad norm and every gradient bitwise equal
   on every rank; stashes == pops > 0; no flags;
2. ON vs the dropless reference: bitwise equal (each expert sees the same rows in the same
   order in both, so the arithmetic is the same);
3. rank 0 forced over budget: every rank reruns (attempt 2), the result equals the dropless
   reference, the record counts 1 rank and suggests a capacity factor that then fits;
4. stash overflow with host spill off: rerun, equal, and the pools grow to what the step
   needed, so the next step fits (kept at their size with ``grow_pool=False``: every step
   reruns); with host spill on: no rerun, ``host_spill_ranks > 0``, equal. Pools sized from
   each rank's observed peak are agreed across the expert-parallel group (every rank the
   group's largest), or each rank's own with ``per_rank_pools``;
5. MXFP8 with ``moe_act`` recompute: ON vs OFF bitwise equal; ranks that hold different pool
   keys (MXFP8 on two ranks only) through forced stash overflows and an over-budget rerun: one
   reduction layout everywhere, every result equal to the dropless reference;
6. repeated forced fallbacks: the runaway guard raises on every rank with suggested factors;
7. a routing profile recorded by the runner under a skew: the same on every rank, split by
   source rank; the capacity factor ``plan`` derives from it runs without a rerun, the one from
   the per-rank totals alone (smaller) reruns;
8. the wire's own budget (below);
9. ``max_pool_bytes`` that only some ranks' pools pass: every rank raises, naming those ranks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from .launch import forkrun
from .prelaunch import alone

WORLD = 4


def _launch(out: Path) -> list[dict]:
    forkrun(["-m", "functional_tests.runner_worker", "--out", str(out)], nproc=WORLD, timeout_s=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


LAUNCH = alone("runner", _launch)
LAUNCHES = [LAUNCH]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    return launches.result(LAUNCH)


def attempts(run: dict) -> list[int]:
    return [r["attempt"] for r in run["records"]]


def test_in_budget_on_equals_off(ranks) -> None:
    for res in ranks:
        case = res["in_budget"]
        assert case["on_equals_off"]
        assert attempts(case["on"]) == [1, 1, 1]
        for rec in case["on"]["records"]:
            assert rec["stash_overflow_ranks"] == rec["overbudget_ranks"] == 0
            assert rec["host_spill_ranks"] == 0 and rec["enabled"]
        for s in case["on"]["stats"]:
            assert s["stashes"] == s["pops"] > 0 and not s["overflow"]


def test_on_equals_the_dropless_reference(ranks) -> None:
    assert all(res["on_equals_dropless"] for res in ranks)


def test_forced_over_budget_reruns_everywhere(ranks) -> None:
    for res in ranks:
        case = res["over_budget"]
        assert case["equals_reference"]
        assert attempts(case["run"]) == [2, 2, 2]  # every rank, not only the skewed one
        assert all(r["overbudget_ranks"] == 1 for r in case["run"]["records"])
        assert case["fit"] > 2.0
        assert all(r["overbudget_ranks"] == 0 for r in case["refit"]["records"])


def test_stash_overflow_with_and_without_host_spill(ranks) -> None:
    for res in ranks:
        case = res["overflow"]
        assert case["off_equals_reference"] and case["on_equals_reference"]
        off, on = case["spill_off"]["records"], case["spill_on"]["records"]
        assert attempts(case["spill_off"]) == [1, 2, 1]  # the pools grew after step 1
        assert off[1]["stash_overflow_ranks"] == 4 and off[2]["stash_overflow_ranks"] == 0
        # Each rank grew to its own need x headroom; every rank then holds the group's largest.
        growths = [r["overflow"]["spill_off"]["records"][1]["pool_growth"] for r in ranks]
        largest = {k: max(g[k]["to"] for g in growths) for k in growths[0]}
        assert largest and off[2]["pool_pages"] == largest
        assert case["kept_equals_reference"]
        assert attempts(case["kept"]) == [1, 2, 2]  # grow_pool=False: the same pool again
        assert attempts(case["spill_on"]) == [1, 1, 1]
        assert all(r["host_spill_ranks"] > 0 and r["stash_overflow_ranks"] == 0 for r in on[1:])


def test_pool_sizes_are_agreed_across_the_expert_parallel_group(ranks) -> None:
    def pages(case: str) -> list[dict[str, int]]:
        return [r["pool_sizes"][case]["records"][1]["pool_pages"] for r in ranks]

    own, agreed = pages("per_rank"), pages("agreed")
    assert len({json.dumps(p, sort_keys=True) for p in own}) > 1  # the observed peaks differ
    largest = {k: max(p[k] for p in own) for k in own[0]}
    assert all(p == largest for p in agreed)
    for r in ranks:
        assert attempts(r["pool_sizes"]["agreed"]) == [1, 1, 1]


def test_mxfp8_with_recompute_on_equals_off(ranks) -> None:
    assert all(res["mxfp8_recompute"]["on_equals_off"] for res in ranks)
    assert all(s["stashes"] > 0 for s in ranks[0]["mxfp8_recompute"]["on"]["stats"])


def test_runaway_guard_raises_on_every_rank(ranks) -> None:
    for res in ranks:
        guard = res["guard"]
        assert attempts(guard) == [2, 2]
        assert "moe_expert_rank_capacity_factor to >= " in guard["raised"]


def test_max_pool_bytes_past_on_some_ranks_raises_on_every_rank(ranks) -> None:
    # The planned bytes are gathered, so ranks 2 and 3 (MXFP8: smaller pools), within the
    # bound, raise with 0 and 1 (a local check would leave them waiting in the next step's
    # collectives).
    every = ranks[0]["pool_limit"]["pool_bytes"]
    bound = ranks[0]["pool_limit"]["bound"]
    assert every[2] == every[3] == bound < every[0] == every[1], every
    raised = ranks[0]["pool_limit"]["raised_ranks"]
    missing = sorted(set(range(len(ranks))) - set(raised))
    assert not missing, f"rank(s) {missing} did not raise PoolLimitError with the others"
    for res in ranks:
        run = res["pool_limit"]["run"]
        assert run["records"] == [], run  # raised in the capture step, before any pool
        assert run["raised"].startswith("PoolLimitError: step 0:"), run["raised"]
        assert "on rank(s) [0, 1]" in run["raised"], run["raised"]


def test_recorded_profile_sizes_the_pair_budget_exactly(ranks) -> None:
    case = ranks[0]["plan"]
    profile = case["recorded"]["profile"]
    assert all(res["plan"]["recorded"]["profile"] == profile for res in ranks)
    assert attempts(case["recorded"]) == [1, 1, 1]  # recorded without drops
    assert len(profile["tokens_by_source"]) == 3 and len(profile["tokens_by_source"][0]) == 3
    assert len(profile["tokens_by_source"][0][0]) == WORLD
    balanced = profile["tokens_per_rank"] * profile["top_k"]
    for step in profile["tokens_by_source"]:
        for layer in step:
            assert all(sum(src) == balanced for src in layer)  # each source routes N·k rows
    assert case["lower"] < case["exact"]
    for res in ranks:
        at_exact, at_lower = res["plan"]["at_exact"], res["plan"]["at_lower"]
        assert attempts(at_exact) == [1, 1, 1]
        assert all(r["overbudget_ranks"] == 0 for r in at_exact["records"])
        assert 2 in attempts(at_lower)
    assert all(r["stash_overflow_ranks"] == 0 for r in at_lower["records"])  # over budget only


def test_ranks_with_different_pool_keys_reduce_one_layout_and_rerun_bitwise(ranks) -> None:
    # Ranks 2 and 3 store MXFP8 (data and scale pools besides the float32 ones): before, the
    # reduction's length followed each rank's own pool keys and gloo aborted on the mismatch.
    for rank, result in enumerate(ranks):
        case = result["mixed_keys"]
        assert case["overflow_equals_reference"], (rank, case["overflow"])
        assert case["over_budget_equals_reference"], (rank, case["over_budget"])
        assert case["on_equals_reference"], (rank, case["on"])
        overflow = case["overflow"]["records"]
        assert [r["attempt"] for r in overflow] == [1, 2, 1], overflow  # then grown
        assert overflow[1]["stash_overflow_ranks"] == 4, overflow
        # The growth agreed each key across ranks holding different keys: the MXFP8 pools
        # on ranks 2 and 3 only, the float32 ones everywhere.
        mine = overflow[2]["pool_pages"]
        for other in ranks:
            theirs = other["mixed_keys"]["overflow"]["records"][2]["pool_pages"]
            assert all(theirs[k] == v for k, v in mine.items() if k in theirs), (mine, theirs)
        assert all(r["attempt"] == 2 for r in case["over_budget"]["records"])
        on = case["on"]["records"]
        assert all(r["attempt"] == 1 for r in on), on
        # Each side holds pools the other has not (float32 rows vs MXFP8 data and scales): the
        # record's high-water marks cover the union.
        local, union = set(on[-1]["pool_pages"]), set(on[-1]["pool_high_water_pages"])
        assert local < union, (rank, local, union)
        assert all(v > 0 for v in on[-1]["pool_high_water_pages"].values()), on[-1]


def test_the_wire_sizes_itself_after_one_rerun_and_results_stay_exact(ranks) -> None:
    for rank, res in enumerate(ranks):
        case = res["wire"]
        sized, fixed = case["sized"]["records"], case["fixed"]["records"]
        assert case["sized_equals_reference"] and case["fixed_equals_reference"], rank
        # a2a_capacity_factor 1.0: the first step goes over the wire, reruns, and the wire
        # grows to what it needed x 1.10, agreed on every rank (same figures, same decision).
        assert sized[0]["attempt"] == 2 and sized[0]["overbudget_ranks"] > 0, sized[0]
        growth = sized[0]["capacity_growth"]
        assert growth["why"] == "over budget" and growth["from"] == 1.0, growth
        assert growth["to"] >= growth["needed"] > 1.0
        assert growth == ranks[0]["wire"]["sized"]["records"][0]["capacity_growth"]
        assert sized[1]["a2a_capacity_factor"] == growth["to"]
        # Later, a step reruns only when its routing needs more than any step before (here
        # step 3's largest pair demand jumps), once: the wire then holds it.
        for i, rec in enumerate(sized[1:], 1):
            seen = max(r["peak_pair_tokens"] for r in sized[:i])
            if rec["attempt"] == 2:
                assert rec["peak_pair_tokens"] > seen and rec["capacity_growth"], rec
            else:
                assert rec["peak_pair_tokens"] <= rec["pair_capacity"], rec
        assert sum(r["attempt"] == 2 for r in sized) <= 2
        factors = [r["a2a_capacity_factor"] for r in sized]
        assert factors == sorted(factors)  # it only rises
        # Without grow_capacity the wire stays at 1.0 and every step reruns.
        assert all(r["capacity_growth"] == {} for r in fixed), fixed
        assert all(r["attempt"] == 2 for r in fixed), fixed
        # The narrower wire sends fewer bytes than the wire at the expert buffer's factor.
        wide = case["wide"]["records"]
        assert all(r["attempt"] == 1 for r in wide[1:])
        assert sized[1]["bytes_sent"] < wide[1]["bytes_sent"]  # both kept attempt 1
        assert sized[-1]["pair_capacity"] < wide[-1]["pair_capacity"]
        # A need past max_capacity_factor: CapacityLimitError on every rank, before a rerun.
        raised = case["limited"]["raised"]
        assert (
            raised.startswith("CapacityLimitError: step 0:")
            and "max_capacity_factor=1.05" in raised
        )
        assert raised == ranks[0]["wire"]["limited"]["raised"]
        # The auto wire: its first auto_wire_steps (2) steps run at the expert factor (nothing
        # can go over it), and the runner then sets the wire once from their largest demand x
        # 1.10, lower, on every rank alike.
        auto = case["auto"]["records"]
        assert case["auto_equals_reference"], rank
        assert [r["attempt"] for r in auto[:2]] == [1, 1], auto[:2]
        assert [r["a2a_capacity_factor"] for r in auto[:2]] == [2.0, 2.0], auto[:2]
        assert auto[0]["capacity_growth"] == {}, auto[0]  # watched, not sized
        sized_at = auto[1]["capacity_growth"]
        assert sized_at["why"] == "warm-up" and sized_at["from"] == 2.0 > sized_at["to"], sized_at
        assert sized_at == ranks[0]["wire"]["auto"]["records"][1]["capacity_growth"]
        # Sized from the larger of the two steps' demands: it holds both.
        window_peak = max(r["peak_pair_tokens"] for r in auto[:2])
        assert auto[2]["a2a_capacity_factor"] == sized_at["to"]
        assert auto[2]["pair_capacity"] >= math.ceil(window_peak * 1.10), (auto[2], window_peak)
        assert auto[2]["bytes_sent"] < wide[2]["bytes_sent"]
        assert all(not r["capacity_growth"] or r["capacity_growth"]["why"] != "warm-up"
                   for r in auto[2:])  # fmt: skip
