"""Device work of a stash+pop round trip, recorded instead of run: what the launch-count test,
``te-paged bench --only host`` and the compiled-kernel table (:mod:`.kernel_table`) take their
launches from.

:func:`recorded_launches` patches Triton's one launch entry, ``run`` of ``JITFunction`` (and of
``InterpretedFunction`` under ``TRITON_INTERPRET=1``), for the duration of a block: every
``kernel[grid](...)`` — te_paged's, Megatron's, anyone's — is recorded with its arguments and,
unless ``execute`` is set, not run. With the device work taken out, what a call costs is its
host path alone: argument handling, checks, the wrappers' own torch ops (:func:`torch_ops`
counts those that would launch a kernel on a GPU).

:func:`host_report` times that host path for te_paged's stash ops and for megatron-core 0.19.2's
own copy and pop wrappers (``PagedTensor.offload_to_stash`` / ``reload_from_stash``) under the
same stub, in one run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.util
import platform
from collections.abc import Callable, Iterator

import torch

__all__ = [
    "HostRow",
    "Launch",
    "Recording",
    "host_report",
    "host_rows",
    "recorded_launches",
    "torch_ops",
]


@dataclasses.dataclass(frozen=True)
class Launch:
    """One ``kernel[grid](*args, **kwargs)``."""

    kernel: object  # a JITFunction (or InterpretedFunction): its ``fn`` is the Python source
    grid: tuple
    args: tuple
    kwargs: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


def _launch_classes() -> list[type]:
    from triton.runtime.jit import JITFunction

    classes: list[type] = [JITFunction]
    with contextlib.suppress(ImportError):  # the interpreter ships with every Triton we support
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    return classes


class Recording:
    """What :func:`recorded_launches` saw: ``count`` launches, and (``keep``) each of them."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.count = 0
        self.launches: list[Launch] = []

    def clear(self) -> None:
        self.count = 0
        self.launches.clear()


@contextlib.contextmanager
def recorded_launches(*, execute: bool = False, keep: bool = True) -> Iterator[Recording]:
    """The Triton launches made in the block, in order (``keep``; else only counted: timing
    loops then keep nothing alive); with ``execute`` they also run."""
    recording = Recording(keep)
    saved = {cls: cls.__dict__["run"] for cls in _launch_classes()}

    def wrap(real: Callable) -> Callable:
        def run(self, *args, grid, warmup, **kwargs):
            if warmup:  # a compile request, not a launch
                return real(self, *args, grid=grid, warmup=warmup, **kwargs)
            recording.count += 1
            if recording.keep:
                recording.launches.append(Launch(self, tuple(grid), args, dict(kwargs)))
            if execute:
                return real(self, *args, grid=grid, warmup=warmup, **kwargs)
            return None

        return run

    for cls, real in saved.items():
        cls.run = wrap(real)
    try:
        yield recording
    finally:
        for cls, real in saved.items():
            cls.run = real


# ATen ops that launch no device kernel: allocation, views and metadata. Every other op a
# wrapper calls on CUDA tensors is a kernel launch (a copy_, a fill, an arithmetic op).
_NO_KERNEL = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::as_strided",
    "aten::_reshape_alias", "aten::reshape", "aten::_unsafe_view", "aten::alias",
    "aten::detach", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
    "aten::expand", "aten::t", "aten::transpose", "aten::permute", "aten::contiguous",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::view_as",
    "aten::set_", "aten::result_type",
})  # fmt: skip


def torch_ops(fn: Callable[[], object]) -> list[str]:
    """The top-level ATen ops ``fn()`` calls that would launch a device kernel (on CPU tensors,
    by name: see ``_NO_KERNEL``), in order. Run ``fn`` under :func:`recorded_launches` to keep
    Triton's interpreter, whose own bookkeeping uses torch ops, out of the count."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [
        e.name
        for e in prof.events()
        if e.cpu_parent is None and e.name.startswith("aten::") and e.name not in _NO_KERNEL
    ]


# The host-path benchmark's case: check 10's larger tensor (DeepSeek-V3's hidden size).
_TOKENS, _HIDDEN, _PAGE_SIZE = 4096, 7168, 64


@dataclasses.dataclass(frozen=True)
class HostRow:
    """One implementation's stash+pop round trip with its device work taken out."""

    name: str
    what: str  # the calls timed
    median_us: float
    min_us: float
    triton_launches: int
    torch_ops: list[str]  # those that launch a kernel on a GPU

    @property
    def launches(self) -> int:
        return self.triton_launches + len(self.torch_ops)


