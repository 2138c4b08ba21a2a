"""``te-paged bench``: stash/pop against a plain copy (fresh and fragmented free lists, every
stash backend unless ``--kernel-backend`` names one), and step time ON/OFF; dated reports."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
from pathlib import Path

from te_paged.tools.ab_command import model_config
from te_paged.tools.argtypes import check_output

__all__ = ["check_bench_args", "run_bench_command"]

# The stash benchmark's own flags; the step benchmark takes the model's (ModelConfig's fields),
# and both take --device, --repeats and --kernel-backend.
_STASH_ONLY = ("hidden_sizes", "token_counts")
_BOTH = ("kernel_backend",)


def _reports(args: argparse.Namespace) -> list[Path]:
    today = datetime.date.today().isoformat()
    names = [f"{kind}-{today}.md" for kind in ("stash", "step_time")
             if args.only in (None, kind.split("_")[0])]  # fmt: skip
    return [args.out_dir / name for name in names]


def _given(args: argparse.Namespace, names) -> list[str]:
    return [
        f"--{n.replace('_', '-')}" for n in names if getattr(args, n, None) not in (None, False)
    ]


def check_bench_args(args: argparse.Namespace) -> str | None:
    """A one-line problem with the flags or the output folder, or None."""
    from te_paged.tools.model import ModelConfig

    step_only = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in _BOTH]
    if args.only == "stash" and _given(args, step_only):
        return f"{', '.join(_given(args, step_only))}: only for the step benchmark"
    if args.only == "step" and _given(args, _STASH_ONLY):
        return f"{', '.join(_given(args, _STASH_ONLY))}: only for the stash benchmark"
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
    if args.only in (None, "stash"):
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
    if args.only in (None, "step"):
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
    return 0
