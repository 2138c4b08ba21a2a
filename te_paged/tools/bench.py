"""Benchmarks behind ``te-paged bench`` (and ``benchmarks/bench_stash.py``).

Stash+pop throughput: for each (hidden, tokens), each stash backend and each free list the stash
starts from (``fresh``, ``1F1B``, ``alternating``: :mod:`te_paged.tools.free_lists`), the stash
copies the actual rows into pool pages and the pop copies them back; the baseline is a plain
two-way copy, two ``Tensor.copy_`` calls moving the same rows there and back. Reported: the
median and the fastest of the timed runs of each, and their ratios (baseline / stash, so 1.0 =
as fast as a plain copy). A second table measures what zeroing the padding rows on reload costs
when the static buffer is ``capacity`` times the actual rows (fresh free list).

Timing (:func:`time_calls`): ``torch.utils.benchmark.Timer`` — ``repeats`` rounds in which every
function of a case is timed once, each call after the Timer's own two warm-up calls, at the
process's thread count, the accelerator synchronised around each; interleaving the rounds makes
drift in the machine's load hit the baseline and the stash alike. On CUDA with Triton installed
the stash kernels are timed by ``triton.testing.do_bench`` instead (its own warm-up and number
of runs, the L2 cache flushed before each), the usual yardstick for a kernel on a GPU.

The Triton backend is timed on CUDA only: on CPU it runs under Triton's interpreter, orders of
magnitude slower than any kernel (its results are checked against the reference in
``tests/unit/kernels/test_triton_vs_reference.py``); its section then says so.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import importlib.util
import platform
import statistics
from collections.abc import Callable

import torch
from torch.utils.benchmark import Measurement, Timer

from te_paged.kernels import (
    FLAGS_LEN,
    META_LEN,
    STATE_LEN,
    KernelBackend,
    StashBackend,
    State,
    backend_choices,
    get_backend,
    resolve_backend,
    stash_copy,
    stash_pop,
)
from te_paged.kernels.native import page_mover_status
from te_paged.stash import storage_dtype
from te_paged.tools.engine_configs import STASH_HIDDEN_SIZES, STASH_TOKEN_COUNTS
from te_paged.tools.free_lists import FreeList, PreparedFreeList, prepare_free_list

__all__ = [
    "STASH_HIDDEN_SIZES",
    "STASH_TOKEN_COUNTS",
    "Timing",
    "median_of",
    "stash_report",
    "step_time_report",
    "time_calls",
    "timer",
    "timing_method",
]


_PAGE_SIZE = 64
_DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds one call takes: the median and the fastest of the timed runs."""

    median: float
    min: float

    def ratio(self, other: Timing) -> tuple[float, float]:
        """``other`` over this, of medians and of mins (above 1: this is faster)."""
        return other.median / self.median, other.min / self.min


@dataclasses.dataclass(frozen=True)
class Row:
    """One (hidden, tokens, backend, free list) point of the throughput table."""

    hidden: int
    tokens: int
    backend: str
    free_list: FreeList
    runs: int  # runs of consecutive pages the measured stash takes
    copy: Timing
    stash: Timing

    @property
    def megabytes(self) -> float:
        """Bytes moved by one stash+pop (there and back), in MB."""
        return 2 * self.tokens * self.hidden * _DTYPE.itemsize / 1e6


@dataclasses.dataclass(frozen=True)
class PaddingRow:
    hidden: int
    tokens: int
    backend: str
    copy: Timing
    zeroed: Timing
    left: Timing


def _do_bench_applies(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def timing_method(device: torch.device, repeats: int, *, kernels: bool = True) -> str:
    """How :func:`time_calls` times on ``device``, for a report's header."""
    if kernels and _do_bench_applies(device):
        return "median and min of triton.testing.do_bench's runs (L2 flushed before each)"
    if kernels:
        return f"median and min of {repeats} interleaved runs (torch.utils.benchmark.Timer)"
    return f"median of {repeats} (torch.utils.benchmark.Timer)"


def timer(fn: Callable[[], object], label: str = "") -> Timer:
    """A ``Timer`` of ``fn()`` at this process's thread count (the Timer's default is 1)."""
    return Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(), label=label)


def median_of(measurements: list[Measurement]) -> float:
    """The median, in seconds, of ``Timer.timeit`` measurements of one statement."""
    (merged,) = Measurement.merge(measurements)
    return merged.median


