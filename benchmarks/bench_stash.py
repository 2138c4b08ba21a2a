"""Stash+pop throughput against a plain copy of the same bytes (see te_paged.tools.bench).

    python benchmarks/bench_stash.py [--hidden ...] [--tokens ...] --out benchmarks/results/X.md

Equivalent to ``te-paged bench --only stash``.
"""

from __future__ import annotations

import argparse
import sys

from te_paged.tools.bench import stash_report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 16384, 65536])
    p.add_argument("--capacity", type=float, default=1.5, help="static rows / actual rows")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--out", help="write the Markdown report here too")
    args = p.parse_args(argv)
    command = "python benchmarks/bench_stash.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    report = stash_report(args.hidden, args.tokens, capacity=args.capacity, repeats=args.repeats,
                          device=args.device, backend=args.backend, command=command.strip(),
                          progress=lambda m: print(m, file=sys.stderr))  # fmt: skip
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
