"""te_paged's experts behind Megatron's own HybridEP dispatcher (4 gloo ranks, EP 4, 0.19.2).

The launch preloads the HybridEP stand-in (``functional_tests/stand_ins/deep_ep.py``) before
megatron-core, so ``moe_flex_dispatcher_backend="hybridep"`` builds Megatron's
``MoEFlexTokenDispatcher`` and te_paged's layer keeps it (``FlexTokenDispatcher``); the tests
read ``flex_worker.py``'s per-rank JSON. What they show:

* behind HybridEP, te_paged's experts give the bits of Megatron's ``SequentialMLP`` behind it
  (output, input grad, router grad, every expert weight grad), paged stash on equals off, and
  te_paged's own dispatcher gives the same bits when nothing is dropped;
* the stand-in is called with the static budget (``num_permuted_tokens``: no host wait), and
  te_paged's runner sees no wire (HybridEP sends only the real rows);
* a GPTModel whose routing overruns HybridEP's budget reruns dropless, bitwise equal to a run
  that never went over, under te_paged's runner and under Megatron's own ``PagedStashRunner``;
  the runner raises the receive budget after the rerun, so the next steps keep their first
  attempt; with ``grow_capacity=False`` every step reruns (the growth is what saves them).
"""

from __future__ import annotations

import pytest

from functional_tests.megatron import workers_launch

STAND_IN = "functional_tests.stand_ins.hybrid_ep_installed"
LAUNCH = workers_launch("flex_worker", timeout_s=180, release="0.19.2", stand_ins=(STAND_IN,))
LAUNCHES = [LAUNCH]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    return launches.result(LAUNCH)


def _failures(comparison: dict[str, dict]) -> list[str]:
    return [f"{n}: max |diff| {c['max_abs_diff']:.3g}" for n, c in comparison.items()
            if not c["equal"]]  # fmt: skip


def test_te_pageds_layer_keeps_megatrons_hybridep_dispatcher(ranks) -> None:
    for result in ranks:
        assert result["have_hybridep"]  # the stand-in was in place before megatron-core
        assert result["layers"]["dispatchers"] == {
            "sequential": "MoEFlexTokenDispatcher",
            "te_paged": "FlexTokenDispatcher",
            "te_paged_stash": "FlexTokenDispatcher",
            "te_paged_own": "StaticBudgetTokenDispatcher",  # ncclep: te_paged's own
        }


def test_experts_behind_hybridep_are_bitwise_megatrons(ranks) -> None:
    for rank, result in enumerate(ranks):
        for step, record in enumerate(result["layers"]["steps"]):
            for name in ("te_paged_vs_sequential", "stash_on_vs_off",
                         "hybridep_vs_own_dispatcher"):  # fmt: skip
                comparison = record[name]
                assert "output" in comparison and len(comparison) > 4, sorted(comparison)
                assert not _failures(comparison), (rank, step, name, _failures(comparison))
            assert record["stash"]["stashes"] == record["stash"]["pops"] > 0, record["stash"]


def test_hybridep_gets_the_static_budget_and_no_wire(ranks) -> None:
    for result in ranks:
        for record in result["layers"]["steps"]:
            budget = record["budget_tokens"]
            # int(16 tokens x top-2 x 4.0) = 128, rounded up to the op fuser's 256 alignment.
            assert budget == 256, record
            static = [n for kind, n in record["hybridep_calls"] if kind == "dispatch" and n]
            # te_paged's two layers (forward and combine's backward each): the budget given.
            assert static.count(budget) == 4, record["hybridep_calls"]
            assert record["over_budget"] == 0 and 0 < record["peak_tokens"] <= budget
            assert record["a2a_capacity_factor"] is None  # no wire to size


def test_over_budget_reruns_bitwise_and_the_budget_grows(ranks) -> None:
    for rank, result in enumerate(ranks):
        training = result["training"]
        assert training["parity"]["equal"] == [True] * 3, (rank, training["parity"])
        assert training["parity"]["attempt"] == [1, 1, 1]
        assert training["own_dispatcher"]["equal"] == [True] * 3  # same bits as HybridEP
        for name in ("over_budget", "over_budget_megatron_runner"):
            case = training[name]
            assert case["equal"] == [True] * 3, (rank, name, case)
            assert case["attempt"] == [2, 1, 1], (rank, name, case)
            assert case["overbudget_ranks"][0] > 0, case
            growth = case["capacity_growth"][0]
            assert growth["factor"] == "moe_expert_rank_capacity_factor", growth
            assert growth["why"] == "over budget" and growth["from"] == 1.0
            assert growth["to"] >= growth["needed"] * 1.10 - 0.01 > 1.0, growth
            assert case["capacity_growth"][1:] == [{}, {}], case
        fixed = training["over_budget_fixed"]
        assert fixed["equal"] == [True] * 3 and fixed["attempt"] == [2, 2, 2], fixed
        assert fixed["capacity_growth"] == [{}, {}, {}]
