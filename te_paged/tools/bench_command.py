"""``te-paged bench``: stash/pop against a plain copy, and step time ON/OFF; dated reports."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from te_paged.tools.ab_command import model_config
from te_paged.tools.argtypes import check_output

__all__ = ["check_bench_args", "run_bench_command"]


def _reports(args: argparse.Namespace) -> list[Path]:
    today = datetime.date.today().isoformat()
    names = [f"{kind}-{today}.md" for kind in ("stash", "step_time")
             if args.only in (None, kind.split("_")[0])]  # fmt: skip
    return [args.out_dir / name for name in names]


def check_bench_args(args: argparse.Namespace) -> str | None:
    """A one-line problem with the flags or the output folder, or None."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda but CUDA is not available here"
    try:
        check_output("--out-dir", args.out_dir, args.force, directory=True)
        for report in _reports(args):
            check_output("--out-dir", report, args.force)
    except ValueError as e:
        return str(e)
    return None


def run_bench_command(args: argparse.Namespace) -> int:
    from te_paged.tools.bench import stash_report, step_time_report

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
            model_config(args), repeats=args.repeats, device=args.device, command=command
        )
        (args.out_dir / f"step_time-{today}.md").write_text(report)
        print(report)
    return 0
