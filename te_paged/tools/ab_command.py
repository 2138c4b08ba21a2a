"""``te-paged ab``: checks, ranks (spawned, or the launcher's under ``torchrun``) and outputs.

Exit status: 0 when ON and OFF are bitwise equal, 1 when they differ, 2 for a bad argument (one
line, before any rank starts), 3 when the run fails (a rank errors, stalls or dies: one line
naming it; ``--traceback`` adds the traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import logging
import os
import sys

from te_paged.tools.argtypes import check_output, given, open_output
from te_paged.tools.launch import (
    Interrupted,
    RankFailure,
    RankWatchdog,
    rendezvous_url,
    spawn_ranks,
)

__all__ = ["check_ab_args", "model_config", "run_ab_command"]

# Flags the default engine refuses (their defaults are None: the engine's config fills them in),
# the megatron engine's, three of them taken by other engines too (_TAKEN_BY).
_MEGATRON_ONLY = (
    "ep", "dropout", "overlap_grad_reduce", "seq_length", "micro_batch_size", "microbatches",
    "pipeline_parallel", "virtual_stages", "model", "runner",
)  # fmt: skip
_TAKEN_BY = {"--ep": "megatron, bridge, torchtitan or jax",
             "--seq-length": "megatron, bridge or torchtitan",
             "--micro-batch-size": "megatron, bridge or torchtitan",
             "--dropout": "megatron or bridge", "--microbatches": "megatron or bridge",
             "--overlap-grad-reduce": "megatron or bridge",
             "--pipeline-parallel": "megatron or bridge",
             "--virtual-stages": "megatron or bridge"}  # fmt: skip
#: The megatron engine's flags the bridge engine does not take (Bridge's loop fixes them).
_NOT_BRIDGE = ("model", "runner", "max_tokens_per_rank", "skew")
#: The capture step, then one step that runs with the pool: the least a saving is measured on.
MIN_STEPS = 2


def model_config(args: argparse.Namespace):
    """The engine's model config from the parsed flags (``None`` flags take its defaults)."""
    from te_paged.tools.ab_engines import AB_ENGINES

    engine = getattr(args, "engine", "default")
    megatron = engine in ("megatron", "bridge")
    cls = AB_ENGINES[engine].config()
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    kw = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    for flag, schedule in (("tokens", "token_schedule"), ("seq_length", "seq_schedule")):
        if isinstance(kw.get(flag), tuple) and schedule in fields:  # variable-length schedules
            kw[schedule] = kw[flag]
            kw[flag] = max(max(step) for step in kw[flag])
            kw.setdefault("steps", max(cls.steps, len(kw[schedule])))
    if megatron or engine == "torchtitan":
        kw.pop("tokens", None)  # seq_length x micro_batch_size
    if megatron:
        if "layers" not in kw:  # 4 per pipeline stage: a stage with fewer layers saves little
            kw["layers"] = cls.layers * kw.get("pipeline_parallel", cls.pipeline_parallel)
    return cls(**kw)


