"""``te-paged``: the A/B of paged stash ON vs OFF, the buffer planner, and the benchmarks.

    te-paged ab     [--nproc 4] [model and run flags] [--json P] [--plot P] [--record-profile P]
    te-paged ab     --engine megatron [--ep 2] [--dropout 0.1] [--overlap-grad-reduce]
                    [--pipeline-parallel 2 [--virtual-stages 2]] [--microbatches 4] ...
    te-paged ab     --engine bridge [--ep 2] [--dropout 0.1] ...  (Megatron-Bridge's pretrain())
    te-paged ab     --engine jax [--ep 4] [model and run flags]   (one process, CPU)
    te-paged ab     --engine torchtitan [--ep 2] [--activation-checkpoint selective] ...
    te-paged plan   --profile PATH [--target-rerun-rate R] [--capacity-headroom H]
                    [--pad-multiple M] [--host-spill]
    te-paged plan   --model deepseek-v3 --seq-length 4096 --micro-batch-size 2 --ep 4 \
                    [--ring-of-experts | --capacity-factor F] \
                    [--pipeline-parallel P [--virtual-stages V] [--microbatches M]]
    te-paged bench  [--only stash step host kernels] [--out-dir benchmarks/results]
    te-paged --version

One flag per knob across the three commands (``--capacity-factor``, ``--buffer-factor-cuda``,
``--buffer-factor-cpu``, ``--page-size``, ``--seq-length``, ``--micro-batch-size``, ``--ep``,
``--layers``, ``--hidden``, ``--ffn``, ``--microbatches``, ``--pipeline-parallel``, ...,
``--kernel-backend``, ``--device``), each parsed into the attribute of its own name; the stash
and pipeline knobs also answer to Megatron's names (:data:`MEGATRON_ALIASES`), so a Megatron
command line's values can be pasted as they are.

``ab`` starts its own ranks (gloo on CPU; on CUDA NCCL, one GPU per rank; ``--device auto``, the
default, takes CUDA when there is a GPU for every rank); under ``torchrun`` it uses the
launcher's ranks instead. Exit status: 0, ON and OFF bitwise equal (or the command succeeded);
1, ON and OFF differ; 2, a bad argument (one line, before any work: also an output that exists,
unless ``--force``, or cannot be written, or is a symbolic link); 3, the run failed (a rank
errored, stalled or died: one line naming it; ``--traceback`` prints the traceback); 128 + the
signal's number after SIGINT (twice is fine), SIGTERM or SIGHUP, at any moment: every rank ended,
the temporary directory removed, nothing written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from te_paged._lazy import torch_installed
from te_paged.tools.argtypes import (
    MEGATRON_ALIASES,
    OneLineParser,
    factor,
    integer,
    knob,
    real,
    token_schedule,
)

__all__ = ["MEGATRON_ALIASES", "main"]

#: Megatron's names of each knob, accepted as aliases of te_paged's: Megatron-LM's command-line
#: flag, and for the pipeline layout also Megatron-core's name (``ModelParallelConfig``'s
#: ``virtual_pipeline_model_parallel_size``, ``forward_backward_func``'s ``num_microbatches``).


def _defaults(engines: bool) -> Callable[..., str]:
    """``dflt(field, among=None)``: a field's default as the help says it: the default
    engine's, and where ``engines``, each other registered engine's (of ``among``, or all) that
    differs, on a field it has."""
    from te_paged.tools.ab_engines import AB_ENGINES

    configs = {name: e.config()() for name, e in AB_ENGINES.items()} if engines else {}
    d = configs.get("default") or AB_ENGINES["default"].config()()

    def dflt(name: str, among: tuple[str, ...] | None = None) -> str:
        text = f"{getattr(d, name)}"
        for engine, cfg in configs.items():
            if engine == "default" or (among is not None and engine not in among):
                continue
            fields = {f.name for f in dataclasses.fields(cfg) if f.init}
            if name in fields and getattr(cfg, name) != getattr(d, name):
                text += f"; {engine} engine {getattr(cfg, name)}"
            if engine == "megatron" and name == "layers":  # see ab_command.model_config
                text += " per pipeline stage"
        return text

    return dflt


def _model_args(p: argparse.ArgumentParser, engines: bool = False) -> None:
    """The model and run flags of ``ab`` (``engines``: with every engine's) and of ``bench``'s
    step benchmark. Every default is None: the engine's config fills it in, so a flag that was
    given can be told apart from one that was not (see the ``check_*_args``)."""
    dflt = _defaults(engines)
    if engines:
        title = "model and run (defaults: the embedded default model)"
    else:
        title = "step benchmark: the ab model (defaults: the embedded default model)"
    g = p.add_argument_group(title)
    _shape_args(g, dflt, engines)
    _stash_args(g, dflt, engines)
    g.add_argument("--seed", type=integer(0), help=f"seed of weights and data ({dflt('seed', ())})")
    if engines:
        _run_args(g, dflt)
        _engine_args(p)


def _shape_args(g, dflt: Callable[..., str], engines: bool) -> None:
    for flag, name, what in (
        ("--layers", "layers", "MoE layers"),
        ("--experts", "experts", "experts"),
        ("--topk", "topk", "experts per token"),
        ("--hidden", "hidden", "hidden size"),
        ("--ffn", "ffn", "expert FFN size"),
    ):
        g.add_argument(flag, type=integer(1), help=f"{what} ({dflt(name)})")
    if not engines:
        g.add_argument("--tokens", type=integer(1), help=f"tokens per rank ({dflt('tokens')})")
        return
    # The megatron and torchtitan engines' tokens are --seq-length x --micro-batch-size.
    base = dflt("tokens", ())
    tokens = (f"{base}; not with --engine megatron or torchtitan, which take --seq-length and "
              f"--micro-batch-size{dflt('tokens', ('jax',)).removeprefix(base)}")  # fmt: skip
    g.add_argument(
        "--tokens",
        type=token_schedule,
        metavar="N[,N...]",
        help=f"tokens per rank ({tokens}); a variable-length schedule on "
        "the default engine: steps separated by commas, a step's microbatches by + (e.g. "
        "256,1024,512 or 256+256,1024+128), the list repeated over --steps",
    )


def _stash_args(g, dflt: Callable[..., str], engines: bool) -> None:
    knob(
        g,
        "--capacity-factor",
        type=factor(),
        metavar="F",
        help=f"moe_expert_rank_capacity_factor: static expert buffer rows over the balanced "
        f"case ({dflt('capacity_factor')})",
    )
    if engines:
        g.add_argument(
            "--a2a-capacity-factor",
            type=factor(),
            metavar="F",
            help="moe_a2a_capacity_factor: the rows te_paged's all-to-all sends each rank over "
            "the balanced case, at most --capacity-factor; the runner raises it as routing "
            "needs (default: auto, --capacity-factor until the largest pair demand stops "
            "rising, at most 8 steps, then that demand x 1.10; not with the jax engine)",
        )
    knob(
        g,
        "--buffer-factor-cuda",
        type=factor(),
        metavar="F",
        help="moe_paged_stash_buffer_size_factor_cuda: the CUDA pool over the balanced case "
        f"({dflt('buffer_factor_cuda')})",
    )
    knob(
        g,
        "--buffer-factor-cpu",
        type=factor(0, strict_min=False),
        metavar="F",
        help="moe_paged_stash_buffer_size_factor_cpu: the host tier, 0 for none "
        f"({dflt('buffer_factor_cpu')})",
    )
    knob(
        g,
        "--page-size",
        type=integer(1),
        metavar="ROWS",
        help=f"moe_paged_stash_page_size: rows per page ({dflt('page_size')})",
    )
    _layer_args(g, dflt, engines)


def _layer_args(g, dflt: Callable[..., str], engines: bool) -> None:
    from te_paged.tools.engine_configs import ModelConfig

    g.add_argument(
        "--fp8",
        choices=["tensorwise", "mxfp8", "nvfp4"],
        help="FP8 (or NVFP4, 4.5 bits an element) storage of saved inputs (default: none"
        + ("; not with the megatron engine)" if engines else ")"),
    )
    g.add_argument("--recompute", action="store_true", help="selective recompute of moe_act")
    g.add_argument(
        "--skip-immediate-backward",
        action=argparse.BooleanOptionalAction,
        help="moe_paged_stash_skip_immediate_backward: keep unpaged the tensors of the layer "
        "whose backward follows its forward at once (the last MoE layer) "
        f"(default: {'on' if ModelConfig().skip_immediate_backward else 'off'})",
    )
    g.add_argument(
        "--op-fuser",
        action="store_true",
        help="the fused FC1-activation-FC2 path (default: unfused)",
    )
    gated = gated_activations()  # the model is a GLU
    g.add_argument(
        "--activation",
        choices=gated,
        metavar="NAME",
        help=f"gated expert activation: {', '.join(gated)} ({dflt('activation')}"
        + ("; the megatron engine: swiglu only)" if engines else ")"),
    )
    if engines:  # bench: a flag of both benchmarks, see _bench_parser
        _kernel_backend(g)


def _run_args(g, dflt: Callable[..., str]) -> None:
    """``ab``'s steps and the runner's growth."""
    g.add_argument("--steps", type=integer(1), help=f"training steps ({dflt('steps')})")
    g.add_argument(
        "--skew",
        type=real(-1e4, 1e4),
        help="logit added to expert 0 on rank 0 (the megatron engine: to its routing bias; "
        "jax: to its router logit, expert 0 being local), "
        f"to force over-budget reruns ({float(dflt('skew', ())):g}: none)",
    )
    g.add_argument(
        "--grow-pool",
        action=argparse.BooleanOptionalAction,
        help="the runner's grow_pool: pools keep the largest need seen x 1.10, grown after the "
        "capture step, an overflow, or a step that left less headroom (default: on); "
        "--no-grow-pool keeps the pools as the buffer factors size them (the jax engine "
        "too: its first step plays the capture step)",
    )
    g.add_argument(
        "--max-tokens-per-rank",
        type=integer(1),
        metavar="N",
        help="moe_max_tokens_per_rank: the largest microbatch any step brings, "
        "declared up front, so that the capture step sizes the pools for it and no larger "
        "step reruns (default: none; the pools grow at each new maximum; not with the jax "
        "engine or --runner megatron)",
    )
    g.add_argument(
        "--grow-capacity",
        action=argparse.BooleanOptionalAction,
        help="the runner's grow_capacity: the all-to-all's wire budget keeps the largest pair "
        "demand seen x 1.10, set once the demand stops rising (at most 8 steps) when "
        "--a2a-capacity-factor is not given, raised after a step over budget or a step that "
        "left less headroom (default: on); "
        "--no-grow-capacity keeps it at --a2a-capacity-factor (not with the jax engine)",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    """``--engine`` and the flags several engines take, then each registered engine's group."""
    from te_paged.tools.ab_engines import AB_ENGINES
    from te_paged.tools.engine_configs import MegatronModelConfig

    m = MegatronModelConfig()
    shorts = "; ".join(f"--engine {e.name}: {e.short}" for e in AB_ENGINES.values() if e.short)
    e = p.add_argument_group(f"engine ({shorts})")
    e.add_argument(
        "--engine",
        choices=list(AB_ENGINES),
        default="default",
        help="; ".join(f"{x.name}: {x.summary}" for x in AB_ENGINES.values()),
    )
    e.add_argument(
        "--ep",
        type=integer(1),
        help="expert-parallel size (megatron, bridge: default every rank of a stage; "
        "torchtitan: default every rank, the rest data parallel; jax: the ring's size and the "
        "capacity factor, default 4; not with the default engine)",
    )
    e.add_argument(
        "--seq-length",
        type=token_schedule,
        metavar="N[,N...]",
        help=f"sequence length ({m.seq_length}; megatron, bridge and torchtitan only); a "
        "variable-length schedule on the megatron engine (megatron-core's "
        "variable_seq_lengths): steps separated by commas, a step's microbatches by + (one "
        "length: every microbatch of the step), e.g. 32,64+32",
    )
    e.add_argument(
        "--micro-batch-size",
        type=integer(1),
        help=f"sequences per microbatch ({m.micro_batch_size}; megatron, bridge and torchtitan "
        "only)",
    )
    e.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        choices=COMPILE_BACKENDS,
        metavar="BACKEND",
        help="torch.compile every MoE block (torchtitan: its compile.enable, each "
        "TransformerBlock) with fullgraph=True, ON and OFF alike: "
        f"{' or '.join(COMPILE_BACKENDS)} (the flag alone: inductor; default and torchtitan "
        "engines; memory then from the allocator's running total, docs/configuration.md)",
    )
    for engine in AB_ENGINES.values():
        if engine.arguments is not None:
            engine.arguments(p.add_argument_group(engine.title))


