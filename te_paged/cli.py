"""``te-paged``: the A/B of paged stash ON vs OFF, the buffer planner, and the benchmarks.

    te-paged ab     [--nproc 4] [model and run flags] [--json P] [--plot P] [--record-profile P]
    te-paged ab     --engine megatron [--ep 2] [--dropout 0.1] [--overlap-grad-reduce] ...
    te-paged plan   --profile PATH [--target-rerun-rate R] [--host-spill]
    te-paged plan   --model deepseek-v3 --seq 4096 --batch 2 --ep 4 [--ring-of-experts]
    te-paged bench  [--only stash|step] [--out-dir benchmarks/results]

``ab`` starts its own ranks (gloo on CPU; ``--device cuda`` uses NCCL, one GPU per rank); under
``torchrun`` it uses the launcher's ranks instead. Exit status: 0, ON and OFF bitwise equal (or
the command succeeded); 1, ON and OFF differ; 2, a bad argument (one line, before any work: also
an output that exists, unless ``--force``, or cannot be written); 3, the run failed (a rank
errored, stalled or died: one line naming it; ``--traceback`` prints the traceback).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from te_paged.tools.argtypes import OneLineParser, integer, real

__all__ = ["main"]


def _model_args(p: argparse.ArgumentParser, engines: bool = False) -> None:
    from te_paged.tools.model import ModelConfig

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
        g.add_argument(flag, type=integer(1), help=f"{what} ({dflt(name)})", **kw)
    g.add_argument(
        "--tokens",
        type=integer(1),
        default=d.tokens,
        help="tokens per rank (%(default)s; the megatron engine takes --seq-length and "
        "--micro-batch-size instead)",
    )
    g.add_argument(
        "--capacity-factor",
        type=real(0, strict_min=True),
        default=d.capacity_factor,
        help="moe_expert_rank_capacity_factor (%(default)s)",
    )
    g.add_argument(
        "--buffer-factor-cuda",
        type=real(0, strict_min=True),
        default=d.buffer_factor_cuda,
        help="moe_paged_stash_buffer_size_factor_cuda (%(default)s)",
    )
    g.add_argument(
        "--buffer-factor-cpu",
        type=real(0),
        default=d.buffer_factor_cpu,
        help="moe_paged_stash_buffer_size_factor_cpu, host tier (%(default)s)",
    )
    g.add_argument(
        "--page-size", type=integer(1), default=d.page_size, help="rows per page (%(default)s)"
    )
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
    g.add_argument(
        "--activation",
        choices=["swiglu", "quick_geglu"],
        default=d.activation,
        help="gated expert activation (%(default)s)",
    )
    g.add_argument(
        "--steps",
        type=integer(1),
        help=f"training steps ({dflt('steps')})",
        **(sizes or {"default": d.steps}),
    )
    g.add_argument("--seed", type=integer(0), default=d.seed, help="(%(default)s)")
    g.add_argument(
        "--skew",
        type=real(),
        default=d.skew,
        help="logit added to expert 0 on rank 0 (the megatron engine: to its routing bias), "
        "to force over-budget reruns (0)",
    )
    g.add_argument(
        "--kernel-backend",
        choices=["auto", "triton", "torch"],
        default=d.kernel_backend,
        help="stash kernels (%(default)s: Triton on CUDA, the torch reference on CPU)",
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
    e.add_argument("--ep", type=integer(1), help="expert-parallel size (default: every rank)")
    e.add_argument(
        "--dropout",
        type=real(0, 1, strict_max=True),
        help=f"hidden and attention dropout ({m.dropout})",
    )
    e.add_argument(
        "--seq-length", type=integer(1), default=m.seq_length, help="sequence length (%(default)s)"
    )
    e.add_argument(
        "--micro-batch-size",
        type=integer(1),
        default=m.micro_batch_size,
        help="sequences per microbatch (%(default)s)",
    )
    e.add_argument(
        "--microbatches",
        type=integer(1),
        default=m.microbatches,
        help="microbatches per step, gradient accumulation (%(default)s)",
    )
    e.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Megatron DDP's overlapped gradient all-reduce",
    )


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--traceback", action="store_true", help="on a failure, also print the traceback"
    )
    p = OneLineParser(
        prog="te-paged",
        description="Paged stashing of MoE expert activations: A/B, planner, benchmarks.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    ab = sub.add_parser(
        "ab",
        parents=[common],
        help="paged stash ON vs OFF: parity, attempts, flags, memory",
        description="Run the same model and data with paged stash ON and OFF "
        "and print a table of loss, grad norm, attempts, flags and memory.",
    )
    _model_args(ab, engines=True)
    run = ab.add_argument_group("ranks and outputs")
    run.add_argument("--nproc", type=integer(1), default=4, help="ranks to start (%(default)s)")
    run.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="(%(default)s; cuda: NCCL)"
    )
    run.add_argument(
        "--timeout",
        type=real(1),
        default=300.0,
        help="seconds a rank may wait for the others (process-group timeout and watchdog; "
        "%(default)s): a stalled or dead rank then ends the run, named, exit status 3",
    )
    run.add_argument("--json", type=Path, help="write everything as JSON here")
    run.add_argument("--plot", type=Path, help="write a PNG of pool occupancy and memory here")
    run.add_argument(
        "--record-profile",
        type=Path,
        help="write the OFF run's routing profile (JSON) for `te-paged plan`",
    )
    run.add_argument("--force", action="store_true", help="overwrite existing output files")

    plan = sub.add_parser(
        "plan",
        parents=[common],
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
    plan.add_argument(
        "--target-rerun-rate",
        type=real(0, 1, strict_min=True, strict_max=True),
        default=0.01,
        help="fraction of profiled steps allowed to rerun (%(default)s)",
    )
    plan.add_argument(
        "--host-spill",
        action="store_true",
        help="cover the tail with a host tier instead of a larger CUDA pool",
    )
    plan.add_argument(
        "--hidden", type=integer(1), help="hidden size, for the memory of each choice"
    )
    plan.add_argument(
        "--ffn", type=integer(1), help="expert FFN size, for the memory of each choice"
    )
    plan.add_argument(
        "--dtype-bytes",
        type=int,
        choices=[1, 2, 4],
        default=2,
        help="bytes per stashed element: 1 FP8, 2 bf16, 4 fp32 (%(default)s)",
    )
    plan.add_argument("--model", choices=["deepseek-v3"], help="a named configuration")
    plan.add_argument("--seq", type=integer(1), default=4096, help="sequence length (%(default)s)")
    plan.add_argument("--batch", type=integer(1), default=1, help="micro-batch size (%(default)s)")
    plan.add_argument(
        "--ep", type=integer(1), default=8, help="expert-parallel ranks (%(default)s)"
    )
    plan.add_argument("--layers", type=integer(1), help="MoE layers (default: the model's)")
    plan.add_argument(
        "--capacity-factor",
        type=real(0, strict_min=True),
        default=2.0,
        help="moe_expert_rank_capacity_factor (%(default)s)",
    )
    plan.add_argument(
        "--buffer-factor",
        type=real(0, strict_min=True),
        default=1.1,
        help="moe_paged_stash_buffer_size_factor_cuda (%(default)s)",
    )
    plan.add_argument(
        "--ring-of-experts",
        action="store_true",
        help="MaxText's layout: each rank's buffer holds all EP ranks' tokens",
    )

    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="stash/pop vs plain copy; step time ON/OFF",
        description="Benchmarks, medians of several runs in one process; "
        "reports go to --out-dir with the command that produced them.",
    )
    bench.add_argument("--only", choices=["stash", "step"], help="run one of the two")
    bench.add_argument(
        "--out-dir",
        type=Path,
        default=Path("benchmarks/results"),
        help="where the dated reports go (%(default)s)",
    )
    bench.add_argument("--force", action="store_true", help="overwrite today's reports")
    bench.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="(%(default)s)")
    bench.add_argument(
        "--repeats", type=integer(1), default=7, help="timed runs per case (%(default)s)"
    )
    bench.add_argument(
        "--hidden-sizes",
        type=integer(1),
        nargs="+",
        default=[1024, 2048, 4096, 7168],
        help="stash benchmark: hidden sizes (%(default)s)",
    )
    bench.add_argument(
        "--token-counts",
        type=integer(1),
        nargs="+",
        default=[2048, 16384, 65536],
        help="stash benchmark: tokens (%(default)s)",
    )
    _model_args(bench)
    return p


def main(argv: list[str] | None = None) -> int:
    from te_paged.tools import ab_command, bench_command, plan_command

    args = _parser().parse_args(argv)  # a bad value exits 2 with one line
    check, run = {
        "ab": (ab_command.check_ab_args, ab_command.run_ab_command),
        "plan": (plan_command.check_plan_args, plan_command.run_plan_command),
        "bench": (bench_command.check_bench_args, bench_command.run_bench_command),
    }[args.command]
    prog = f"te-paged {args.command}"
    problem = check(args)
    if problem is not None:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a runtime failure: one line (and the traceback if asked)
        if args.traceback:
            traceback.print_exc()
        line = f"{type(e).__name__}: {e}".splitlines()[0]
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
