"""Stash+pop throughput of the paged-stash kernels against a plain ``copy_`` of the same bytes.

For each (hidden, tokens) the stash copies the actual rows into pool pages and the pop copies them
back; the baseline is two ``Tensor.copy_`` calls moving the same rows the same way. Reported:
medians over ``--repeats`` runs in one process, and their ratio (baseline time / stash time,
so 1.0 = as fast as a plain copy). A second table measures what zeroing the padding rows on
reload costs when the static buffer is ``--capacity`` times the actual rows.

    python benchmarks/bench_stash.py --out benchmarks/results/stash-<date>.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import sys
import time

import torch

from te_paged.kernels import KernelBackend, resolve_backend, stash_copy, stash_pop
from te_paged.kernels.layout import FLAGS_LEN, META_LEN
from te_paged.stash import PagedStashBuffer, StashKey, storage_dtype


@dataclasses.dataclass
class Case:
    hidden: int
    tokens: int
    max_rows: int
    dtype: torch.dtype = torch.bfloat16
    page_size: int = 64


@dataclasses.dataclass
class Result:
    case: Case
    copy_s: float
    stash_s: float
    stash_nozero_s: float

    @property
    def gbytes(self) -> float:
        return self.case.tokens * self.case.hidden * self.case.dtype.itemsize / 1e9


def _median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_case(case: Case, repeats: int, device: torch.device, backend: KernelBackend) -> Result:
    bits = storage_dtype(case.dtype)
    src = torch.randn(case.max_rows, case.hidden, device=device).to(case.dtype).view(bits)
    dst = torch.empty_like(src)
    pages = -(-case.tokens // case.page_size)
    buf = PagedStashBuffer(StashKey(case.dtype, case.hidden), pages, case.page_size, device)
    flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=device)
    rec = torch.empty(-(-case.max_rows // case.page_size), dtype=torch.int32, device=device)
    meta = torch.empty(META_LEN, dtype=torch.int64, device=device)
    n = torch.tensor([case.tokens], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    plain_pool = buf.pool_NH[: case.tokens]

    def plain() -> None:
        plain_pool.copy_(src[: case.tokens])
        dst[: case.tokens].copy_(plain_pool)

    def paged(zero: bool) -> None:
        stash_copy(backend, src, n, 1, case.page_size, *buf.kernel_args(), flags, rec, meta)
        stash_pop(backend, dst, case.page_size, *buf.kernel_args(), flags, rec, meta, zero)

    copy_s = _median_time(plain, repeats, sync)
    stash_s = _median_time(lambda: paged(True), repeats, sync)
    stash_nozero_s = _median_time(lambda: paged(False), repeats, sync)
    assert torch.equal(dst[: case.tokens], src[: case.tokens])
    assert int(flags.sum()) == 0
    return Result(case, copy_s, stash_s, stash_nozero_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048, 4096, 7168])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 16384, 65536])
    p.add_argument("--capacity", type=float, default=1.5, help="static rows / actual rows")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto", choices=[b.value for b in KernelBackend])
    p.add_argument("--out", help="write the Markdown report here too")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    backend = resolve_backend(args.backend, device)

    full, padded = [], []
    for hidden in args.hidden:
        for tokens in args.tokens:
            full.append(run_case(Case(hidden, tokens, tokens), args.repeats, device, backend))
            max_rows = int(tokens * args.capacity)
            padded.append(run_case(Case(hidden, tokens, max_rows), args.repeats, device, backend))
            print(f"hidden={hidden} tokens={tokens} done", file=sys.stderr)

    lines = [
        f"# Stash+pop vs plain copy ({datetime.date.today()})",
        "",
        f"Command: `python benchmarks/bench_stash.py {' '.join(argv or sys.argv[1:])}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, device {device}, "
        f"backend {backend.value}, torch {torch.__version__}, bf16, page size 64, "
        f"median of {args.repeats}.",
        "",
        "## Throughput (all rows real: no padding)",
        "",
        "| hidden | tokens | MB moved | plain copy ms | stash+pop ms | ratio (copy/stash) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in full:
        lines.append(
            f"| {r.case.hidden} | {r.case.tokens} | {2e3 * r.gbytes:.0f} | {1e3 * r.copy_s:.2f} "
            f"| {1e3 * r.stash_s:.2f} | {r.copy_s / r.stash_s:.2f} |"
        )
    lines += [
        "",
        f"## Cost of zeroing padding rows on reload (static buffer = {args.capacity} × tokens)",
        "",
        "| hidden | tokens | plain copy ms | stash+pop, zeroed ms | stash+pop, left ms "
        "| zeroing overhead |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in padded:
        lines.append(
            f"| {r.case.hidden} | {r.case.tokens} | {1e3 * r.copy_s:.2f} | {1e3 * r.stash_s:.2f} "
            f"| {1e3 * r.stash_nozero_s:.2f} | {100 * (r.stash_s / r.stash_nozero_s - 1):+.0f} % |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