def _te_paged_round_trip(path: str) -> Callable[[], None]:
    """te_paged's round trip as the manager makes it (``stash_copy``/``stash_pop`` with the
    Triton backend); ``path="op"`` forces the ``torch.library`` op, as under a dispatch mode."""
    from te_paged.kernels import FLAGS_LEN, META_LEN, get_backend, stash_copy, stash_pop
    from te_paged.stash import PagedStashBuffer, StashKey

    key = StashKey(torch.bfloat16, _HIDDEN)
    pages = 2 * -(-_TOKENS // _PAGE_SIZE)
    buf = PagedStashBuffer(key, pages, _PAGE_SIZE, "cpu")
    src = torch.empty(_TOKENS, _HIDDEN, dtype=torch.int16)
    dst = torch.empty_like(src)
    n = torch.tensor([_TOKENS // 2])
    flags = torch.zeros(FLAGS_LEN, dtype=torch.int64)
    pages_M = torch.empty(-(-_TOKENS // _PAGE_SIZE), dtype=torch.int32)
    meta = torch.empty(META_LEN, dtype=torch.int64)
    args = (*buf.kernel_args(), flags, pages_M, meta)
    triton = get_backend("triton")
    if path == "op":

        def run() -> None:
            torch.ops.te_paged.stash_copy(src, n, 1, _PAGE_SIZE, *args, "triton")
            torch.ops.te_paged.stash_pop(dst, _PAGE_SIZE, *args, True, "triton")

        return run

    def run() -> None:
        stash_copy(triton, src, n, 1, _PAGE_SIZE, *args)
        stash_pop(triton, dst, _PAGE_SIZE, *args, True)

    return run


def _megatron_round_trip() -> Callable[[], None]:
    """megatron-core 0.19.2's round trip as its manager makes it: ``offload_to_stash`` of a
    ``PagedTensor`` on a ``PagedStashBuffer``, then ``reload_from_stash`` into a buffer the
    caller allocated (its manager does so on the main stream)."""
    from megatron.core.transformer.moe import paged_stash as mc

    overflow, spill = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    buf = mc.PagedStashBuffer(2 * _TOKENS, _HIDDEN, _PAGE_SIZE, "cpu", overflow, spill,
                              torch.bfloat16)  # fmt: skip
    src = torch.empty(_TOKENS, _HIDDEN, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    tensor = mc.PagedTensor(
        src, num_tokens_tensor=torch.tensor([_TOKENS // 2]), max_num_tokens=_TOKENS,
        hidden_size=_HIDDEN, page_size=_PAGE_SIZE,
    )  # fmt: skip

    def run() -> None:
        tensor._tensor = src
        tensor.offload_to_stash(buf)
        tensor._tensor = dst
        tensor.reload_from_stash(buf)

    return run


def megatron_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether megatron-core's paged-stash kernels can be imported."""
    if importlib.util.find_spec("megatron") is None:
        return False, "megatron-core is not installed"
    try:
        from megatron.core.transformer.moe import paged_stash  # noqa: F401
    except ImportError as e:
        return False, f"megatron-core has no paged stash here ({e})"
    return True, ""


def host_rows(repeats: int = 15, number: int = 2000) -> tuple[list[HostRow], str | None]:
    """Host µs per round trip, median and min of ``repeats`` interleaved rounds of ``number``
    calls each; and why Megatron was not measured (None: it was)."""
    from te_paged.tools.bench import timer

    cases = {
        "te_paged": ("stash_copy + stash_pop (Triton backend)", _te_paged_round_trip("direct")),
        "te_paged, via the op": ("te_paged::stash_copy + stash_pop ops (under a dispatch "
                                 "mode or torch.compile)", _te_paged_round_trip("op")),
    }  # fmt: skip
    ok, why_not = megatron_available()
    if ok:
        cases["megatron-core"] = ("PagedTensor.offload_to_stash + reload_from_stash",
                                  _megatron_round_trip())  # fmt: skip
    with recorded_launches(keep=False) as recording:
        counted = {}
        for name, (_, fn) in cases.items():
            fn()  # first calls: plans, imports and caches, outside the count and the timing
            recording.clear()
            ops = torch_ops(fn)
            counted[name] = (recording.count, ops)
        timers = {name: timer(fn) for name, (_, fn) in cases.items()}
        runs: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(repeats):  # interleaved: drift in the machine's load hits all alike
            for name, t in timers.items():
                runs[name].append(t.timeit(number).median)
    rows = []
    for name, (what, _) in cases.items():
        times = sorted(runs[name])
        rows.append(HostRow(name, what, 1e6 * times[len(times) // 2], 1e6 * times[0],
                            *counted[name]))  # fmt: skip
    return rows, None if ok else why_not


def host_report(repeats: int = 15, *, command: str = "") -> str:
    """The Markdown report of :func:`host_rows`."""
    today = datetime.date.today()
    title = f"# Host path of a stash+pop round trip, device work taken out ({today})"
    if importlib.util.find_spec("triton") is None:
        why = "Triton is not installed (pip install 'te_paged[triton]')"
        return f"{title}\n\nNot measured: {why}.\n"
    import triton

    rows, why_not = host_rows(repeats)
    by_name = {r.name: r for r in rows}
    lines = [
        title,
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"Python {platform.python_version()}; CPU tensors, bf16 {_TOKENS} × {_HIDDEN} buffer, "
        f"page size {_PAGE_SIZE}, half the rows real.",
        "",
        "Every Triton launch is replaced by a stub that records it (`te_paged/tools/launches.py`)"
        ", in both implementations alike: what is left is the host path — argument handling, "
        "checks, the wrappers' own torch ops (on CPU tensors: cheaper than the same ops on "
        f"CUDA, which favours the wrapper with more of them). Median and min of {repeats} "
        "interleaved rounds of 2000 round trips. *Launches*: Triton launches + the torch ops "
        "that launch a kernel on a GPU.",
        "",
        "| implementation | calls | µs per round trip, median | min | launches | torch ops |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        ops = ", ".join(op.removeprefix("aten::") for op in r.torch_ops) or "–"
        lines.append(f"| {r.name} | {r.what} | {r.median_us:.1f} | {r.min_us:.1f} "
                     f"| {r.launches} ({r.triton_launches} Triton) | {ops} |")  # fmt: skip
    lines.append("")
    mine, theirs = by_name["te_paged"], by_name.get("megatron-core")
    if theirs is not None:
        ratio = mine.median_us / theirs.median_us
        verdict = "met" if ratio <= 1.0 else "MISSED"
        lines.append(f"te_paged / megatron-core, medians: **{ratio:.2f}** (target ≤ 1.0: "
                     f"{verdict}).")  # fmt: skip
    else:
        lines.append(f"megatron-core not measured: {why_not}.")
    return "\n".join(lines) + "\n"
