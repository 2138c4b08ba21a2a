"""``te-paged plan``: factors from a routing profile, or a named model's sizes.

The two sources take different flags; a flag of the other source is refused rather than
ignored. Their defaults live here (the parser shows them, the check fills them in). With
``--model`` and ``--pipeline-parallel`` above 1 a table per pipeline stage follows the model's
sizes: the microbatch(-chunk)s the stage holds at its peak under Megatron-core's schedule and
the pool its manager sizes from them (:func:`te_paged.runtime.planner.pipeline_pool_plan`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from te_paged.tools.argtypes import factor, given, integer, knob, real

__all__ = [
    "MODEL_DEFAULTS",
    "PROFILE_DEFAULTS",
    "add_plan_parser",
    "check_plan_args",
    "run_plan_command",
]

#: ``--model``'s flags and their defaults (``layers`` None: the model's own).
MODEL_DEFAULTS: dict[str, object] = {
    "seq_length": 4096,
    "micro_batch_size": 1,
    "ep": 8,
    "layers": None,
    "capacity_factor": 2.0,
    "buffer_factor_cuda": 1.1,
    "ring_of_experts": False,
    "skip_immediate_backward": True,
    "page_size": 64,
    "pipeline_parallel": 1,
    "virtual_stages": None,  # 1F1B
    "microbatches": None,  # the pipeline size
    "microbatch_group_size": None,  # the pipeline size (interleaved only)
}
#: ``--profile``'s flags and their defaults.
PROFILE_DEFAULTS: dict[str, object] = {
    "target_rerun_rate": 0.01,
    "capacity_headroom": 1.10,  # PagedStashRunner's
    "pad_multiple": 1,
    "host_spill": False,
    "hidden": None,
    "ffn": None,
}


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def check_plan_args(args: argparse.Namespace) -> str | None:
    """A one-line problem with the flags (or the profile file), or None; fills in defaults."""
    from te_paged.runtime import planner

    if args.profile is None and args.model is None:  # both: refused by the parser
        return "give exactly one of --profile or --model"
    mine, other = (MODEL_DEFAULTS, PROFILE_DEFAULTS) if args.model else (PROFILE_DEFAULTS,
                                                                        MODEL_DEFAULTS)  # fmt: skip
    wrong = given(args, other)
    if wrong:
        return f"{', '.join(wrong)}: only with {'--profile' if args.model else '--model'}"
    if args.model and args.ring_of_experts and args.skip_immediate_backward:
        return (
            "--skip-immediate-backward with --ring-of-experts: the ring-of-experts stack (the "
            "JAX port) pages every layer; leave the flag out"
        )
    if not args.model and args.fp8 is not None and args.hidden is None:
        return (
            f"--fp8 {args.fp8} prices the saved tensors' bytes: give --hidden and --ffn "
            "(the model's sizes), or leave --fp8 out"
        )
    for name, default in mine.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.model:
        experts = planner.NAMED_CONFIGS[args.model].num_experts
        if experts % args.ep:
            return f"--ep {args.ep} does not divide {args.model}'s {experts} experts"
        return _check_pipeline(args, planner.NAMED_CONFIGS[args.model].moe_layers)
    if (args.hidden is None) != (args.ffn is None):
        return "give both --hidden and --ffn (for the memory of each choice), or neither"
    if args.fp8 == "nvfp4" and args.hidden and (args.hidden % 16 or args.ffn % 16):
        return (
            "--fp8 nvfp4 scales blocks of 16 elements: --hidden and --ffn must be multiples of 16"
        )
    try:
        args.loaded_profile = planner.RoutingProfile.load(args.profile)
    except FileNotFoundError:
        return f"--profile {args.profile}: no such file"
    except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
        return f"--profile {args.profile}: not a routing profile ({type(e).__name__}: {e})"
    return None


def _check_pipeline(args: argparse.Namespace, model_layers: int) -> str | None:
    """Megatron-core 0.16.1's rules for the layout (``PipelineConfig`` raises on the same),
    named by flag; fills in the microbatches (the pipeline size) when not given."""
    p, v, g = args.pipeline_parallel, args.virtual_stages, args.microbatch_group_size
    if args.microbatches is None:
        args.microbatches = p
    m = args.microbatches
    if v is not None and p == 1:
        return (
            f"--virtual-stages {v} needs --pipeline-parallel > 1 (with one stage Megatron-core "
            "runs forward_backward_no_pipelining, one model chunk)"
        )
    if g is not None and v is None:
        return "--microbatch-group-size: only with --virtual-stages (the interleaved schedule)"
    if v is not None:
        group = p if g is None else g
        if not p <= group <= m:
            return (
                f"--microbatches {m}: Megatron-core's interleaved schedule needs --pipeline-"
                f"parallel ({p}) <= microbatch group size ({group}"
                f"{'' if g else ', by default the pipeline size'}) <= --microbatches"
            )
        if 0 < m % group < p:
            return (
                f"--microbatches {m}: Megatron-core's interleaved schedule needs a multiple of "
                f"the microbatch group size ({group}) or a remainder >= --pipeline-parallel "
                f"({p}), not {m % group}"
            )
    layers = args.layers or model_layers
    parts = p * (v or 1)
    if layers % parts:
        return (
            f"{'--layers' if args.layers else f'{args.model} has'} {layers} MoE layers, not "
            f"divisible by --pipeline-parallel {p} x {v or 1} model chunks = {parts}: give "
            "--layers, the MoE layers spread evenly over the chunks"
        )
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
        skip_immediate_backward=args.skip_immediate_backward and not args.ring_of_experts,
        fp8=args.fp8,
    )
    layers = args.layers or cfg.moe_layers
    print(
        f"{cfg.name}: hidden {cfg.hidden}, ffn {cfg.ffn}, top-{cfg.top_k}, {layers} MoE "
        f"layers, micro-batch {args.micro_batch_size}, seq {args.seq_length}, EP {args.ep}"
        f"{', ring of experts' if args.ring_of_experts else ''}"
        f"{f', FC1 and FC2 inputs stored {args.fp8}' if args.fp8 else ''}"
    )
    effective = s["worst_case_rows"] / s["balanced_rows"]
    kept = (
        ", less the last layer: its backward comes first, its tensors stay unpaged"
        if args.skip_immediate_backward and not args.ring_of_experts
        else ""
    )
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
        f"pool ({args.buffer_factor_cuda} x S{kept}) {_gib(s['mlp_saved_bytes_pool'])}, S "
        f"{_gib(s['S_bytes'])}; predicted saving (cf - bf) x S, bf the pool over S "
        f"{_gib(s['predicted_saving_bytes'])}; at the step's peak, with one layer "
        f"reloaded at static size, (cf - bf - cf/L) x S {_gib(s['peak_saving_bytes'])}"
    )
    if args.pipeline_parallel > 1:
        _print_stages(args, cfg, s, layers)
    return 0


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def _print_stages(args: argparse.Namespace, cfg, sizes: dict[str, float], layers: int) -> None:
    from te_paged.runtime import planner
    from te_paged.runtime.schedules import PipelineConfig, PipelineSchedule

    p, v, m = args.pipeline_parallel, args.virtual_stages, args.microbatches
    pipeline = PipelineConfig(p, m, v, args.microbatch_group_size)
    cf = sizes["worst_case_rows"] / sizes["balanced_rows"]
    stages = planner.pipeline_pool_plan(
        pipeline_parallel=p,
        microbatches=m,
        virtual_stages=v,
        microbatch_group_size=args.microbatch_group_size,
        num_layers=layers,
        balanced_rows=int(sizes["balanced_rows"]),
        saved=planner.expert_mlp_saved_tensors(
            cfg.hidden, cfg.ffn, itemsize=args.dtype_bytes, fp8=args.fp8
        ),
        page_size=args.page_size,
        buffer_factor=args.buffer_factor_cuda,
        capacity_factor=cf,
        # As the summary above: the ring of experts (the JAX port) pages every layer.
        skip_immediate_backward=args.skip_immediate_backward and not args.ring_of_experts,
    )
    interleaved = pipeline.schedule is PipelineSchedule.INTERLEAVED
    how = (
        f"interleaved, {v} model chunk(s) of {layers // (p * v)} MoE layers per stage, "
        f"microbatch group {pipeline.group_size}"
        if interleaved
        else f"1F1B, {layers // p} MoE layers per stage"
    )
    print(
        f"pipeline: {p} stages, {m} microbatches, {how} (Megatron-core "
        f"{pipeline.schedule.value}); one paged-stash manager per stage:"
    )
    keys = list(stages[0].pool_pages)
    head = ["stage", "in flight", *(["chunk peaks"] if interleaved else []), "layers", "pooled"]
    head += keys
    head += ["pool MiB", "OFF MiB", "saving MiB", "at peak MiB"]
    rows = []
    for st in stages:
        row = [str(st.stage), str(st.in_flight.peak)]
        if interleaved:
            row.append(" ".join(map(str, st.in_flight.chunk_peaks)))
        row += [str(st.live_layers), str(st.pooled_layers)]
        row += [f"{st.pool_pages[k]:,}" for k in keys]
        row += [_mib(st.total_pool_bytes), _mib(st.static_bytes), _mib(st.saving_bytes),
                _mib(st.peak_saving_bytes)]  # fmt: skip
        rows.append(row)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
    unit = "microbatch-chunks" if interleaved else "microbatches"
    chunk_note = "; chunk peaks: each model chunk's own peak" if interleaved else ""
    print(
        f"  in flight: {unit} forwarded and not yet backwarded at the stage's peak{chunk_note}; "
        f"layers: the (layer, microbatch) activations live then; pooled: those in the pool, "
        f"less a last layer whose backward comes next (skip_immediate_backward keeps it "
        f"unpaged); per key, the pool pages its "
        f"manager sizes from the capture step, ceil({args.buffer_factor_cuda} x balanced pages of "
        f"{args.page_size} rows) of the pooled layers; OFF: the same tensors static, cf x S; "
        f"saving: (cf - bf) x S, at peak (cf - bf - cf/L) x S, L the live layers, bf the pool "
        f"over S"
    )


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
        bpt = planner.stashed_bytes_per_token(
            args.hidden, args.ffn, itemsize=args.dtype_bytes, fp8=args.fp8
        )
    choice = planner.recommend(
        profile,
        rate,
        host_spill=args.host_spill,
        bytes_per_token=bpt,
        capacity_headroom=args.capacity_headroom,
        pad_multiple=args.pad_multiple,
    )
    print(
        f"profile: {steps} steps, {len(profile.tokens[0])} layers, "
        f"{profile.num_experts} experts on {profile.ep_size} ranks, top-{profile.top_k}, "
        f"{profile.tokens_per_rank} tokens per rank"
    )
    print(f"target rerun rate {rate:.2%}:")
    print("  te_paged's dispatcher (a budget per (source, destination) rank pair):")
    print(
        f"    moe_a2a_capacity_factor                = {choice.capacity_factor:.2f}"
        f"  (the wire's start; profiled over-budget steps: {choice.rerun_rate_capacity:.2%})"
    )
    print(
        f"    moe_expert_rank_capacity_factor        = {choice.expert_capacity_factor:.2f}"
        f"  (the expert buffer: the largest profiled need x capacity_headroom "
        f"{args.capacity_headroom:g}, room for the runner to raise the wire after a step over it)"
    )
    pad = f", each expert's rows padded to {args.pad_multiple}" if args.pad_multiple > 1 else ""
    print(f"  HybridEP (a budget per receiving rank{pad}):")
    print(
        f"    moe_expert_rank_capacity_factor        = {choice.receive_capacity_factor:.2f}"
        f"  (Megatron's flex dispatcher; profiled over-budget steps: "
        f"{choice.rerun_rate_receive:.2%})"
    )
    print(
        f"    non_blocking_capacity_factor           = {choice.non_blocking_capacity_factor:.2f}"
        f"  (torchtitan's: the same rows over the worst case, "
        f"{profile.worst_case_received} rows)"
    )
    print(
        "  (the runner raises each budget x capacity_headroom after a step over it; these are "
        "where to start)"
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
            "  (te_paged's factors from the counts by source rank: exact for its budget per "
            "(source, destination) rank pair)"
        )
    else:
        print(
            "  (per-rank totals only: te_paged's dispatcher budgets each (source, destination) "
            "rank pair, which a one-sided skew fills sooner, so its factors are lower bounds "
            "(HybridEP's are exact); record tokens_by_source, e.g. "
            "PagedStashRunner(record_routing=True), for exact ones)"
        )
    if choice.static_bytes is not None:
        print(
            f"  memory per rank: te_paged's static expert buffers' saved activations "
            f"{_gib(choice.static_bytes)}"
            f", CUDA pool {_gib(choice.pool_bytes)}, host pool "
            f"{_gib(choice.host_pool_bytes)}"
        )
    return 0


def add_plan_parser(sub, common: argparse.ArgumentParser) -> None:
    """``te-paged plan``'s subparser: its flags, with :data:`MODEL_DEFAULTS` and
    :data:`PROFILE_DEFAULTS` shown in the help."""
    md, pd = MODEL_DEFAULTS, PROFILE_DEFAULTS

    plan = sub.add_parser(
        "plan",
        parents=[common],
        help="recommend capacity and buffer factors",
        description="Recommend the capacity factors to start from (te_paged's wire and "
        "expert buffer, HybridEP's receive budget in Megatron and torchtitan) and the stash "
        "buffer factors from a routing profile, or print a named model's sizes without "
        "running it.",
    )
    source = plan.add_argument_group("what to plan from (exactly one)")
    source = source.add_mutually_exclusive_group()
    source.add_argument(
        "--profile",
        type=Path,
        help="routing profile (.json or .csv); counts by source rank (as `ab --record-profile` "
        "and PagedStashRunner(record_routing=True) record them) make the capacity factor exact, "
        "per-expert totals a lower bound",
    )
    source.add_argument(
        "--model", choices=["deepseek-v3"], help="a named configuration's sizes, without a run"
    )
    plan.add_argument(
        "--dtype-bytes",
        type=int,
        choices=[1, 2, 4],
        default=2,
        help="bytes per stashed element: 1 FP8, 2 bf16, 4 fp32 (%(default)s)",
    )
    plan.add_argument(
        "--fp8",
        choices=["tensorwise", "mxfp8", "nvfp4"],
        help="MoEConfig.fp8: the FC1 and FC2 inputs stored in that format, scales included "
        "(tensorwise 1 byte an element, mxfp8 1 + 1/32, nvfp4 4.5 bits; default: none)",
    )
    prof = plan.add_argument_group("with --profile")
    prof.add_argument(
        "--target-rerun-rate",
        type=real(0, 1, strict_min=True, strict_max=True),
        metavar="R",
        help=f"fraction of profiled steps allowed to rerun ({pd['target_rerun_rate']}); the "
        "profile needs at least 1/R steps to measure it",
    )
    prof.add_argument(
        "--capacity-headroom",
        type=factor(1, strict_min=False),
        metavar="H",
        help="the runner's capacity_headroom, the margin te_paged's expert buffer gets over the "
        f"largest profiled need ({pd['capacity_headroom']})",
    )
    prof.add_argument(
        "--pad-multiple",
        type=integer(1),
        metavar="M",
        help="HybridEP's pad_multiple: each expert's received rows rounded up to it in the "
        f"receive budget ({pd['pad_multiple']}: none)",
    )
    prof.add_argument(
        "--host-spill",
        action="store_true",
        help="cover the tail with a host tier instead of a larger CUDA pool",
    )
    prof.add_argument(
        "--hidden", type=integer(1), help="hidden size, for the memory of each choice"
    )
    prof.add_argument(
        "--ffn", type=integer(1), help="expert FFN size, for the memory of each choice"
    )
    named = plan.add_argument_group("with --model")
    named.add_argument(
        "--skip-immediate-backward",
        action=argparse.BooleanOptionalAction,
        help="moe_paged_stash_skip_immediate_backward: the last layer, whose backward comes "
        "first, stays out of the pool (not with --ring-of-experts; default: on)",
    )
    named.add_argument(
        "--seq-length", type=integer(1), help=f"sequence length ({md['seq_length']})"
    )
    named.add_argument(
        "--micro-batch-size",
        type=integer(1),
        help=f"sequences per micro-batch ({md['micro_batch_size']})",
    )
    named.add_argument("--ep", type=integer(1), help=f"expert-parallel ranks ({md['ep']})")
    named.add_argument("--layers", type=integer(1), help="MoE layers (default: the model's)")
    knob(
        named,
        "--buffer-factor-cuda",
        type=factor(),
        metavar="F",
        help="moe_paged_stash_buffer_size_factor_cuda: the CUDA pool over the balanced case "
        f"({md['buffer_factor_cuda']})",
    )
    layout = named.add_mutually_exclusive_group()
    knob(
        layout,
        "--capacity-factor",
        type=factor(),
        metavar="F",
        help="moe_expert_rank_capacity_factor: static expert buffer rows over the balanced "
        f"case ({md['capacity_factor']})",
    )
    layout.add_argument(
        "--ring-of-experts",
        action="store_true",
        help="MaxText's layout: each rank's buffer holds all EP ranks' tokens, an effective "
        "capacity factor of EP",
    )
    knob(
        named,
        "--page-size",
        type=integer(1),
        metavar="ROWS",
        help=f"moe_paged_stash_page_size: rows per page, for the pool per stage "
        f"({md['page_size']})",
    )
    _pipeline_args(plan)


def _pipeline_args(p: argparse.ArgumentParser) -> None:
    """The pipeline layout, as Megatron-core's schedules take it (plan --model)."""
    g = p.add_argument_group(
        "pipeline parallelism, with --model: the in-flight peak and the pool of each stage"
    )
    knob(
        g,
        "--pipeline-parallel",
        type=integer(1),
        metavar="P",
        help="pipeline stages (1: no pipelining); above 1, plan adds a table per stage",
    )
    knob(
        g,
        "--virtual-stages",
        type=integer(1),
        metavar="V",
        help="model chunks per stage: Megatron-core's interleaved schedule, which every value "
        "selects, 1 included (default: none, 1F1B)",
    )
    knob(
        g,
        "--microbatches",
        type=integer(1),
        metavar="M",
        help="microbatches per step (default: the pipeline size, the fewest that fill it)",
    )
    knob(
        g,
        "--microbatch-group-size",
        type=integer(1),
        metavar="G",
        help="microbatches run back to back through one model chunk, interleaved schedule "
        "only (default: the pipeline size, Megatron's)",
    )
