"""Benchmarks behind ``te-paged bench`` (and ``benchmarks/bench_stash.py``).

Stash+pop throughput: for each (hidden, tokens) the stash copies the actual rows into pool pages
and the pop copies them back; the baseline is two ``Tensor.copy_`` calls moving the same rows the
same way. Reported: medians in one process, and their ratio (baseline time / stash time, so 1.0 =
as fast as a plain copy). A second table measures what zeroing the padding rows on reload costs
when the static buffer is ``capacity`` times the actual rows.

Timing (:func:`median_seconds`): ``torch.utils.benchmark.Timer`` — ``repeats`` timed calls, each
after the Timer's own two warm-up calls, at the process's thread count, the accelerator
synchronised around each — and their median. On CUDA with Triton installed the stash kernels
are timed by ``triton.testing.do_bench`` instead (its own warm-up and number of runs, the L2
cache flushed before each, the median), the usual yardstick for a kernel on a GPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import platform
from collections.abc import Callable

import torch
from torch.utils.benchmark import Measurement, Timer

from te_paged.kernels import (
    FLAGS_LEN,
    META_LEN,
    StashBackend,
    resolve_backend,
    stash_copy,
    stash_pop,
)
from te_paged.stash import PagedStashBuffer, StashKey, storage_dtype

__all__ = [
    "STASH_HIDDEN_SIZES",
    "STASH_TOKEN_COUNTS",
    "median_of",
    "median_seconds",
    "stash_report",
    "step_time_report",
    "timer",
    "timing_method",
]

#: The stash benchmark's default grid (DeepSeek-V3's hidden size is 7168).
STASH_HIDDEN_SIZES = (1024, 2048, 4096, 7168)
STASH_TOKEN_COUNTS = (2048, 16384, 65536)


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


def _do_bench_applies(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def timing_method(device: torch.device, repeats: int, *, kernels: bool = True) -> str:
    """How :func:`median_seconds` times on ``device``, for a report's header."""
    if kernels and _do_bench_applies(device):
        return "median of triton.testing.do_bench's runs (L2 flushed before each)"
    return f"median of {repeats} (torch.utils.benchmark.Timer)"


def timer(fn: Callable[[], object], label: str = "") -> Timer:
    """A ``Timer`` of ``fn()`` at this process's thread count (the Timer's default is 1)."""
    return Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(), label=label)


def median_of(measurements: list[Measurement]) -> float:
    """The median, in seconds, of ``Timer.timeit`` measurements of one statement."""
    (merged,) = Measurement.merge(measurements)
    return merged.median


def median_seconds(
    fn: Callable[[], object], repeats: int, device: torch.device, *, kernels: bool = True
) -> float:
    """Median seconds of one ``fn()`` (see the module docstring; ``kernels``: on CUDA with
    Triton, time with ``triton.testing.do_bench``)."""
    if kernels and _do_bench_applies(device):
        from triton.testing import do_bench

        return do_bench(fn, return_mode="median") / 1e3  # milliseconds
    t = timer(fn)
    return median_of([t.timeit(1) for _ in range(repeats)])


