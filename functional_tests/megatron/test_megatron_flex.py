"""te_paged's experts behind Megatron's own HybridEP and NCCL EP dispatchers (4 gloo ranks, EP 4,
0.19.2).

The launch preloads the HybridEP stand-in (``functional_tests/stand_ins/deep_ep.py``) before
megatron-core and the NCCL EP stand-in (``functional_tests/stand_ins/te_ep.py``, Transformer
Engine 2.19's drop-on-overflow contract) after it, so ``moe_flex_dispatcher_backend``
``"hybridep"`` and ``"ncclep"`` build Megatron's ``MoEFlexTokenDispatcher`` and te_paged's
layer keeps it (``FlexTokenDispatcher``); the tests read ``flex_worker.py``'s per-rank JSON.
What they show, for each backend:

* behind HybridEP, te_paged's experts give the bits of Megatron's ``SequentialMLP`` behind it
  (output, input grad, router grad, every expert weight grad), paged stash on equals off, and
  te_paged's own dispatcher gives the same bits when nothing is dropped;
* the stand-in is called with the static budget (``num_permuted_tokens``: no host wait), and
  te_paged's runner sees no wire (HybridEP sends only the real rows);
* a GPTModel whose routing overruns HybridEP's budget reruns dropless, bitwise equal to a run
  that never went over, under te_paged's runner and under Megatron's own ``PagedStashRunner``;
  the runner raises the receive budget after the rerun, so the next steps keep their first
  attempt; with ``grow_capacity=False`` every step reruns (the growth is what saves them);
* NCCL EP: te_paged bootstraps it with ``drop_on_overflow`` at the budget's capacity (Megatron's
  own ``SequentialMLP`` runs behind the same bootstrap); over budget, the rows past the capacity
  are dropped and the demand (``total_recv_tokens``) flags the step: the rerun re-bootstraps at
  the demand the failed attempt measured, and the growth at the grown factor.
"""

from __future__ import annotations

import pytest

from functional_tests.megatron import workers_launch

STAND_INS = ("functional_tests.stand_ins.hybrid_ep_installed",  # before megatron-core
             "functional_tests.stand_ins.nccl_ep_installed")  # fmt: skip
LAUNCH = workers_launch("flex_worker", timeout_s=360, release="0.19.2", stand_ins=STAND_INS)
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
        assert result["have_nccl_ep"]  # the NCCL EP stand-in too
        for layers in ("layers", "ncclep_layers"):
            assert result[layers]["dispatchers"] == {
                "sequential": "MoEFlexTokenDispatcher",
                "te_paged": "FlexTokenDispatcher",
                "te_paged_stash": "FlexTokenDispatcher",
                "te_paged_own": "StaticBudgetTokenDispatcher",
            }


@pytest.mark.parametrize("layers", ["layers", "ncclep_layers"])
def test_experts_behind_the_flex_dispatcher_are_bitwise_megatrons(ranks, layers) -> None:
    for rank, result in enumerate(ranks):
        for step, record in enumerate(result[layers]["steps"]):
            for name in ("te_paged_vs_sequential", "stash_on_vs_off", "flex_vs_own_dispatcher"):
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


def test_nccl_ep_is_bootstrapped_once_with_drop_at_the_budget(ranks) -> None:
    for result in ranks:
        steps = result["ncclep_layers"]["steps"]
        # int(64 tokens (16, rounded up to NCCL EP's chunk) x top-2 x 4.0) = 512, alignment 0.
        assert steps[0]["nccl_ep_bootstraps"] == [[512, True]]  # te_paged's, not Megatron's
        assert steps[1]["nccl_ep_bootstraps"] == []  # the next step keeps it
        for record in steps:
            assert record["budget_tokens"] == 512 and record["over_budget"] == 0
            assert 0 < record["peak_tokens"] <= 512 and record["hybridep_calls"] == []
            assert record["a2a_capacity_factor"] is None


@pytest.mark.parametrize("key", ["training", "ncclep_training"])
def test_over_budget_reruns_bitwise_and_the_budget_grows(ranks, key) -> None:
    for rank, result in enumerate(ranks):
        training = result[key]
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
            # The headroom is in rows (the step's peak x 1.10): where the budget rounds up to
            # the alignment, the smallest factor holding them can equal the needed one.
            assert growth["to"] >= growth["needed"] > 1.0, growth
            assert case["capacity_growth"][1:] == [{}, {}], case
        fixed = training["over_budget_fixed"]
        assert fixed["equal"] == [True] * 3 and fixed["attempt"] == [2, 2, 2], fixed
        assert fixed["capacity_growth"] == [{}, {}, {}]


def test_nccl_ep_reruns_at_the_demand_then_at_the_grown_budget(ranks) -> None:
    # 128 tokens a rank, top-2, factor 1.0: 256 rows; rank 0's skew demands more. The rerun
    # bootstraps at what the failed attempt demanded (the reduced peak), the next step at the
    # grown factor (that peak x 1.10, as a factor of 256), which holds it: no more reruns.
    for result in ranks:
        case = result["ncclep_training"]["over_budget"]
        boots = case["nccl_ep_bootstraps"]
        growth = case["capacity_growth"][0]
        assert [drop for _, drop in boots] == [True] * len(boots)
        first, rerun, grown = (capacity for capacity, _ in boots)
        assert first == 256 and rerun > 256, boots
        assert grown == int(128 * 2 * growth["to"]) >= rerun, (boots, growth)
        # Without growth every step goes over: back to 256, then up to that step's demand.
        fixed = [c for c, _ in result["ncclep_training"]["over_budget_fixed"]["nccl_ep_bootstraps"]]
        assert fixed[::2] == [256] * 3 and fixed[1] == rerun, fixed
        assert len(fixed) == 6 and min(fixed[1::2]) > 256, fixed
