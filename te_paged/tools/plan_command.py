"""``te-paged plan``: factors from a routing profile, or a named model's sizes."""

from __future__ import annotations

import argparse

__all__ = ["check_plan_args", "run_plan_command"]


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def check_plan_args(args: argparse.Namespace) -> str | None:
    """A one-line problem with the flags (or the profile file), or None."""
    from te_paged.runtime import planner

    if (args.profile is None) == (args.model is None):
        return "give exactly one of --profile or --model"
    if args.model:
        experts = planner.NAMED_CONFIGS[args.model].num_experts
        if experts % args.ep:
            return f"--ep {args.ep} does not divide {args.model}'s {experts} experts"
        return None
    if (args.hidden is None) != (args.ffn is None):
        return "give both --hidden and --ffn (for the memory of each choice), or neither"
    try:
        args.loaded_profile = planner.RoutingProfile.load(args.profile)
    except FileNotFoundError:
        return f"--profile {args.profile}: no such file"
    except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
        return f"--profile {args.profile}: not a routing profile ({type(e).__name__}: {e})"
    return None


def run_plan_command(args: argparse.Namespace) -> int:
    from te_paged.runtime import planner

    if args.model:
        cfg = planner.NAMED_CONFIGS[args.model]
        s = planner.named_sizes(
            cfg,
            seq=args.seq,
            batch=args.batch,
            ep=args.ep,
            capacity_factor=args.capacity_factor,
            buffer_factor=args.buffer_factor,
            layers=args.layers,
            ring_of_experts=args.ring_of_experts,
            itemsize=args.dtype_bytes,
        )
        layers = args.layers or cfg.moe_layers
        print(
            f"{cfg.name}: hidden {cfg.hidden}, ffn {cfg.ffn}, top-{cfg.top_k}, {layers} MoE "
            f"layers, batch {args.batch}, seq {args.seq}, EP {args.ep}"
            f"{', ring of experts' if args.ring_of_experts else ''}"
        )
        print(
            f"  rows per rank: worst case {s['worst_case_rows']:,}, balanced {s['balanced_rows']:,}"
        )
        print(
            f"  one [rows, hidden] activation: {_gib(s['hidden_row_bytes_per_layer_static'])} "
            f"per layer, {_gib(s['hidden_row_bytes_all_layers_static'])} over all layers "
            f"static; {_gib(s['hidden_row_bytes_all_layers_balanced'])} actual rows only"
        )
        print(
            f"  expert MLP saved activations: static {_gib(s['mlp_saved_bytes_static'])}, "
            f"pool ({args.buffer_factor} x S) {_gib(s['mlp_saved_bytes_pool'])}, S "
            f"{_gib(s['S_bytes'])}; predicted saving (cf - bf) x S "
            f"{_gib(s['predicted_saving_bytes'])}; at the step's peak, with one layer "
            f"reloaded at static size, (cf - bf - cf/L) x S {_gib(s['peak_saving_bytes'])}"
        )
        return 0
    profile = args.loaded_profile
    bpt = None
    if args.hidden and args.ffn:
        bpt = planner.stashed_bytes_per_token(args.hidden, args.ffn, itemsize=args.dtype_bytes)
    choice = planner.recommend(
        profile, args.target_rerun_rate, host_spill=args.host_spill, bytes_per_token=bpt
    )
    print(
        f"profile: {len(profile.tokens)} steps, {len(profile.tokens[0])} layers, "
        f"{profile.num_experts} experts on {profile.ep_size} ranks, top-{profile.top_k}, "
        f"{profile.tokens_per_rank} tokens per rank"
    )
    print(f"target rerun rate {args.target_rerun_rate:.2%}:")
    print(
        f"  moe_expert_rank_capacity_factor        = {choice.capacity_factor:.2f}"
        f"  (profiled over-budget steps: {choice.rerun_rate_capacity:.2%})"
    )
    print(
        f"  moe_paged_stash_buffer_size_factor_cuda = {choice.buffer_size_factor_cuda:.2f}"
        f"  (profiled stash overflows: {choice.rerun_rate_stash:.2%})"
    )
    print(
        f"  moe_paged_stash_buffer_size_factor_cpu  = {choice.buffer_size_factor_cpu:.2f}"
        f"  (profiled host spills: {choice.spill_rate:.2%})"
    )
    if profile.pairwise:
        print(
            "  (capacity factor from the counts by source rank: exact for te_paged's budget per "
            "(source, destination) rank pair)"
        )
    else:
        print(
            "  (per-rank totals only: te_paged's dispatcher budgets each (source, destination) "
            "rank pair, which a one-sided skew fills sooner, so the capacity factor is a lower "
            "bound; record tokens_by_source, e.g. PagedStashRunner(record_routing=True), for "
            "an exact one)"
        )
    if choice.static_bytes is not None:
        print(
            f"  memory per rank: static buffers' saved activations {_gib(choice.static_bytes)}"
            f", CUDA pool {_gib(choice.pool_bytes)}, host pool "
            f"{_gib(choice.host_pool_bytes)}"
        )
    return 0