def _world(args: argparse.Namespace) -> tuple[int, bool]:
    """``(ranks, under torchrun)``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"]), True
    return args.nproc, False


def _megatron_missing(cfg) -> str | None:
    from te_paged.integrations.megatron.releases import installed_release
    from te_paged.tools.megatron_ab import quiet_megatron

    quiet_megatron()
    try:
        release = installed_release()
    except RuntimeError as e:
        return str(e)
    if cfg.model == "hybrid" and not release.hybrid_model:
        return (
            f"--model hybrid needs megatron-core 0.19.2 (HybridModel); {release.version} is "
            "installed"
        )
    if cfg.runner == "megatron" and not release.builtin_paged_stash:
        return (
            f"--runner megatron needs megatron-core 0.19.2 (Megatron's PagedStashRunner); "
            f"{release.version} is installed"
        )
    return None


def _bridge_missing() -> str | None:
    from te_paged.integrations.megatron.releases import BRIDGE_RELEASES, installed_bridge_release

    try:
        release = installed_bridge_release()
    except RuntimeError as e:
        return str(e)
    if release is None:
        version = next(reversed(BRIDGE_RELEASES))
        return (
            f"--engine bridge needs megatron-bridge {version} (on megatron-core "
            f"{BRIDGE_RELEASES[version].megatron_core}): docs/megatron-bridge.md says how to "
            "install it"
        )
    return None


def _check_pipeline(cfg, world: int) -> str | None:
    """The pipeline layout's problems, as Megatron-core 0.16.1 would refuse them."""
    pp, vpp = cfg.pipeline_parallel, cfg.virtual_stages
    if world % pp:
        return f"--pipeline-parallel {pp} does not divide the {world} ranks"
    if vpp is not None and pp == 1:
        return "--virtual-stages needs --pipeline-parallel > 1 (the interleaved schedule)"
    if vpp is not None and cfg.model == "hybrid":
        return "--virtual-stages: Megatron's HybridModel has no virtual pipeline stages"
    if cfg.layers % (pp * (vpp or 1)):
        return (
            f"--layers {cfg.layers} does not split evenly over {pp} stage(s) x {vpp or 1} "
            "virtual stage(s)"
        )
    if vpp is not None and cfg.microbatches % pp:
        return (
            f"--microbatches {cfg.microbatches}: Megatron's interleaved schedule needs a "
            f"multiple of --pipeline-parallel {pp}"
        )
    return None


def _check_outputs(args: argparse.Namespace, *more: tuple[str, object]) -> str | None:
    """``--json``, ``--plot`` (and ``more`` (flag, path) pairs): writable, not links, not
    there unless ``--force``; matplotlib for ``--plot``."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib: pip install 'te_paged[plot]'"
    try:
        for flag, path in (("--json", args.json), ("--plot", args.plot), *more):
            check_output(flag, path, args.force)
    except ValueError as e:
        return str(e)
    return None


def _check_jax_args(args: argparse.Namespace) -> str | None:
    """``--engine jax``: one process on CPU, the ring-of-experts model's flags only."""
    if args.capacity_factor is not None:
        return (
            "--capacity-factor: the jax engine's ring-of-experts buffer holds every EP rank's "
            "tokens, a capacity factor of --ep"
        )
    refused = [
        ("buffer_factor_cpu", "--buffer-factor-cpu"),
        ("fp8", "--fp8"),
        ("recompute", "--recompute"),
        ("op_fuser", "--op-fuser"),
        ("kernel_backend", "--kernel-backend"),
        ("record_profile", "--record-profile"),
        ("activation_checkpoint", "--activation-checkpoint"),
        ("compile", "--compile (te_paged.jax is compiled by XLA already)"),
        ("max_tokens_per_rank", "--max-tokens-per-rank"),
        ("skip_immediate_backward", "--skip-immediate-backward (the JAX port pages every layer)"),
    ]
    refused += [(n, f"--{n.replace('_', '-')}") for n in _MEGATRON_ONLY if n != "ep"]
    wrong = given(args, refused)
    if args.activation not in (None, "swiglu"):
        wrong.append("--activation")
    if isinstance(args.tokens, tuple):
        wrong.append("--tokens with a variable-length schedule")
    if getattr(args, "grow_capacity", None) is not None:
        wrong.append("--grow-capacity" if args.grow_capacity else "--no-grow-capacity")
    if getattr(args, "a2a_capacity_factor", None) is not None:
        wrong.append("--a2a-capacity-factor")
    if wrong:
        return f"{', '.join(wrong)}: not available with --engine jax"
    if args.device == "cuda":
        return "--device cuda: the jax engine runs on CPU (the jax extra is CPU JAX)"
    args.device = "cpu"
    if importlib.util.find_spec("jax") is None:
        return "--engine jax needs JAX: pip install 'te_paged[jax]'"
    try:
        ring = model_config(args).ring()  # the model's own checks (experts over --ep, top-k, ...)
        from te_paged.jax.moe import check_pool_rows

        check_pool_rows(ring, grow_pool=args.grow_pool is not False)
    except ValueError as e:
        return str(e)
    return _check_outputs(args)


