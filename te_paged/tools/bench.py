"""Benchmarks behind ``te-paged bench`` (and ``benchmarks/bench_stash.py``).

Stash+pop throughput: for each (hidden, tokens) the stash copies the actual rows into pool pages
and the pop copies them back; the baseline is two ``Tensor.copy_`` calls moving the same rows the
same way. Reported: medians over ``repeats`` runs in one process, and their ratio (baseline time
/ stash time, so 1.0 = as fast as a plain copy). A second table measures what zeroing the padding
rows on reload costs when the static buffer is ``capacity`` times the actual rows.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import statistics
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


def stash_report(
    hidden: list[int],
    tokens: list[int],
    *,
    capacity: float = 1.5,
    repeats: int = 7,
    device: str = "cpu",
    backend: str = "auto",
    command: str = "",
    progress=None,
) -> str:
    """Run the stash+pop benchmark grid; return the Markdown report."""
    dev = torch.device(device)
    kernel = resolve_backend(backend, dev)
    full, padded = [], []
    for h in hidden:
        for t in tokens:
            full.append(run_case(Case(h, t, t), repeats, dev, kernel))
            padded.append(run_case(Case(h, t, int(t * capacity)), repeats, dev, kernel))
            if progress is not None:
                progress(f"stash bench hidden={h} tokens={t}")
    lines = [
        f"# Stash+pop vs plain copy ({datetime.date.today()})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, device {dev}, "
        f"backend {kernel.value}, torch {torch.__version__}, bf16, page size 64, "
        f"median of {repeats}.",
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


def step_time_report(cfg, *, repeats: int = 5, device: str = "cpu", command: str = "") -> str:
    """Median step time of the ``ab`` model (one process) with paged stash ON and OFF."""
    from te_paged.tools.model import ToyMoEModel, make_batch

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    models = {paged: ToyMoEModel(cfg, paged=paged, group=None, device=dev) for paged in (0, 1)}
    x, target = make_batch(cfg, 0, 0, dev)

    def step(model: ToyMoEModel) -> None:
        if model.manager is not None:
            model.manager.reset()
        model.zero_grad(set_to_none=False)
        model(x, target).backward()

    times: dict[int, list[float]] = {0: [], 1: []}
    for model in models.values():  # capture step and pool allocation, not timed
        step(model)
        step(model)
    for _ in range(repeats):  # interleaved, so drift in machine load hits both alike
        for paged, model in models.items():
            sync()
            t0 = time.perf_counter()
            step(model)
            sync()
            times[paged].append(time.perf_counter() - t0)
    on, off = statistics.median(times[1]), statistics.median(times[0])
    return "\n".join(
        [
            f"# Step time, paged stash ON vs OFF ({datetime.date.today()})",
            "",
            f"Command: `{command}`  ",
            f"Model: {cfg.layers} MoE layers, {cfg.experts} experts, top-{cfg.topk}, hidden "
            f"{cfg.hidden}, ffn {cfg.ffn}, {cfg.tokens} tokens, capacity {cfg.capacity_factor}, "
            f"one process, device {dev}, median of {repeats}.",
            "",
            "| OFF ms | ON ms | ON / OFF |",
            "| ---: | ---: | ---: |",
            f"| {1e3 * off:.1f} | {1e3 * on:.1f} | {on / off:.3f} |",
            "",
        ]
    )