def time_calls(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    device: torch.device,
    *,
    kernels: bool = True,
) -> dict[str, Timing]:
    """:class:`Timing` of one call of each function (see the module docstring; ``kernels``: on
    CUDA with Triton, time with ``triton.testing.do_bench``)."""
    if kernels and _do_bench_applies(device):
        from triton.testing import do_bench

        out = {}
        for name, fn in fns.items():
            ms = do_bench(fn, return_mode="all")  # milliseconds, one per run
            out[name] = Timing(statistics.median(ms) / 1e3, min(ms) / 1e3)
        return out
    timers = {name: timer(fn) for name, fn in fns.items()}
    runs: dict[str, list[Measurement]] = {name: [] for name in fns}
    for _ in range(repeats):  # interleaved: drift in the machine's load hits every one alike
        for name, t in timers.items():
            runs[name].append(t.timeit(1))
    return {
        name: Timing(median_of(ms), min(x for m in ms for x in m.times))
        for name, ms in runs.items()
    }


def _untimeable(backend: StashBackend, device: torch.device) -> str | None:
    """Why ``backend`` is not timed on ``device`` (None: it is)."""
    if backend.name == KernelBackend.TRITON.value and device.type != "cuda":
        return (
            f"on {device} the Triton kernels run only under Triton's interpreter, far too slow "
            "to time; tests/unit/kernels/test_triton_vs_reference.py checks them against the "
            "reference there"
        )
    ok, reason = backend.available(device)
    return None if ok else f"it cannot run here: {reason}"


def _backends(backend: str | None, device: torch.device) -> list[StashBackend]:
    """The one backend asked for (``auto``: the device's), or every registered one (None)."""
    if backend is None:
        return [get_backend(name) for name in backend_choices() if name != "auto"]
    if backend == "auto":
        return [resolve_backend(backend, device)]
    return [get_backend(backend)]