def _check_torchtitan_args(args: argparse.Namespace) -> str | None:
    """``--engine torchtitan``: what its model and torchtitan's Trainer take."""
    if isinstance(args.seq_length, tuple) and args.compile is not None:
        return (
            "--seq-length with a variable-length schedule and --compile: not yet (every new "
            "length compiles the blocks again); run the schedule eagerly"
        )
    refused = [
        ("tokens", "--tokens"),
        ("fp8", "--fp8"),
        ("recompute", "--recompute"),
        ("op_fuser", "--op-fuser"),
        ("record_profile", "--record-profile"),
    ]
    refused += [(n, f"--{n.replace('_', '-')}") for n in _MEGATRON_ONLY
                if n not in ("ep", "seq_length", "micro_batch_size")]  # fmt: skip
    wrong = given(args, refused)
    if args.activation not in (None, "swiglu"):
        wrong.append("--activation")
    if wrong:
        return (
            f"{', '.join(wrong)}: not available with --engine torchtitan (torchtitan's "
            "GroupedExperts: SwiGLU, bf16 grouped GEMMs; its own activation checkpointing: "
            "--activation-checkpoint)"
        )
    world, _ = _world(args)
    args.device = _resolve_device(args.device, world, _world(args)[1])
    try:
        cfg = model_config(args)
    except ValueError as e:  # the engine config's own checks (a schedule's microbatches)
        return str(e)
    if cfg.steps < MIN_STEPS:
        return f"--steps {cfg.steps}: step 0 is the capture step; at least {MIN_STEPS}"
    ep = args.ep or world
    if world % ep:
        return f"--ep {ep} does not divide the {world} ranks"
    if cfg.experts % ep:
        return f"{cfg.experts} experts do not split evenly over --ep {ep}"
    if cfg.topk > cfg.experts:
        return f"--topk {cfg.topk} exceeds --experts {cfg.experts}"
    if cfg.hidden % cfg.heads:
        return f"--hidden {cfg.hidden} is not a multiple of the model's {cfg.heads} heads"
    try:
        cfg.moe_config(ep, paged=True)  # the library's own checks
    except ValueError as e:
        return str(e)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda but CUDA is not available here"
    if importlib.util.find_spec("torchtitan") is None:
        from te_paged.integrations import TORCHTITAN_INSTALL, TORCHTITAN_RELEASE

        return f"--engine torchtitan needs torchtitan {TORCHTITAN_RELEASE}: {TORCHTITAN_INSTALL}"
    return _check_outputs(args)


def _check_compile(args: argparse.Namespace) -> str | None:
    """What ``--compile`` cannot take, said before any rank starts."""
    if args.compile is None:
        return None
    if isinstance(args.tokens, tuple):
        return (
            "--tokens with a variable-length schedule and --compile: not yet (every new "
            "microbatch size compiles the MoE blocks again); run the schedule eagerly"
        )
    if args.recompute and not args.op_fuser:
        return (
            "--recompute with --compile needs --op-fuser: the unfused experts' moe_act "
            "recompute (CheckpointWithoutOutput) frees and refills storage in place, which a "
            "compiled graph does not express; the op fuser recomputes inside its own function"
        )
    if args.compile == "inductor" and args.fp8 == "mxfp8" and args.device != "cuda":
        return (
            "--fp8 mxfp8 with --compile inductor on the CPU: Inductor's CPU code has no e8m0 "
            "type (MXFP8's scales; torch 2.13); use --compile aot_eager, or CUDA"
        )
    return None


