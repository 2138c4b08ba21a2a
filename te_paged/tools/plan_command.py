"""``te-paged plan``: factors from a routing profile, or a named model's sizes.

The two sources take different flags; a flag of the other source is refused rather than
ignored. Their defaults live here (the parser shows them, the check fills them in).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["MODEL_DEFAULTS", "PROFILE_DEFAULTS", "check_plan_args", "run_plan_command"]

#: ``--model``'s flags and their defaults (``layers`` None: the model's own).
MODEL_DEFAULTS: dict[str, object] = {
    "seq_length": 4096,
    "micro_batch_size": 1,
    "ep": 8,
    "layers": None,
    "capacity_factor": 2.0,
    "buffer_factor_cuda": 1.1,
    "ring_of_experts": False,
}
#: ``--profile``'s flags and their defaults.
PROFILE_DEFAULTS: dict[str, object] = {
    "target_rerun_rate": 0.01,
    "host_spill": False,
    "hidden": None,
    "ffn": None,
}


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def _given(args: argparse.Namespace, names) -> list[str]:
    return [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) not in (None, False)]


def check_plan_args(args: argparse.Namespace) -> str | None:
    """A one-line problem with the flags (or the profile file), or None; fills in defaults."""
    from te_paged.runtime import planner

    if args.profile is None and args.model is None:  # both: refused by the parser
        return "give exactly one of --profile or --model"
    mine, other = (MODEL_DEFAULTS, PROFILE_DEFAULTS) if args.model else (PROFILE_DEFAULTS,
                                                                        MODEL_DEFAULTS)  # fmt: skip
    wrong = _given(args, other)
    if wrong:
        return f"{', '.join(wrong)}: only with {'--profile' if args.model else '--model'}"
    for name, default in mine.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
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


def _run_model(args: argparse.Namespace) -> int:
    from te_paged.runtime import planner

    cfg = planner.NAMED_CONFIGS[args.model]
    s = planner.named_sizes(
        cfg,
        seq=args.seq_length,
        batch=args.micro_batch_size,
        ep=args.ep,
        capacity_factor=args.capacity_factor,
        buffer_factor=args.buffer_factor_cuda,
        layers=args.layers,
        ring_of_experts=args.ring_of_experts,
        itemsize=args.dtype_bytes,
    )
    layers = args.layers or cfg.moe_layers
    print(
        f"{cfg.name}: hidden {cfg.hidden}, ffn {cfg.ffn}, top-{cfg.top_k}, {layers} MoE "
        f"layers, micro-batch {args.micro_batch_size}, seq {args.seq_length}, EP {args.ep}"
        f"{', ring of experts' if args.ring_of_experts else ''}"
    )
    effective = s["worst_case_rows"] / s["balanced_rows"]
    why = (
        f"= EP: each rank's buffer holds all {args.ep} ranks' tokens"
        if args.ring_of_experts
        else "--capacity-factor, rounded up to whole rows"
    )
    print(f"  effective capacity factor: {effective:.2f} ({why})")
    print(f"  rows per rank: worst case {s['worst_case_rows']:,}, balanced {s['balanced_rows']:,}")
    print(
        f"  one [rows, hidden] activation: {_gib(s['hidden_row_bytes_per_layer_static'])} "
        f"per layer, {_gib(s['hidden_row_bytes_all_layers_static'])} over all layers "
        f"static; {_gib(s['hidden_row_bytes_all_layers_balanced'])} actual rows only"
    )
    print(
        f"  expert MLP saved activations: static {_gib(s['mlp_saved_bytes_static'])}, "
        f"pool ({args.buffer_factor_cuda} x S) {_gib(s['mlp_saved_bytes_pool'])}, S "
        f"{_gib(s['S_bytes'])}; predicted saving (cf - bf) x S "
        f"{_gib(s['predicted_saving_bytes'])}; at the step's peak, with one layer "
        f"reloaded at static size, (cf - bf - cf/L) x S {_gib(s['peak_saving_bytes'])}"
    )
    return 0


def run_plan_command(args: argparse.Namespace) -> int:
    from te_paged.runtime import planner

    if args.model:
        return _run_model(args)
    profile = args.loaded_profile
    steps, rate = len(profile.tokens), args.target_rerun_rate
    if steps < planner.min_profile_steps(rate):
        print(
            f"te-paged plan: warning: the profile has {steps} step(s), too few for a "
            f"{rate:.2%} rerun rate (one step is {1 / steps:.2%} of it): the factors cover "
            f"every profiled step, and the rate in training is not measured; record at least "
            f"{planner.min_profile_steps(rate)} steps",
            file=sys.stderr,
        )
    bpt = None
    if args.hidden and args.ffn:
        bpt = planner.stashed_bytes_per_token(args.hidden, args.ffn, itemsize=args.dtype_bytes)
    choice = planner.recommend(profile, rate, host_spill=args.host_spill, bytes_per_token=bpt)
    print(
        f"profile: {steps} steps, {len(profile.tokens[0])} layers, "
        f"{profile.num_experts} experts on {profile.ep_size} ranks, top-{profile.top_k}, "
        f"{profile.tokens_per_rank} tokens per rank"
    )
    print(f"target rerun rate {rate:.2%}:")
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
