"""Stash+pop throughput against a plain copy of the same bytes (see te_paged.tools.bench).

    python benchmarks/bench_stash.py [--hidden-sizes ...] [--token-counts ...] \
        --out benchmarks/results/X.md

Each (hidden, tokens) is timed from three free lists (fresh, as a 1F1B schedule leaves it,
alternating free pages: te_paged.tools.free_lists) for every stash backend that can be timed
on the device. Equivalent to ``te-paged bench --only stash`` (the same flags, plus
``--capacity-factor`` for the padding table and ``--out`` for one file).
"""

from __future__ import annotations

import argparse
import sys

import torch

from te_paged.kernels import backend_choices
from te_paged.tools.bench import STASH_HIDDEN_SIZES, STASH_TOKEN_COUNTS, stash_report
from te_paged.tools.progress import Progress


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-sizes", type=int, nargs="+", default=list(STASH_HIDDEN_SIZES),
                   help="hidden sizes (%(default)s)")  # fmt: skip
    p.add_argument("--token-counts", type=int, nargs="+", default=list(STASH_TOKEN_COUNTS),
                   help="actual rows, i.e. routed tokens (%(default)s)")  # fmt: skip
    p.add_argument("--capacity-factor", type=float, default=1.5,
                   help="padding table: static rows over actual rows (%(default)s)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=7,
                   help="timed runs per case, of which the median is reported (%(default)s; on "
                   "CUDA triton.testing.do_bench's own count)")  # fmt: skip
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to run (%(default)s: cuda when available, else cpu)")  # fmt: skip
    p.add_argument("--kernel-backend", choices=backend_choices(),
                   help="time these stash kernels only (auto: Triton on CUDA, the torch "
                   "reference on CPU; default: every backend, Triton on CUDA only)")  # fmt: skip
    p.add_argument("--out", help="write the Markdown report here too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    command = "python benchmarks/bench_stash.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    cases = len(args.hidden_sizes) * len(args.token_counts)
    with Progress(cases, "bench_stash") as progress:
        report = stash_report(args.hidden_sizes, args.token_counts, capacity=args.capacity_factor,
                              repeats=args.repeats, device=args.device,
                              backend=args.kernel_backend, command=command.strip(),
                              progress=progress)  # fmt: skip
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