#: torch.compile backends ``ab --compile`` takes.
COMPILE_BACKENDS = ("inductor", "aot_eager")

#: The built-in choices where torch (and so the registries) cannot be imported: the parser
#: still builds, for the commands that need no torch (tests hold them to the registries).
BUILTIN_GATED_ACTIVATIONS = ("swiglu", "geglu", "quick_geglu", "reglu", "squared_reglu")
BUILTIN_BACKENDS = ("auto", "torch", "triton")


def gated_activations() -> list[str]:
    """The registered gated activations (the built-in ones without torch)."""
    if not torch_installed():
        return list(BUILTIN_GATED_ACTIVATIONS)
    from te_paged.grouped.activations import ACTIVATIONS

    return [name for name, spec in ACTIVATIONS.items() if spec.gated]


def kernel_backends() -> tuple[str, ...]:
    """Every valid ``--kernel-backend`` (the built-in ones without torch)."""
    if not torch_installed():
        return BUILTIN_BACKENDS
    from te_paged.kernels import backend_choices

    return backend_choices()


def _kernel_backend(p, extra: str = "") -> None:
    from te_paged.tools.engine_configs import ModelConfig

    p.add_argument(
        "--kernel-backend",
        choices=kernel_backends(),
        help=f"stash kernels, a registered backend ({ModelConfig().kernel_backend}: Triton on "
        f"CUDA, the torch reference on CPU){extra}",
    )


