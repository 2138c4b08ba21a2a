"""The buffer planner's arithmetic on synthetic routing profiles and the seeds' figures."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from te_paged.config import MoEConfig
from te_paged.moe.dispatcher import static_budget
from te_paged.runtime.memory import reload_adjusted_saving
from te_paged.runtime.planner import (
    NAMED_CONFIGS,
    RoutingProfile,
    named_sizes,
    recommend,
    stashed_bytes_per_token,
)

GiB = 2**30


def profile(steps) -> RoutingProfile:
    # 4 experts on 2 ranks, 8 tokens x top-2 per rank: balanced 16 rows per rank.
    return RoutingProfile(num_experts=4, ep_size=2, top_k=2, tokens_per_rank=8, tokens=steps)


def test_per_step_needs() -> None:
    p = profile(
        [
            [[8, 8, 8, 8], [8, 8, 8, 8]],  # balanced: needs 1.0 / 1.0
            [[16, 8, 4, 4], [4, 4, 8, 8]],  # rank 0 gets 24 in layer 0: capacity 1.5; pool 32/32
        ]
    )
    assert p.capacity_needs() == [1.0, 1.5]
    assert p.buffer_needs() == [1.0, 1.0]  # the shared pool absorbs the one skewed layer


def test_counts_by_source_give_the_per_pair_need() -> None:
    # The module docstring's example: each rank keeps its 8 rows (N·k = 8, 2 ranks, 2 experts).
    # Per rank that is balanced (1.0); per (source, destination) pair it is 8 rows against a
    # pair budget of cf·8/2, so the dispatcher needs cf = 2.0.
    by_source = [[[[8, 0], [0, 8]]]]
    kw = {"num_experts": 2, "ep_size": 2, "top_k": 2, "tokens_per_rank": 4}
    exact = RoutingProfile(tokens_by_source=by_source, **kw)
    summed = RoutingProfile(tokens=[[[8, 8]]], **kw)
    assert exact.tokens == summed.tokens and exact.pairwise and not summed.pairwise
    assert summed.capacity_needs() == [1.0]
    assert exact.capacity_needs() == [2.0]
    assert exact.buffer_needs() == summed.buffer_needs() == [1.0]


@settings(max_examples=60, deadline=None)
@given(
    ep=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 3),
    tokens=st.integers(1, 40),
    topk=st.integers(1, 2),
    seed=st.randoms(use_true_random=False),
)
def test_recommended_factor_fits_the_dispatchers_pair_budget(ep, per_rank, tokens, topk, seed):
    # The factor plan recommends (target 0) must give every profiled pair a budget that holds
    # it, in the dispatcher's own arithmetic (rows rounded up, then to a multiple of EP).
    experts = ep * per_rank
    assume(topk <= experts)
    by_source = []
    for _ in range(2):  # layers
        sources = []
        for _ in range(ep):
            counts = [0] * experts
            for _ in range(tokens * topk):
                counts[seed.randrange(experts)] += 1
            sources.append(counts)
        by_source.append(sources)
    profile = RoutingProfile(experts, ep, topk, tokens, tokens_by_source=[by_source])
    pair_peak = max(
        sum(src[r * per_rank : (r + 1) * per_rank]) for layer in by_source for src in layer
        for r in range(ep)
    )  # fmt: skip
    cf = recommend(profile, 0.0).capacity_factor

    def pair_capacity(factor: float) -> int:
        cfg = MoEConfig(
            hidden_size=8,
            moe_ffn_hidden_size=8,
            num_moe_experts=experts,
            moe_router_topk=topk,
            moe_expert_rank_capacity_factor=factor,
        )
        return static_budget(cfg, tokens, ep)[1]

    assert pair_capacity(cf) >= pair_peak
    if cf > 1.0:  # minimal: 0.01 less falls short before the budget's rounding up
        assert Fraction(str(round(cf - 0.01, 2))) * tokens * topk < pair_peak * ep


def test_recommendation_covers_the_target_quantile() -> None:
    steps = [[[8, 8, 8, 8]]] * 95 + [[[20, 8, 2, 2]]] * 5  # 5 % of steps need capacity 1.75
    choice = recommend(profile(steps), target_rerun_rate=0.05)
    assert choice.capacity_factor == 1.0 and choice.rerun_rate_capacity == pytest.approx(0.05)
    strict = recommend(profile(steps), target_rerun_rate=0.0)
    assert strict.capacity_factor == 1.75 and strict.rerun_rate_capacity == 0.0
    assert strict.buffer_size_factor_cuda == 1.75 and strict.rerun_rate_stash == 0.0


def test_host_spill_splits_the_pool_between_tiers() -> None:
    steps = [[[8, 8, 8, 8]]] * 60 + [[[20, 8, 2, 2]]] * 40
    choice = recommend(profile(steps), target_rerun_rate=0.0, host_spill=True)
    assert choice.buffer_size_factor_cuda == 1.0 and choice.buffer_size_factor_cpu == 0.75
    assert choice.spill_rate == pytest.approx(0.4) and choice.rerun_rate_stash == 0.0


def test_memory_of_each_choice() -> None:
    steps = [[[8, 8, 8, 8]] * 3]
    choice = recommend(profile(steps), 0.0, bytes_per_token=100)
    s = 16 * 100 * 3
    # te_paged's expert buffer keeps the runner's headroom over the largest need (1.0 x 1.1)
    assert choice.expert_capacity_factor == 1.1
    assert (choice.static_bytes, choice.pool_bytes, choice.host_pool_bytes) == (
        math.ceil(1.1 * s), s, 0,
    )  # fmt: skip


def test_wire_start_and_expert_buffer() -> None:
    # 95 balanced steps, 5 that need 1.75 per pair (totals: a lower bound, the same here)
    steps = [[[8, 8, 8, 8]]] * 95 + [[[20, 8, 2, 2]]] * 5
    choice = recommend(profile(steps), target_rerun_rate=0.05)
    # the wire starts where 95 % of steps fit; the expert buffer leaves the runner room to
    # raise it to the tail's 1.75 x 1.10 after the first step over it
    assert choice.capacity_factor == 1.0 and choice.expert_capacity_factor == 1.93
    roomy = recommend(profile(steps), target_rerun_rate=0.05, capacity_headroom=1.25)
    assert roomy.expert_capacity_factor == 2.19
    with pytest.raises(ValueError, match="capacity_headroom"):
        recommend(profile(steps), capacity_headroom=0.9)


def test_receive_budget_is_exact_from_the_totals() -> None:
    # The module docstring's example: per pair 2.0, but each rank receives N·k = 8 rows, which
    # is all a HybridEP receive budget sees: 1.0, whether or not the profile has the sources.
    kw = {"num_experts": 2, "ep_size": 2, "top_k": 2, "tokens_per_rank": 4}
    exact = RoutingProfile(tokens_by_source=[[[[8, 0], [0, 8]]]], **kw)
    summed = RoutingProfile(tokens=[[[8, 8]]], **kw)
    for p in (exact, summed):
        assert p.receive_needs() == [1.0] and recommend(p, 0.0).receive_capacity_factor == 1.0
    assert recommend(exact, 0.0).capacity_factor == 2.0
    # torchtitan states it over the worst case, N·P·min(L, k) = 4·2·1 = 8 rows: 1.0 here
    assert exact.worst_case_received == 8
    assert recommend(exact, 0.0).non_blocking_capacity_factor == 1.0


def test_receive_budget_counts_hybrideps_padding_and_its_quantile() -> None:
    # 8 experts on 2 ranks (4 local), 16 tokens x top-2: balanced 32 rows per rank.
    kw = {"num_experts": 8, "ep_size": 2, "top_k": 2, "tokens_per_rank": 16}
    steps = [[[9, 9, 7, 7, 8, 8, 8, 8]]] * 9 + [[[20, 10, 5, 5, 8, 8, 8, 0]]]
    p = RoutingProfile(tokens=steps, **kw)
    assert p.peak_received() == [32] * 9 + [40]
    # padded to 8 rows per expert: 16 + 16 + 8 + 8 = 48 in the balanced-ish steps; 24 + 16 +
    # 8 + 8 = 56 in the skewed one
    assert p.peak_received(pad_multiple=8) == [48] * 9 + [56]
    strict = recommend(p, 0.0)
    assert strict.receive_capacity_factor == 1.25 and strict.rerun_rate_receive == 0.0
    lax = recommend(p, 0.1)
    assert lax.receive_capacity_factor == 1.0 and lax.rerun_rate_receive == pytest.approx(0.1)
    assert recommend(p, 0.0, pad_multiple=8).receive_capacity_factor == 1.75
    # worst case 16·2·min(4, 2) = 64 rows: 40 of them is 0.625 -> 0.63
    assert strict.non_blocking_capacity_factor == 0.63


@settings(max_examples=60, deadline=None)
@given(
    ep=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 3),
    tokens=st.integers(1, 40),
    topk=st.integers(1, 2),
    align=st.sampled_from([0, 16]),
    seed=st.randoms(use_true_random=False),
)
def test_receive_factors_fit_the_frameworks_rules(ep, per_rank, tokens, topk, align, seed):
    # The receive factor plan recommends (target 0) must hold the peak in Megatron HybridEP's
    # budget rule and torchtitan's non-blocking one, as te_paged computes them at run time.
    from te_paged.integrations.megatron.dispatcher import hybrid_ep_rank_budget

    experts = ep * per_rank
    assume(topk <= experts)
    counts = [0] * experts
    for _ in range(tokens * ep):  # every token of every rank picks top-k distinct experts
        for e in seed.sample(range(experts), topk):
            counts[e] += 1
    p = RoutingProfile(experts, ep, topk, tokens, tokens=[[counts]])
    peak = p.peak_received()[0]
    choice = recommend(p, 0.0)
    assert hybrid_ep_rank_budget(topk, align, 1)(tokens, choice.receive_capacity_factor) >= peak
    assert int(tokens * ep * min(per_rank, topk) * choice.non_blocking_capacity_factor) >= peak
    if choice.receive_capacity_factor > 1.0:  # minimal
        assert int(tokens * topk * round(choice.receive_capacity_factor - 0.01, 2)) < peak


def test_profile_files_round_trip(tmp_path) -> None:
    p = profile([[[1, 2, 3, 4], [4, 3, 2, 1]]])
    p.to_json(tmp_path / "r.json")
    assert RoutingProfile.load(tmp_path / "r.json") == p
    rows = ["#4,2,2,8", "step,layer,expert,tokens"]
    rows += [f"0,{layer},{e},{n}" for layer, c in enumerate(p.tokens[0]) for e, n in enumerate(c)]
    (tmp_path / "r.csv").write_text("\n".join(rows))
    assert RoutingProfile.load(tmp_path / "r.csv") == p
    by_source = RoutingProfile(
        num_experts=4, ep_size=2, top_k=2, tokens_per_rank=8,
        tokens_by_source=[[[[1, 2, 3, 4], [0, 1, 0, 1]]]],
    )  # fmt: skip
    by_source.to_json(tmp_path / "s.json")
    assert RoutingProfile.load(tmp_path / "s.json") == by_source
    rows = ["#4,2,2,8", "step,layer,source,expert,tokens"]
    for src, c in enumerate(by_source.tokens_by_source[0][0]):
        rows += [f"0,0,{src},{e},{n}" for e, n in enumerate(c)]
    (tmp_path / "s.csv").write_text("\n".join(rows))
    assert RoutingProfile.load(tmp_path / "s.csv") == by_source
    with pytest.raises(ValueError, match=r"\.json or \.csv"):
        RoutingProfile.load(tmp_path / "r.txt")


def test_profile_validation() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        RoutingProfile(num_experts=5, ep_size=2, top_k=1, tokens_per_rank=1, tokens=[[[1] * 5]])
    with pytest.raises(ValueError, match="has 3 experts"):
        profile([[[1, 2, 3]]])
    with pytest.raises(ValueError, match="2 source ranks, expected ep_size=3"):
        RoutingProfile(3, 3, 1, 1, tokens_by_source=[[[[1, 1, 1], [1, 1, 1]]]])
    with pytest.raises(ValueError, match="not tokens_by_source summed"):
        RoutingProfile(2, 2, 1, 1, tokens=[[[1, 1]]], tokens_by_source=[[[[1, 0], [1, 0]]]])
    with pytest.raises(ValueError, match="no steps"):
        RoutingProfile(2, 2, 1, 1)
    with pytest.raises(ValueError, match="target_rerun_rate"):
        recommend(profile([[[1, 1, 1, 1]]]), 1.0)


def test_maxtext_table_for_deepseek_v3() -> None:
    # The MaxText draft: batch 2, seq 4096, top-8, EP 4, 60 MoE layers, ring of experts.
    sizes = named_sizes(
        NAMED_CONFIGS["deepseek-v3"],
        seq=4096,
        batch=2,
        ep=4,
        capacity_factor=1.0,
        buffer_factor=1.0,
        layers=60,
        ring_of_experts=True,
    )
    assert sizes["worst_case_rows"] == 262_144 and sizes["balanced_rows"] == 65_536
    assert sizes["hidden_row_bytes_per_layer_static"] / GiB == pytest.approx(3.5)
    assert sizes["hidden_row_bytes_all_layers_static"] / GiB == pytest.approx(210)
    assert sizes["hidden_row_bytes_all_layers_balanced"] / GiB == pytest.approx(52.5)


def test_capacity_model_matches_megatron_arithmetic() -> None:
    # Megatron's GB300 A/B used capacity 2.0 and pool 1.1: predicted saving (2.0 - 1.1) x S.
    sizes = named_sizes(
        NAMED_CONFIGS["deepseek-v3"],
        seq=4096,
        batch=1,
        ep=16,
        capacity_factor=2.0,
        buffer_factor=1.1,
        skip_immediate_backward=True,
    )
    s = sizes["S_bytes"]
    # The last of the 58 layers stays unpaged (skip_immediate_backward): the pool is 57/58 of
    # 1.1 x S. Without that, Megatron's (2.0 - 1.1) x S.
    bf = 1.1 * 57 / 58
    assert sizes["pool_over_S"] == pytest.approx(bf)
    assert sizes["predicted_saving_bytes"] == pytest.approx((2.0 - bf) * s)
    # At the step's peak one of the 58 layers is reloaded at static size (the ab table's model).
    assert sizes["peak_saving_bytes"] == pytest.approx(reload_adjusted_saving(2.0, bf, s, 58))
    paged = named_sizes(
        NAMED_CONFIGS["deepseek-v3"], seq=4096, batch=1, ep=16, capacity_factor=2.0,
        buffer_factor=1.1, skip_immediate_backward=False,
    )  # fmt: skip
    assert paged["predicted_saving_bytes"] == pytest.approx(0.9 * s)
    assert paged["peak_saving_bytes"] == pytest.approx((0.9 - 2.0 / 58) * s)
    assert stashed_bytes_per_token(7168, 2048) == (7168 + 4096 + 2048) * 2 + 4