def check_ab_args(args: argparse.Namespace) -> str | None:
    """Everything the run would trip over, as one message (or None), before any rank starts."""
    if args.engine == "jax":
        return _check_jax_args(args)
    if args.engine == "torchtitan":
        return _check_torchtitan_args(args)
    megatron = args.engine in ("megatron", "bridge")
    if args.engine == "bridge":
        wrong = given(args, _NOT_BRIDGE)
        if wrong:
            return (
                f"{', '.join(wrong)}: not with --engine bridge (Bridge's pretrain() trains its "
                "GPTModel under Megatron's own PagedStashRunner; see --engine megatron)"
            )
    args.device = _resolve_device(args.device, *_world(args))
    if args.activation_checkpoint is not None:
        return "--activation-checkpoint: only with --engine torchtitan"
    if megatron and args.compile is not None:
        return (
            f"--compile: not with --engine {args.engine}, which runs its MoE eagerly (Megatron "
            "hides the launches with CUDA graphs instead)"
        )
    problem = _check_compile(args)
    if problem:
        return problem
    if not megatron:
        wrong = given(args, _MEGATRON_ONLY)
        if wrong:
            takers: dict[str, list[str]] = {}
            for flag in wrong:
                takers.setdefault(_TAKEN_BY.get(flag, "megatron"), []).append(flag)
            return "; ".join(f"{', '.join(f)}: only with --engine {e}" for e, f in takers.items())
    elif args.tokens is not None:
        return (
            f"--tokens: not with --engine {args.engine}, whose tokens per rank are --seq-length "
            "x --micro-batch-size"
        )
    elif args.max_tokens_per_rank is not None and args.runner == "megatron":
        return (
            "--max-tokens-per-rank with --runner megatron: Megatron's own PagedStashRunner "
            "sizes its pools itself; use --runner te_paged"
        )
    elif args.fp8:
        return (
            f"--fp8 is not available with --engine {args.engine} (FP8 in Megatron needs "
            "Transformer Engine); use the default engine for FP8 storage"
        )
    elif args.record_profile:
        return f"--record-profile is not available with --engine {args.engine}"
    elif args.activation not in (None, "swiglu"):
        return f"--activation: the {args.engine} engine's model uses swiglu"
    world, _ = _world(args)
    try:
        cfg = model_config(args)
    except ValueError as e:  # the engine config's own checks (a schedule's microbatches)
        return str(e)
    if cfg.steps < MIN_STEPS:
        return (
            f"--steps {cfg.steps}: step 0 is the stash's capture step (no pool yet), so "
            f"measuring the saving needs at least {MIN_STEPS} steps"
        )
    pp = cfg.pipeline_parallel if megatron else 1
    if megatron:
        problem = _check_pipeline(cfg, world)
        if problem:
            return problem
    ep = (args.ep or world // pp) if megatron else world
    if megatron and (world // pp) % ep:
        return f"--ep {ep} does not divide the {world // pp} ranks of a pipeline stage"
    if cfg.experts % ep:
        divisors = [d for d in range(1, cfg.experts + 1) if cfg.experts % d == 0]
        what = f"--ep {ep}" if megatron and args.ep else f"{ep} ranks"
        return (
            f"{cfg.experts} experts do not split evenly over {what} (expert parallelism): use "
            f"{'--ep' if megatron else '--nproc'} from {divisors}"
        )
    if cfg.topk > cfg.experts:
        return f"--topk {cfg.topk} exceeds --experts {cfg.experts}"
    try:
        cfg.moe_config(ep, paged=True)  # the library's own checks (FP8 sizes, ...)
    except ValueError as e:
        return str(e)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda but CUDA is not available here"
        if torch.cuda.device_count() < world and not _world(args)[1]:
            return f"--nproc {world} needs {world} GPUs, {torch.cuda.device_count()} found"
    if cfg.kernel_backend != "auto":  # the kernels must run on this device: fail now, not later
        import torch

        from te_paged.kernels import resolve_backend

        try:
            resolve_backend(cfg.kernel_backend, torch.device(args.device))
        except ValueError as e:
            return f"--kernel-backend {cfg.kernel_backend}: {e}"
    problem = _check_outputs(args, ("--record-profile", args.record_profile))
    if problem:
        return problem
    if megatron:
        return _megatron_missing(cfg) or (_bridge_missing() if args.engine == "bridge" else None)
    return None


def _resolve_device(device: str, world: int, under_torchrun: bool) -> str:
    """``auto``: ``cuda`` when there is a GPU for every rank (under torchrun: any GPU, the
    launcher places the ranks), else ``cpu``."""
    if device != "auto":
        return device
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return "cuda" if under_torchrun or torch.cuda.device_count() >= world else "cpu"


def _progress(rank: int, world: int, device: str, steps: int, watchdog: RankWatchdog):
    """``(progress, close)``: every rank tells its watchdog what finished; rank 0 also shows
    it, the OFF run's steps then the ON run's (see :class:`~te_paged.tools.progress.Progress`:
    a bar on a terminal, a line per step in a pipe or a log)."""
    from te_paged.tools.progress import Progress

    ranks = f"{world} rank{'s' if world > 1 else ''}"
    # Rank 0 also shows the library's warnings (the runner says them on rank 0 only).
    shown = None
    if rank == 0:
        shown = Progress(2 * steps, f"te-paged ab ({ranks}, {device})", logs="te-paged ab")

    def progress(message: str) -> None:
        watchdog.progress(message)
        if shown is not None:
            shown(message)

    return progress, (shown.close if shown is not None else lambda: None)


def _rank(
    rank: int, world: int, watchdog: RankWatchdog, init: str | None, args: argparse.Namespace
):
    """One rank's run; returns the gathered result on rank 0 (``None`` elsewhere). ``init``:
    the process group's ``init_method``; ``None`` for spawned ranks (their run's file)."""
    import torch
    import torch.distributed as dist

    from te_paged.tools.ab import gather, run_ab

    if args.engine in ("megatron", "bridge"):
        from te_paged.tools.megatron_ab import quiet_megatron

        quiet_megatron()
        if args.device == "cpu":
            from te_paged.integrations.megatron import cpu_shims

            # CPU only: stand-ins for megatron-core's CUDA-only calls (and, for Bridge, its
            # training loop's, before Bridge is imported)
            cpu_shims.install(training_loop=args.engine == "bridge")
        if args.engine == "bridge":  # Bridge's loop logs its set-up at INFO: the table is ab's
            os.environ.setdefault("MEGATRON_LOGGING_LEVEL", str(logging.WARNING))
    if args.engine == "torchtitan":
        from te_paged.tools.torchtitan_ab import quiet_torchtitan

        quiet_torchtitan()
        if args.device == "cpu":
            from te_paged.integrations.torchtitan import cpu_shims

            cpu_shims.install()  # CPU only: stand-ins for torchtitan's CUDA assumptions
    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    backend = "nccl" if args.device == "cuda" else "gloo"
    device = torch.device(args.device)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init or rendezvous_url(watchdog),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    close = None
    try:
        cfg = model_config(args)
        progress, close = _progress(rank, world, args.device, cfg.steps, watchdog)
        if args.engine == "megatron":
            from te_paged.tools.megatron_ab import run_megatron_ab

            mine = run_megatron_ab(cfg, device, progress)
        elif args.engine == "bridge":
            from te_paged.tools.bridge_ab import run_bridge_ab

            mine = run_bridge_ab(cfg, device, progress)
        elif args.engine == "torchtitan":
            from te_paged.tools.torchtitan_ab import run_torchtitan_ab

            mine = run_torchtitan_ab(cfg, device, progress)
        else:
            record = args.record_profile is not None
            mine = run_ab(cfg, dist.group.WORLD, device, progress, record_routing=record)
        result = gather(mine, cfg, dist.group.WORLD)
        # Every rank leaves together: tearing gloo down while a peer still talks to it can
        # abort the process.
        dist.barrier()
    finally:
        if close is not None:
            close()
        dist.destroy_process_group()
    return result if rank == 0 else None


def _write_outputs(args: argparse.Namespace, result) -> None:
    if args.json:
        from te_paged.tools.run_record import build_record, dumps

        # The process's own command line (under torchrun: the worker's, without torchrun's).
        with open_output("--json", args.json, args.force) as f:
            f.write(dumps(build_record(result, args.engine, sys.argv)))
    if args.plot:
        from te_paged.tools.plot import plot_ab

        with open_output("--plot", args.plot, args.force, "wb") as f:
            plot_ab(result, f, fmt=args.plot.suffix.lstrip(".") or "png")
    if args.record_profile:
        with open_output("--record-profile", args.record_profile, args.force) as f:
            f.write(result.ranks[0].routing.to_json_text())


def _run_jax(args: argparse.Namespace):
    """The jax engine: this process, no ranks (under torchrun every rank would run it alone)."""
    from te_paged.tools.jax_ab import run_jax_ab
    from te_paged.tools.progress import Progress

    cfg = model_config(args)
    shown = Progress(2 * cfg.steps, "te-paged ab (jax, 1 process, cpu)", logs="te-paged ab")
    try:
        return run_jax_ab(cfg, shown)
    finally:
        shown.close()


def preload_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """What the forkserver the ranks are forked from imports once for every rank: torch (its
    import makes no CUDA call) and this module; on the CPU also torch's ``MemTracker``, which
    measures each rank's memory there (with Dynamo and Inductor, which it imports: about 1.5 s
    of CPU a rank), and the engine's framework (``te_paged.tools.preload_megatron``,
    ``preload_bridge``, ``preload_torchtitan``), whose import can touch CUDA where there is
    one."""
    modules = ("torch", "torch.distributed", __name__)
    if args.device == "cpu":
        modules += ("torch.distributed._tools.mem_tracker",)
        if args.engine in ("megatron", "bridge", "torchtitan"):
            modules += (f"te_paged.tools.preload_{args.engine}",)
    return modules


def run_ab_command(args: argparse.Namespace) -> int:
    """The checked ``ab`` command: run, print the table, write the outputs; the exit status."""
    from te_paged.tools.ab_result import format_table

    world, under_torchrun = _world(args)
    if args.engine == "jax":
        result = _run_jax(args)
    elif under_torchrun:
        rank = int(os.environ["RANK"])
        watchdog = RankWatchdog(rank, args.timeout * 1.1 + 5).start()
        try:
            result = _rank(rank, world, watchdog, "env://", args)
        finally:
            watchdog.stop()
        if rank != 0:
            return 0
    else:
        if args.compile is not None:
            # Compiled code's memory is read from the profiler's allocation events, and the CPU
            # allocator warns once a rank that a block from before the profile was freed in it.
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        try:
            result = spawn_ranks(
                _rank, world, args.timeout * 1.1 + 5, None, args, tracebacks=args.traceback,
                preload=preload_modules(args),
            )  # fmt: skip
        except RankFailure as e:
            print(f"te-paged ab: error: {e}", file=sys.stderr)
            return 3
        except Interrupted as e:
            import signal

            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # leaving: no more
                signal.signal(signum, signal.SIG_IGN)
            print(f"te-paged ab: {e}: every rank ended, nothing written", file=sys.stderr)
            return 128 + e.signum
    if args.engine == "megatron":
        from te_paged.integrations.megatron.releases import installed_version

        cfg = model_config(args)
        driver = {"te_paged": "te_paged's MegatronPagedStashRunner",
                  "megatron": "Megatron's own PagedStashRunner"}[cfg.runner]  # fmt: skip
        model = {"gpt": "GPTModel", "hybrid": "HybridModel"}[cfg.model]
        print(f"megatron-core {installed_version()}: {model}, the step driven by {driver}\n")
    if args.engine == "bridge":
        from te_paged.integrations.megatron.releases import installed_bridge_release

        release = installed_bridge_release()
        print(
            f"megatron-bridge {release.version} (megatron-core {release.megatron_core}): "
            "Bridge's pretrain(), the step driven by Megatron's own PagedStashRunner\n"
        )
    if args.engine == "torchtitan":
        import importlib.metadata

        print(f"torchtitan {importlib.metadata.version('torchtitan')}\n")
    if args.compile is not None:
        blocks = "TransformerBlock" if args.engine == "torchtitan" else "MoE block"
        print(f"compiled: torch.compile(backend={args.compile!r}, fullgraph=True) on every "
              f"{blocks}, ON and OFF\n")  # fmt: skip
    print(format_table(result))
    _write_outputs(args, result)
    return 0 if result.equal else 1