def _device(p, what: str) -> None:
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help=f"where to run (%(default)s: {what})",
    )


def _ab_parser(sub, common: argparse.ArgumentParser) -> None:
    ab = sub.add_parser(
        "ab",
        parents=[common],
        help="paged stash ON vs OFF: parity, attempts, flags, memory",
        description="Run the same model and data with paged stash ON and OFF "
        "and print a table of loss, grad norm, attempts, flags and memory.",
    )
    _model_args(ab, engines=True)
    run = ab.add_argument_group("ranks and outputs")
    run.add_argument(
        "--nproc",
        type=integer(1),
        default=4,
        help="ranks to start (%(default)s; under torchrun the launcher's ranks instead; the "
        "jax engine runs one process and ignores it)",
    )
    _device(run, "cuda, with NCCL, when there is a GPU for every rank, else cpu, with gloo")
    run.add_argument(
        "--timeout",
        type=real(1, 1e6),
        default=300.0,
        help="seconds a rank may wait for the others (process-group timeout and watchdog; "
        "%(default)s): a stalled or dead rank then ends the run, named, exit status 3",
    )
    run.add_argument("--json", type=Path, help="write everything as JSON here")
    run.add_argument("--plot", type=Path, help="write a PNG of pool occupancy and memory here")
    run.add_argument("--force", action="store_true", help="overwrite existing output files")