def run_case(case: Case, repeats: int, device: torch.device, backend: StashBackend) -> Result:
    bits = storage_dtype(case.dtype)
    src = torch.randn(case.max_rows, case.hidden, device=device).to(case.dtype).view(bits)
    dst = torch.empty_like(src)
    pages = -(-case.tokens // case.page_size)
    buf = PagedStashBuffer(StashKey(case.dtype, case.hidden), pages, case.page_size, device)
    flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=device)
    rec = torch.empty(-(-case.max_rows // case.page_size), dtype=torch.int32, device=device)
    meta = torch.empty(META_LEN, dtype=torch.int64, device=device)
    n = torch.tensor([case.tokens], device=device)
    plain_pool = buf.pool_NH[: case.tokens]

    def plain() -> None:
        plain_pool.copy_(src[: case.tokens])
        dst[: case.tokens].copy_(plain_pool)

    def paged(zero: bool) -> None:
        stash_copy(backend, src, n, 1, case.page_size, *buf.kernel_args(), flags, rec, meta)
        stash_pop(backend, dst, case.page_size, *buf.kernel_args(), flags, rec, meta, zero)

    copy_s = median_seconds(plain, repeats, device)
    stash_s = median_seconds(lambda: paged(True), repeats, device)
    stash_nozero_s = median_seconds(lambda: paged(False), repeats, device)
    assert torch.equal(dst[: case.tokens], src[: case.tokens])
    assert int(flags.sum()) == 0
    return Result(case, copy_s, stash_s, stash_nozero_s)


def stash_report(
    hidden: list[int] | tuple[int, ...] = STASH_HIDDEN_SIZES,
    tokens: list[int] | tuple[int, ...] = STASH_TOKEN_COUNTS,
    *,
    capacity: float = 1.5,
    repeats: int = 7,
    device: str = "cpu",
    backend: str = "auto",
    command: str = "",
    progress: Callable[[str], None] | None = None,
) -> str:
    """Run the stash+pop benchmark grid; return the Markdown report. ``progress(message)`` is
    called after each (hidden, tokens) case."""
    dev = torch.device(device)
    kernel = resolve_backend(backend, dev)
    full, padded = [], []
    for h in hidden:
        for t in tokens:
            full.append(run_case(Case(h, t, t), repeats, dev, kernel))
            padded.append(run_case(Case(h, t, int(t * capacity)), repeats, dev, kernel))
            if progress is not None:
                progress(f"hidden {h}, tokens {t}")
    lines = [
        f"# Stash+pop vs plain copy ({datetime.date.today()})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, device {dev}, "
        f"backend {kernel.name}, torch {torch.__version__}, bf16, page size 64, "
        f"{timing_method(dev, repeats)}.",
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
        f"## Cost of zeroing padding rows on reload (static buffer = {capacity} × tokens)",
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
    return "\n".join(lines) + "\n"


def step_time_report(
    cfg,
    *,
    repeats: int = 5,
    device: str = "cpu",
    command: str = "",
    progress: Callable[[str], None] | None = None,
) -> str:
    """Median step time of the ``ab`` model (one process) with paged stash ON and OFF.
    ``progress(message)`` is called after each round (one timed step of each)."""
    from te_paged.tools.model import ToyMoEModel, make_batch

    dev = torch.device(device)
    models = {paged: ToyMoEModel(cfg, paged=paged, group=None, device=dev) for paged in (0, 1)}
    x, target = make_batch(cfg, 0, 0, dev)

    def step(model: ToyMoEModel) -> None:
        if model.manager is not None:
            model.manager.reset()
        model.zero_grad(set_to_none=False)
        model(x, target).backward()

    # The Timer's two warm-up calls before each timed one cover the capture step and the pool
    # allocation at the first reset after it: every timed step runs with the pool.
    timers = {paged: timer(lambda m=model: step(m)) for paged, model in models.items()}
    runs: dict[int, list[Measurement]] = {0: [], 1: []}
    for i in range(repeats):  # interleaved, so drift in machine load hits both alike
        for paged, t in timers.items():
            runs[paged].append(t.timeit(1))
        if progress is not None:
            progress(f"round {i + 1}/{repeats}")
    on, off = median_of(runs[1]), median_of(runs[0])
    return "\n".join(
        [
            f"# Step time, paged stash ON vs OFF ({datetime.date.today()})",
            "",
            f"Command: `{command}`  ",
            f"Model: {cfg.layers} MoE layers, {cfg.experts} experts, top-{cfg.topk}, hidden "
            f"{cfg.hidden}, ffn {cfg.ffn}, {cfg.tokens} tokens, capacity {cfg.capacity_factor}, "
            f"one process, device {dev}, {timing_method(dev, repeats, kernels=False)}.",
            "",
            "| OFF ms | ON ms | ON / OFF |",
            "| ---: | ---: | ---: |",
            f"| {1e3 * off:.1f} | {1e3 * on:.1f} | {on / off:.3f} |",
            "",
        ]
    )