class _Pool:
    """The kernels' pool arguments with the free list ``prepared``, one record and its flags.

    The pool is ``torch.empty``: on CPU only the pages a stash touches become memory, so a 1F1B
    pool (~9 × the measured tensor) costs the measured tensor's pages.
    """

    def __init__(
        self, prepared: PreparedFreeList, max_rows: int, hidden: int, device: torch.device
    ) -> None:
        bits = storage_dtype(_DTYPE)
        self.prepared = prepared
        pool_NH = torch.empty(prepared.num_pages * _PAGE_SIZE, hidden, dtype=bits, device=device)
        state = torch.zeros(STATE_LEN, dtype=torch.int64, device=device)
        state[State.HEAD], state[State.TAIL] = prepared.head, prepared.tail
        self.args = (
            pool_NH,
            torch.tensor(prepared.free_P, dtype=torch.int32, device=device),
            torch.empty(0, hidden, dtype=bits, device=device),  # no host tier
            torch.empty(0, dtype=torch.int32, device=device),
            state,
        )
        self.flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=device)
        self.rec_pages_M = torch.empty(-(-max_rows // _PAGE_SIZE), dtype=torch.int32,
                                       device=device)  # fmt: skip
        self.rec_meta = torch.empty(META_LEN, dtype=torch.int64, device=device)

    @property
    def pool_NH(self) -> torch.Tensor:
        return self.args[0]

    def stash_pop(
        self, backend: StashBackend, src_RH: torch.Tensor, dst_RH: torch.Tensor,
        num_tokens: torch.Tensor, zero_padding: bool = True,
    ) -> Callable[[], None]:  # fmt: skip
        """One stash of ``src_RH`` and its pop into ``dst_RH``, as a function to time."""
        record = (self.flags, self.rec_pages_M, self.rec_meta)

        def run() -> None:
            stash_copy(backend, src_RH, num_tokens, 1, _PAGE_SIZE, *self.args, *record)
            stash_pop(backend, dst_RH, _PAGE_SIZE, *self.args, *record, zero_padding)

        return run

    def check(
        self, run: Callable[[], None], src_RH: torch.Tensor, dst_RH: torch.Tensor, tokens: int
    ) -> None:
        """One more call of ``run`` (after the timed ones) moves every row, and takes exactly
        the prepared pages: the timed calls did not make the free list drift."""
        kind = self.prepared.kind.value
        dst_RH[:tokens].zero_()  # else the other functions' rows would pass for this one's
        run()
        if int(self.flags.count_nonzero()) or not torch.equal(dst_RH[:tokens], src_RH[:tokens]):
            raise AssertionError(f"stash+pop from the {kind} free list lost rows")
        taken = tuple(self.rec_pages_M[: len(self.prepared.pages)].tolist())
        if taken != self.prepared.pages:
            raise AssertionError(f"the {kind} free list drifted while timed: {taken}")


def _throughput(
    hidden: int, tokens: int, backends: list[StashBackend], repeats: int, device: torch.device
) -> list[Row]:
    bits = storage_dtype(_DTYPE)
    src = torch.randn(tokens, hidden, device=device).to(_DTYPE).view(bits)
    dst = torch.empty_like(src)
    n = torch.tensor([tokens], device=device)
    prepared = {kind: prepare_free_list(kind, tokens, _PAGE_SIZE) for kind in FreeList}
    pools = {(b.name, kind): _Pool(prepared[kind], tokens, hidden, device) for b in backends
             for kind in FreeList}  # fmt: skip
    # The baseline moves the same rows into a fresh pool's first pages and back.
    plain_pool = pools[backends[0].name, FreeList.FRESH].pool_NH[:tokens]

    def plain() -> None:
        plain_pool.copy_(src)
        dst.copy_(plain_pool)

    runs = {key: pool.stash_pop(get_backend(key[0]), src, dst, n) for key, pool in pools.items()}
    fns: dict[str, Callable[[], object]] = {"copy": plain}
    fns.update({f"{name}/{kind.value}": run for (name, kind), run in runs.items()})
    timings = time_calls(fns, repeats, device)
    rows = []
    for (name, kind), pool in pools.items():
        pool.check(runs[name, kind], src, dst, tokens)
        rows.append(Row(hidden, tokens, name, kind, prepared[kind].runs, timings["copy"],
                        timings[f"{name}/{kind.value}"]))  # fmt: skip
    return rows


def _padding(
    hidden: int, tokens: int, capacity: float, backends: list[StashBackend], repeats: int,
    device: torch.device,
) -> list[PaddingRow]:  # fmt: skip
    bits = storage_dtype(_DTYPE)
    max_rows = int(tokens * capacity)
    src = torch.randn(max_rows, hidden, device=device).to(_DTYPE).view(bits)
    dst = torch.empty_like(src)
    n = torch.tensor([tokens], device=device)
    fresh = prepare_free_list(FreeList.FRESH, tokens, _PAGE_SIZE)
    pools = {b.name: _Pool(fresh, max_rows, hidden, device) for b in backends}
    plain_pool = pools[backends[0].name].pool_NH[:tokens]

    def plain() -> None:
        plain_pool.copy_(src[:tokens])
        dst[:tokens].copy_(plain_pool)

    fns: dict[str, Callable[[], object]] = {"copy": plain}
    for b in backends:
        for zero in (True, False):
            fns[f"{b.name}/{zero}"] = pools[b.name].stash_pop(b, src, dst, n, zero)
    timings = time_calls(fns, repeats, device)
    for b in backends:
        pools[b.name].check(fns[f"{b.name}/True"], src, dst, tokens)
    rows = []
    for b in backends:
        zeroed, left = (timings[f"{b.name}/{zero}"] for zero in (True, False))
        rows.append(PaddingRow(hidden, tokens, b.name, timings["copy"], zeroed, left))
    return rows


def _summary(rows: list[Row]) -> list[str]:
    """The worst ratio per free list, for hidden 1024 and for hidden >= 2048."""
    lines = [
        "| free list | page runs | hidden < 2048: ratio of medians | of mins "
        "| hidden ≥ 2048: ratio of medians | of mins |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for kind in FreeList:
        mine = [r for r in rows if r.free_list is kind]
        cells = []
        for group in ([r for r in mine if r.hidden < 2048], [r for r in mine if r.hidden >= 2048]):
            ratios = [r.stash.ratio(r.copy) for r in group]
            cells += [f"{min(x[i] for x in ratios):.2f}" if ratios else "–" for i in (0, 1)]
        runs = sorted({r.runs for r in mine})
        span = f"{runs[0]}" if len(runs) == 1 else f"{runs[0]}–{runs[-1]}"
        lines.append(f"| {kind.value} | {span} | " + " | ".join(cells) + " |")
    return lines


def stash_report(
    hidden: list[int] | tuple[int, ...] = STASH_HIDDEN_SIZES,
    tokens: list[int] | tuple[int, ...] = STASH_TOKEN_COUNTS,
    *,
    capacity: float = 1.5,
    repeats: int = 7,
    device: str = "cpu",
    backend: str | None = None,
    command: str = "",
    progress: Callable[[str], None] | None = None,
) -> str:
    """Run the stash+pop benchmark grid; return the Markdown report.

    ``backend``: one registered backend (``auto``: the device's), or None for every one, those
    that cannot be timed here named with the reason. ``progress(message)`` is called after each
    (hidden, tokens) case.
    """
    dev = torch.device(device)
    skipped, timed = {}, []
    for b in _backends(backend, dev):
        reason = _untimeable(b, dev)
        if reason is None:
            timed.append(b)
        else:
            skipped[b.name] = reason
    rows: list[Row] = []
    padded: list[PaddingRow] = []
    for h in hidden:
        for t in tokens:
            if timed:
                rows += _throughput(h, t, timed, repeats, dev)
                gc.collect()  # the pools of this case go before the next case's come
                padded += _padding(h, t, capacity, timed, repeats, dev)
                gc.collect()
            if progress is not None:
                progress(f"hidden {h}, tokens {t}")
    lines = [
        f"# Stash+pop vs plain copy ({datetime.date.today()})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, device {dev}, "
        f"torch {torch.__version__}, bf16, page size {_PAGE_SIZE}, "
        f"{timing_method(dev, repeats)}.",
        "",
        "Free lists the stash starts from (`te_paged/tools/free_lists.py`): **fresh**, pages "
        "0, 1, 2, …; **1F1B**, as pipeline stage 0 of 4 leaves it under Megatron-core's 1F1B "
        "schedule (8 microbatches, 2 tensors of this key each, token counts ±25 %, pool 1.10 × "
        "the peak of live pages), measured at the last forward; **alternating**, every other "
        "page free, the worst case. *Page runs*: runs of consecutive pages the stash takes. "
        "*Ratio*: plain two-way copy time / stash+pop time (1.0: as fast as a plain copy), of "
        "the medians and of the fastest runs.",
    ]
    for b in timed:
        mine = [r for r in rows if r.backend == b.name]
        lines += ["", f"## Backend {b.name}", ""]
        if b.name == KernelBackend.TORCH.value and dev.type == "cpu":
            mover = page_mover_status()
            lines += [
                "Rows moved by "
                + (f"the compiled page mover (`te_paged/kernels/native.py`: {mover.reason})."
                   if mover.available else
                   f"torch ops: the compiled page mover is unavailable ({mover.reason})."),
                "",
            ]  # fmt: skip
        lines += ["Worst ratio over the grid:", ""]
        lines += _summary(mine)
        lines += [
            "",
            "### Throughput (all rows real: no padding)",
            "",
            "| hidden | tokens | MB moved | free list | page runs | plain copy ms median "
            "| min | stash+pop ms median | min | ratio of medians | ratio of mins |",
            "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in mine:
            med, fast = r.stash.ratio(r.copy)
            lines.append(
                f"| {r.hidden} | {r.tokens} | {r.megabytes:.0f} | {r.free_list.value} "
                f"| {r.runs} | {1e3 * r.copy.median:.2f} | {1e3 * r.copy.min:.2f} "
                f"| {1e3 * r.stash.median:.2f} | {1e3 * r.stash.min:.2f} | {med:.2f} "
                f"| {fast:.2f} |"
            )
    for name, reason in skipped.items():
        lines += ["", f"## Backend {name}: not timed", "", f"{reason[0].upper()}{reason[1:]}."]
    for b in timed:
        lines += [
            "",
            f"## Cost of zeroing padding rows on reload, backend {b.name} (static buffer = "
            f"{capacity} × tokens, fresh free list, medians)",
            "",
            "| hidden | tokens | plain copy ms | stash+pop, zeroed ms | stash+pop, left ms "
            "| zeroing overhead |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in (r for r in padded if r.backend == b.name):
            lines.append(
                f"| {r.hidden} | {r.tokens} | {1e3 * r.copy.median:.2f} "
                f"| {1e3 * r.zeroed.median:.2f} | {1e3 * r.left.median:.2f} "
                f"| {100 * (r.zeroed.median / r.left.median - 1):+.0f} % |"
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