def _bench_parser(sub, common: argparse.ArgumentParser) -> None:
    from te_paged.tools.engine_configs import STASH_HIDDEN_SIZES, STASH_TOKEN_COUNTS

    bench = sub.add_parser(
        "bench",
        parents=[common],
        help="stash/pop vs plain copy; step time ON/OFF; host path; compiled kernels",
        description="Benchmarks, medians of several runs in one process "
        "(torch.utils.benchmark.Timer; the stash kernels on CUDA: triton.testing.do_bench); "
        "reports go to --out-dir with the command that produced them. stash: stash+pop vs a "
        "plain copy; step: step time ON/OFF; host: the host microseconds of a stash+pop round "
        "trip with the kernel launches stubbed, te_paged's and megatron-core's; kernels: every "
        "Triton kernel te_paged launches compiled for sm_90 and sm_100 (no GPU needed), with "
        "megatron-core's (registers, spills, access widths, SASS instructions per byte).",
    )
    bench.add_argument(
        "--only",
        choices=["stash", "step", "host", "kernels"],
        nargs="+",
        help="run these (default: all four)",
    )
    bench.add_argument(
        "--out-dir",
        type=Path,
        default=Path("benchmarks/results"),
        help="where the dated reports go (%(default)s)",
    )
    bench.add_argument("--force", action="store_true", help="overwrite today's reports")
    _device(bench, "cuda when available, else cpu")
    _kernel_backend(
        bench,
        "; the stash benchmark times every backend that runs on the device unless this names "
        "one (Triton only on CUDA)",
    )
    bench.add_argument(
        "--repeats",
        type=integer(1),
        help="timed runs per case, of which the median is reported (7; the stash "
        "benchmark on CUDA times with triton.testing.do_bench's own count instead; the host "
        "benchmark: rounds of 2000 round trips)",
    )
    grid = bench.add_argument_group("stash benchmark")
    grid.add_argument(
        "--hidden-sizes",
        type=integer(1),
        nargs="+",
        help=f"hidden sizes ({' '.join(map(str, STASH_HIDDEN_SIZES))})",
    )
    grid.add_argument(
        "--token-counts",
        type=integer(1),
        nargs="+",
        help=f"actual rows, i.e. routed tokens ({' '.join(map(str, STASH_TOKEN_COUNTS))})",
    )
    _model_args(bench)


