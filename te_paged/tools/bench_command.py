"""``te-paged bench``: stash/pop against a plain copy (fresh and fragmented free lists, every
stash backend unless ``--kernel-backend`` names one), step time ON/OFF, the host path of a
stash+pop round trip against megatron-core's (:mod:`te_paged.tools.launches`) and the compiled
kernels (:mod:`te_paged.tools.kernel_table`); dated reports."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import subprocess
import sys
from pathlib import Path

from te_paged.tools.ab_command import model_config
from te_paged.tools.argtypes import check_output, given

__all__ = ["check_bench_args", "run_bench_command"]

# Which benchmarks take which flags: the stash benchmark its grid, the step benchmark the model's
# (ModelConfig's fields); --kernel-backend both of those, --repeats all but kernels.
_STASH_ONLY = ("hidden_sizes", "token_counts")
_BOTH = ("kernel_backend",)
_KINDS = ("stash", "step", "host", "kernels")
DEFAULT_REPEATS = 7
_REPORT = {"stash": "stash", "step": "step_time", "host": "host", "kernels": "kernels"}


def _kinds(args: argparse.Namespace) -> list[str]:
    """The benchmarks to run, in the order they run (``--only``; all by default)."""
    return [kind for kind in _KINDS if args.only is None or kind in args.only]


def _reports(args: argparse.Namespace) -> list[Path]:
    today = datetime.date.today().isoformat()
    names = [f"{_REPORT[kind]}-{today}.md" for kind in _kinds(args)]
    if "kernels" in _kinds(args):
        names.append(f"kernels-{today}.json")
    return [args.out_dir / name for name in names]


def check_bench_args(args: argparse.Namespace) -> str | None:
    """A one-line problem with the flags or the output folder, or None."""
    from te_paged.tools.model import ModelConfig

    kinds = _kinds(args)
    step_only = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in _BOTH]
    # Each flag, and the benchmarks it is for: a flag none of the chosen ones takes is an error.
    for names, takers, what in (
        (step_only, {"step"}, "the step benchmark"),
        (_STASH_ONLY, {"stash"}, "the stash benchmark"),
        (_BOTH, {"stash", "step"}, "the stash and step benchmarks"),
        (("repeats",), {"stash", "step", "host"}, "the stash, step and host benchmarks"),
    ):
        flags = given(args, names)
        if flags and not takers & set(kinds):
            return f"{', '.join(flags)}: only for {what}"
    if args.repeats is None:
        args.repeats = DEFAULT_REPEATS
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda but CUDA is not available here"
    try:
        check_output("--out-dir", args.out_dir, args.force, directory=True)
        for report in _reports(args) if args.out_dir.is_dir() else []:  # else: made fresh
            check_output("--out-dir", report, args.force)
    except ValueError as e:
        return str(e)
    return None


def run_bench_command(args: argparse.Namespace) -> int:
    from te_paged.tools.bench import (
        STASH_HIDDEN_SIZES,
        STASH_TOKEN_COUNTS,
        stash_report,
        step_time_report,
    )
    from te_paged.tools.progress import Progress

    command = "te-paged " + " ".join(sys.argv[1:])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    today = datetime.date.today().isoformat()
    if "stash" in _kinds(args):
        hidden = args.hidden_sizes or STASH_HIDDEN_SIZES
        tokens = args.token_counts or STASH_TOKEN_COUNTS
        with Progress(len(hidden) * len(tokens), "te-paged bench: stash") as progress:
            report = stash_report(
                hidden,
                tokens,
                repeats=args.repeats,
                device=args.device,
                backend=args.kernel_backend,  # not given: every backend that can be timed
                command=command,
                progress=progress,
            )
        (args.out_dir / f"stash-{today}.md").write_text(report)
        print(report)
    if "step" in _kinds(args):
        with Progress(args.repeats, "te-paged bench: step time") as progress:
            report = step_time_report(
                model_config(args),
                repeats=args.repeats,
                device=args.device,
                command=command,
                progress=progress,
            )
        (args.out_dir / f"step_time-{today}.md").write_text(report)
        print(report)
    if "host" in _kinds(args):
        from te_paged.tools.launches import host_report

        report = host_report(args.repeats, command=command)
        (args.out_dir / f"host-{today}.md").write_text(report)
        print(report)
    if "kernels" in _kinds(args):
        status = _kernel_table(args.out_dir / f"kernels-{today}", command)
        if status:
            return status
    return 0


def _kernel_table(stem: Path, command: str) -> int:
    """The compiled-kernel table, in a process of its own: the kernels must be compiled, not
    interpreted, whatever ``TRITON_INTERPRET`` this process was started with."""
    out, js = stem.with_suffix(".md"), stem.with_suffix(".json")
    proc = subprocess.run(
        [sys.executable, "-m", "te_paged.tools.kernel_table", "--out", str(out), "--json",
         str(js), "--command", command],
        env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode:
        print(f"te-paged bench: the kernel table failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return 3
    print(out.read_text())
    return 0
