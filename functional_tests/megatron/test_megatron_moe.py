"""Megatron-core's ``MoELayer`` with te_paged inside vs the same layer with Megatron's experts.

The Megatron launch (4 CPU ranks, gloo; ``functional_tests/megatron``) runs every case of
``worker.py``: EP 1 and 4, the ``alltoall`` and ``allgather`` dispatchers, ``moe_act`` recompute
off and on, two steps each (the paged stash's capture step, then a paged step); the tests below
read its per-rank JSON.

What is compared with what, against Megatron's ``SequentialMLP`` with the same weights:

* Megatron's ``TEGroupedMLP`` over te_paged's ``GroupedLinear``: **bitwise** — the same
  activation code, and te_paged's grouped GEMM gives the bits of Megatron's per-expert
  ``matmul`` on CPU, in forward and backward.
* te_paged's experts: output, input gradient, router weight gradient and every expert weight
  gradient **bitwise** equal (te_paged's SwiGLU backward rounds the gate derivative in
  Megatron's order, ``((dy·p)·σ)·(1 + g·(1 − σ))·up``).
* te_paged's experts behind te_paged's static-budget dispatcher (``PagedStashMoELayer``, which
  the spec builder picks for a capacity factor): **bitwise** too — the same rows in the same
  order per expert, and top-2 sums of two values are order-free;
* paged stash on vs off (both static-budget): **bitwise**, every tensor (the stash only moves
  bytes).
* a copy of te_paged's layer with one FC2 weight element moved by 1e-2 must fail the same
  check, or the check could not fail.
"""

from __future__ import annotations

import itertools

import pytest

from functional_tests.megatron import worker, workers_launch

LAUNCH = workers_launch("worker", timeout_s=240)
LAUNCHES = [LAUNCH]
#: (expert-parallel size, dispatcher, moe_act recompute): what the worker ran.
CASES = list(itertools.product(worker.EPS, worker.DISPATCHERS, (False, True)))
CASE_IDS = [worker.case_id(*case) for case in CASES]
_FC2_INPUT_KEY = f"float32x{worker.FFN}"


def bitwise_failures(comparison: dict[str, dict]) -> list[str]:
    return [
        f"{name}: not bitwise equal (max |diff| {c['max_abs_diff']:.3g})"
        for name, c in comparison.items()
        if not c["equal"]
    ]


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    """Every rank's results."""
    return launches.result(LAUNCH)


def _steps(ranks: list[dict], case: tuple):
    """``(rank, step, record)`` for every rank and step of ``case``."""
    for rank, result in enumerate(ranks):
        for step, record in enumerate(result[worker.case_id(*case)]["steps"]):
            yield rank, step, record


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_te_paged_experts_match_megatron_sequential_mlp(ranks, case) -> None:
    for rank, step, record in _steps(ranks, case):
        comparison = record["te_paged_vs_sequential"]
        expert_grads = [n for n in comparison if n.startswith("grad:experts.local_experts.")]
        ep = case[0]
        assert len(expert_grads) == 2 * worker.EXPERTS // ep, sorted(comparison)  # fc1, fc2
        assert {"output", "input_grad", "grad:router.weight"} <= set(comparison)
        failures = bitwise_failures(comparison)
        assert not failures, f"rank {rank} step {step}: {failures}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_perturbed_expert_weight_fails_the_comparison(ranks, case) -> None:
    """The check above is not vacuous: one weight moved by 1e-2 makes it fail on some rank."""
    for step in range(worker.STEPS):
        per_rank = [
            bitwise_failures(record["perturbed_vs_sequential"])
            for _, s, record in _steps(ranks, case)
            if s == step
        ]
        assert any(f for f in per_rank), f"step {step}: a perturbed weight went unnoticed"
        assert any("output" in line for f in per_rank for line in f)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_megatron_grouped_mlp_with_te_paged_linears_is_bitwise(ranks, case) -> None:
    for rank, step, record in _steps(ranks, case):
        failures = bitwise_failures(record["grouped_linears_vs_sequential"])
        assert not failures, f"rank {rank} step {step}: {failures}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_static_budget_dispatcher_matches_megatron_sequential_mlp(ranks, case) -> None:
    for rank, step, record in _steps(ranks, case):
        # A capacity factor makes the spec builder pick te_paged's dispatcher, else Megatron's.
        assert record["static_layers"] == ["MoELayer", "PagedStashMoELayer"], record
        assert record["dropped_tokens"] == [0, 0], record  # a 4x budget drops nothing
        failures = bitwise_failures(record["static_vs_sequential"])
        assert not failures, f"rank {rank} step {step}: {failures}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_paged_stash_on_off_bitwise_and_used(ranks, case) -> None:
    recompute = case[2]
    for rank, step, record in _steps(ranks, case):
        failures = bitwise_failures(record["stash_on_vs_off"])
        assert not failures, f"rank {rank} step {step}: {failures}"
        stash = record["stash"]
        assert stash["mode"] == ("CAPTURE" if step == 0 else "CAPTURED"), stash
        assert stash["stashes"] == stash["pops"] > 0, stash
        assert not stash["overflow"], stash
        if step > 0:
            assert stash["pages_high_water"] > 0, stash
        # FC2's input is the activation output: paged, unless moe_act recompute owns it.
        assert (_FC2_INPUT_KEY in stash["capture_keys"]) is not recompute, stash


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_checkpoint_round_trip_to_sequential_layout(ranks, case) -> None:
    for rank, result in enumerate(ranks):
        assert result[worker.case_id(*case)]["roundtrip_mismatches"] == [], f"rank {rank}"


@pytest.mark.parametrize("ep", worker.EPS)
def test_dist_checkpoint_moves_between_megatron_and_te_paged(ranks, ep) -> None:
    # Megatron's dist_checkpointing, both ways; the layers start from different weights, so
    # equality after loading is the checkpoint's doing. Before te_paged's experts wrote
    # Megatron's expert-sharded keys, loading a SequentialMLP checkpoint failed on missing keys
    # (and at EP > 1 every rank claimed its own experts 0..L-1 as the main copy).
    for rank, result in enumerate(ranks):
        case = result[f"dist_checkpoint-ep{ep}"]
        # Same keys, offsets and replica ids as SequentialMLP's, also with singleton shards.
        assert case["same_layout"] == [True] * 4, f"rank {rank}"
        assert case["differs_before"], f"rank {rank}"
        assert case["load_seq_into_te_paged"] == "<All keys matched successfully>", rank
        assert case["load_te_paged_into_seq"] == "<All keys matched successfully>", rank
        assert case["seq_to_te_paged"] and case["te_paged_to_seq"], f"rank {rank}: {case}"
        # Megatron's TEGroupedMLP over te_paged's GroupedLinear reads and writes the same.
        for key in ("load_seq_into_grouped_linears", "load_grouped_linears_into_te_paged"):
            assert case[key] == "<All keys matched successfully>", (rank, key)
        assert case["seq_to_grouped_linears"] and case["grouped_linears_to_te_paged"], case
        if ep > 1:  # resharded: EP 1's checkpoint, each rank its global experts
            assert case["load_ep1_into_te_paged"] == "<All keys matched successfully>", rank
            assert case["ep1_to_te_paged"], f"rank {rank}: {case}"