def _parser() -> argparse.ArgumentParser:
    from te_paged._version import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--traceback", action="store_true", help="on a failure, also print the traceback"
    )
    p = OneLineParser(
        prog="te-paged",
        description="Paged stashing of MoE expert activations: A/B, planner, benchmarks.",
    )
    p.add_argument(
        "--version",
        action="version",
        version=f"te_paged {__version__}",
        help="print te_paged's version and exit",
    )
    sub = p.add_subparsers(
        dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND"
    )
    _ab_parser(sub, common)
    from te_paged.tools.plan_command import add_plan_parser

    add_plan_parser(sub, common)
    _bench_parser(sub, common)
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
    torch_only = args.command == "bench" or (args.command == "ab" and args.engine != "jax")
    if torch_only and not torch_installed():
        what = prog if args.command == "bench" else f"{prog} --engine {args.engine}"
        print(f"{prog}: error: {what} needs PyTorch, which is not installed here: pip install "
              "'te_paged[torch]' (te-paged plan and te-paged ab --engine jax run without it)",
              file=sys.stderr)  # fmt: skip
        return 2
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


def entry() -> None:
    """The ``te-paged`` program: :func:`main`'s status, as a rank of torchrun's (``RANK`` and
    ``WORLD_SIZE`` set) without the interpreter's teardown
    (:func:`te_paged.tools.launch.leave`)."""
    status = main()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from te_paged.tools.launch import leave

        leave(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
