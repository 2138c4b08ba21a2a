"""``te-paged``: the A/B of paged stash ON vs OFF, the buffer planner, and the benchmarks.

    te-paged ab     [--nproc 4] [model and run flags] [--json P] [--plot P] [--record-profile P]
    te-paged plan   --profile PATH [--target-rerun-rate R] [--host-spill]
    te-paged plan   --model deepseek-v3 --seq 4096 --batch 2 --ep 4 [--ring-of-experts]
    te-paged bench  [--only stash|step] [--out-dir benchmarks/results]

``ab`` starts its own ranks (gloo on CPU; ``--device cuda`` uses NCCL, one GPU per rank); under
``torchrun`` it uses the launcher's ranks instead. It exits with status 1 if paged stash ON and
OFF differ in any loss, gradient norm or gradient.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]


def _model_args(p: argparse.ArgumentParser, engines: bool = False) -> None:
    from te_paged.runtime.model import ModelConfig

    d = ModelConfig()
    g = p.add_argument_group("model and run (defaults: the embedded default model)")
    if engines:
        from te_paged.tools.megatron_ab import MegatronModelConfig

        m = MegatronModelConfig()

        def dflt(name: str) -> str:  # the two engines' defaults, resolved after parsing
            a, b = getattr(d, name), getattr(m, name)
            return f"{a}" if a == b else f"{a}; megatron engine {b}"

        sizes = {"default": None}
    else:

        def dflt(name: str) -> str:
            return f"{getattr(d, name)}"

        sizes = {}
    for flag, name, what in (
        ("--layers", "layers", "MoE layers"),
        ("--experts", "experts", "experts"),
        ("--topk", "topk", "experts per token"),
        ("--hidden", "hidden", "hidden size"),
        ("--ffn", "ffn", "expert FFN size"),
    ):
        kw = sizes or {"default": getattr(d, name)}
        g.add_argument(flag, type=int, help=f"{what} ({dflt(name)})", **kw)
    g.add_argument(
        "--tokens",
        type=int,
        default=d.tokens,
        help="tokens per rank (%(default)s; the megatron engine takes --seq-length and "
        "--micro-batch-size instead)",
    )
    g.add_argument(
        "--capacity-factor",
        type=float,
        default=d.capacity_factor,
        help="moe_expert_rank_capacity_factor (%(default)s)",
    )
    g.add_argument(
        "--buffer-factor-cuda",
        type=float,
        default=d.buffer_factor_cuda,
        help="moe_paged_stash_buffer_size_factor_cuda (%(default)s)",
    )
    g.add_argument(
        "--buffer-factor-cpu",
        type=float,
        default=d.buffer_factor_cpu,
        help="moe_paged_stash_buffer_size_factor_cpu, host tier (%(default)s)",
    )
    g.add_argument("--page-size", type=int, default=d.page_size, help="rows per page (%(default)s)")
    g.add_argument(
        "--fp8",
        choices=["tensorwise", "mxfp8"],
        default=None,
        help="FP8 storage of saved inputs (default: none; not with the megatron engine)",
    )
    g.add_argument("--recompute", action="store_true", help="selective recompute of moe_act")
    g.add_argument(
        "--op-fuser",
        action="store_true",
        help="the fused FC1-activation-FC2 path (default: unfused)",
    )
    g.add_argument("--activation", choices=["swiglu", "quick_geglu"], default=d.activation)
    g.add_argument(
        "--steps",
        type=int,
        help=f"training steps ({dflt('steps')})",
        **(sizes or {"default": d.steps}),
    )
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument(
        "--skew",
        type=float,
        default=d.skew,
        help="logit added to expert 0 on rank 0 (the megatron engine: to its routing bias), "
        "to force over-budget reruns (0)",
    )
    g.add_argument(
        "--kernel-backend", choices=["auto", "triton", "torch"], default=d.kernel_backend
    )
    if not engines:
        return
    e = p.add_argument_group("engine (--engine megatron: a Megatron-core GPTModel)")
    e.add_argument(
        "--engine",
        choices=["default", "megatron"],
        default="default",
        help="default: the embedded te_paged model; megatron: Megatron-core's GPTModel with "
        "te_paged's MoE spec, Megatron DDP, optimizer and forward_backward_func under "
        "MegatronPagedStashRunner (needs megatron-core 0.16.1)",
    )
    e.add_argument("--ep", type=int, help="expert-parallel size (default: every rank)")
    e.add_argument("--dropout", type=float, help=f"hidden and attention dropout ({m.dropout})")
    e.add_argument(
        "--seq-length", type=int, default=m.seq_length, help="sequence length (%(default)s)"
    )
    e.add_argument("--micro-batch-size", type=int, default=m.micro_batch_size, help="(%(default)s)")
    e.add_argument(
        "--microbatches",
        type=int,
        default=m.microbatches,
        help="microbatches per step, gradient accumulation (%(default)s)",
    )
    e.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Megatron DDP's overlapped gradient all-reduce",
    )


_MEGATRON_ONLY = ("ep", "dropout", "overlap_grad_reduce")


def _model_config(args: argparse.Namespace):
    from te_paged.runtime.model import ModelConfig

    megatron = getattr(args, "engine", "default") == "megatron"
    if megatron:
        from te_paged.tools.megatron_ab import MegatronModelConfig as cls
    else:
        cls = ModelConfig
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if megatron:
        kw.pop("tokens", None)  # seq_length x micro_batch_size
    return cls(**kw)


def _check_engine_args(args: argparse.Namespace) -> str | None:
    """An error message for flags the chosen engine does not take, else None."""
    if args.engine == "megatron":
        if args.fp8:
            return (
                "--fp8 is not available with --engine megatron (FP8 in Megatron needs "
                "Transformer Engine); use the default engine for FP8 storage"
            )
        return None
    given = [
        f"--{n.replace('_', '-')}" for n in _MEGATRON_ONLY if getattr(args, n) not in (None, False)
    ]
    if given:
        return f"{', '.join(given)}: only with --engine megatron"
    return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="te-paged",
        description="Paged stashing of MoE expert activations: A/B, planner, benchmarks.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    ab = sub.add_parser(
        "ab",
        help="paged stash ON vs OFF: parity, attempts, flags, memory",
        description="Run the same model and data with paged stash ON and OFF "
        "and print a table of loss, grad norm, attempts, flags and memory.",
    )
    _model_args(ab, engines=True)
    ab.add_argument("--nproc", type=int, default=4, help="ranks to start (%(default)s)")
    ab.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ab.add_argument("--json", type=Path, help="write everything as JSON here")
    ab.add_argument("--plot", type=Path, help="write a PNG of pool occupancy and memory here")
    ab.add_argument(
        "--record-profile",
        type=Path,
        help="write the OFF run's routing profile (JSON) for `te-paged plan`",
    )

    plan = sub.add_parser(
        "plan",
        help="recommend capacity and buffer factors",
        description="Recommend moe_expert_rank_capacity_factor and the stash "
        "buffer factors from a routing profile, or print a named model's "
        "sizes without running it.",
    )
    plan.add_argument(
        "--profile",
        type=Path,
        help="routing profile (.json or .csv); counts by source rank (as `ab --record-profile` "
        "and PagedStashRunner(record_routing=True) record them) make the capacity factor exact, "
        "per-expert totals a lower bound",
    )
    plan.add_argument("--target-rerun-rate", type=float, default=0.01)
    plan.add_argument(
        "--host-spill",
        action="store_true",
        help="cover the tail with a host tier instead of a larger CUDA pool",
    )
    plan.add_argument("--hidden", type=int, help="hidden size, for the memory of each choice")
    plan.add_argument("--ffn", type=int, help="expert FFN size, for the memory of each choice")
    plan.add_argument("--dtype-bytes", type=int, default=2)
    plan.add_argument("--model", choices=["deepseek-v3"], help="a named configuration")
    plan.add_argument("--seq", type=int, default=4096)
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument("--ep", type=int, default=8)
    plan.add_argument("--layers", type=int, help="MoE layers (default: the model's)")
    plan.add_argument("--capacity-factor", type=float, default=2.0)
    plan.add_argument("--buffer-factor", type=float, default=1.1)
    plan.add_argument(
        "--ring-of-experts",
        action="store_true",
        help="MaxText's layout: each rank's buffer holds all EP ranks' tokens",
    )

    bench = sub.add_parser(
        "bench",
        help="stash/pop vs plain copy; step time ON/OFF",
        description="Benchmarks, medians of several runs in one process; "
        "reports go to --out-dir with the command that produced them.",
    )
    bench.add_argument("--only", choices=["stash", "step"], help="run one of the two")
    bench.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--repeats", type=int, default=7)
    bench.add_argument("--hidden-sizes", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    bench.add_argument("--token-counts", type=int, nargs="+", default=[2048, 16384, 65536])
    _model_args(bench)
    return p


# ---------------------------------------------------------------------------------------- ab


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress_fn(rank: int):
    if rank != 0 or not sys.stderr.isatty():
        return None
    return lambda msg: print(f"\r[te-paged ab] {msg:<40}", end="", file=sys.stderr, flush=True)


def _ab_rank(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    from te_paged.runtime.ab import gather, run_ab

    if args.engine == "megatron":
        from te_paged.tools.megatron_ab import quiet_megatron

        quiet_megatron()
        if args.device == "cpu":
            from te_paged.integrations.megatron import cpu_shims

            cpu_shims.install()  # CPU only: stand-ins for megatron-core's CUDA-only calls
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = torch.device(args.device)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        cfg = _model_config(args)
        if args.engine == "megatron":
            from te_paged.tools.megatron_ab import run_megatron_ab

            mine = run_megatron_ab(cfg, device, _progress_fn(rank))
        else:
            mine = run_ab(
                cfg,
                dist.group.WORLD,
                device,
                _progress_fn(rank),
                record_routing=args.record_profile is not None,
            )
        result = gather(mine, cfg, dist.group.WORLD)
        if rank == 0:
            import pickle

            with open(out, "wb") as f:
                pickle.dump(result, f)
        # Every rank leaves together: tearing gloo down while a peer still talks to it can
        # abort the process.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn_target(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    _ab_rank(rank, world, init, args, out)
    # The rank's work is done and its result written (rank 0) after a barrier. Leave without
    # the interpreter's teardown: under load, gloo's native threads were seen to abort a
    # spawned rank at exit ("terminate called without an active exception", SIGABRT), which
    # failed a run whose result was complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _megatron_missing() -> str | None:
    """Why the megatron engine cannot run here (with the install line), or None."""
    from te_paged.integrations.megatron import cpu_shims
    from te_paged.tools.megatron_ab import quiet_megatron

    quiet_megatron()

    try:
        cpu_shims.megatron_version()
    except RuntimeError as e:
        return str(e)
    return None


def cmd_ab(args: argparse.Namespace) -> int:
    import pickle

    from te_paged.runtime.ab import format_table

    problem = _check_engine_args(args)
    if problem is None and args.engine == "megatron":
        if args.record_profile:
            problem = "--record-profile is not available with --engine megatron"
        else:
            problem = _megatron_missing()
    if problem is not None:
        print(f"te-paged ab: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pkl")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            out = os.environ.get(
                "TE_PAGED_AB_OUT",
                os.path.join(tempfile.gettempdir(), f"te_paged_ab_{os.getppid()}.pkl"),
            )
            _ab_rank(rank, world, "env://", args, out)
            if rank != 0:
                return 0
        else:
            import torch.multiprocessing as mp

            if args.nproc < 1:
                print("te-paged ab: --nproc must be >= 1", file=sys.stderr)
                return 2
            init = f"tcp://127.0.0.1:{_free_port()}"
            mp.spawn(
                _spawn_target, args=(args.nproc, init, args, out), nprocs=args.nproc, join=True
            )
        with open(out, "rb") as f:
            result = pickle.load(f)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(format_table(result))
    if args.json:
        extra = {"memory": result.memory()}
        if args.engine == "megatron":
            extra["engine"] = "megatron"
        args.json.write_text(json.dumps(dataclasses.asdict(result) | extra, indent=1))
    if args.plot:
        from te_paged.runtime.plot import plot_ab

        plot_ab(result, args.plot)
    if args.record_profile:
        result.ranks[0].routing.to_json(args.record_profile)
    return 0 if result.equal else 1


# -------------------------------------------------------------------------------------- plan


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def cmd_plan(args: argparse.Namespace) -> int:
    from te_paged.runtime import planner

    if (args.profile is None) == (args.model is None):
        print("te-paged plan: give exactly one of --profile or --model", file=sys.stderr)
        return 2
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
    profile = planner.RoutingProfile.load(args.profile)
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


# ------------------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace) -> int:
    from te_paged.runtime.bench import stash_report, step_time_report

    command = "te-paged " + " ".join(sys.argv[1:])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    today = datetime.date.today().isoformat()
    if args.only in (None, "stash"):
        report = stash_report(
            args.hidden_sizes,
            args.token_counts,
            repeats=args.repeats,
            device=args.device,
            command=command,
            progress=lambda m: print(m, file=sys.stderr),
        )
        (args.out_dir / f"stash-{today}.md").write_text(report)
        print(report)
    if args.only in (None, "step"):
        report = step_time_report(
            _model_config(args), repeats=args.repeats, device=args.device, command=command
        )
        (args.out_dir / f"step_time-{today}.md").write_text(report)
        print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"ab": cmd_ab, "plan": cmd_plan, "bench": cmd_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
