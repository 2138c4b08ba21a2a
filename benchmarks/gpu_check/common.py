"""What every check shares: how this process runs them (:data:`RUN`), the check running now
(:func:`running`), the outcomes a check raises, bitwise comparison, timing, the report
sections, and running a check's cases.

A check is a module ``check_NN_*.py`` with ``NAME`` (its row in the report), ``TARGET`` (what
it must meet) and ``run() -> str`` (its figures), raising :class:`TargetMissed` or
:class:`Unavailable`; any other exception is a FAIL. ``runner.CHECKS`` lists them in order.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The environment variable that makes a process run one case of its check (``run_cases``).
CASE_ENV = "TE_PAGED_GPU_CHECK_CASE"


class Scale(enum.Enum):
    """How large the checks run."""

    GPU = "gpu"  # model sizes on CUDA: the measurement
    DRY = "cpu dry run"  # toy sizes on the CPU (torch backend; the Triton kernels interpreted)
    SMOKE = "smoke"  # a dry run's smallest meaningful case per check (the test suite's)


@dataclasses.dataclass
class Run:
    """How this process runs the checks: set by ``runner.configure`` from the command line (the
    dry-run test sets it the same way and puts the defaults back), read by the checks."""

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cuda"))
    backend: str = "triton"  # the stash kernels' backend
    scale: Scale = Scale.GPU
    step_tokens: int = 2048  # tokens per step of the DeepSeek-like layers (checks 7, 8)
    in_process: bool = False  # --in-process: no check or case in a process of its own

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dry(self) -> bool:
        return self.scale is not Scale.GPU

    @property
    def smoke(self) -> bool:
        return self.scale is Scale.SMOKE

    def argv(self) -> list[str]:
        """The options that make a child process run as this one."""
        scale = {Scale.GPU: [], Scale.DRY: ["--cpu-dry-run"],
                 Scale.SMOKE: ["--cpu-dry-run", "--smoke"]}[self.scale]  # fmt: skip
        return ["--step-tokens", str(self.step_tokens), *scale]


RUN = Run()


@dataclasses.dataclass
class Running:
    """The check running in this thread (the dry-run test runs two at once): its number and
    the Markdown it adds to the report."""

    index: int
    sections: list[str] = dataclasses.field(default_factory=list)


_RUNNING: contextvars.ContextVar[Running] = contextvars.ContextVar("gpu_check_running")


@contextlib.contextmanager
def running(index: int) -> Iterator[Running]:
    """Check ``index`` runs in this thread for the block."""
    token = _RUNNING.set(Running(index))
    try:
        yield _RUNNING.get()
    finally:
        _RUNNING.reset(token)


class TargetMissed(Exception):
    """The check ran and a figure missed its target; the message gives the figures."""


class Unavailable(Exception):
    """The check cannot run here (CUDA-only in a dry run, a feature not there yet)."""


def need_cuda(what: str) -> None:
    if not RUN.cuda:
        raise Unavailable(f"{what} needs CUDA (dry run on {RUN.device})")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def all_same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(same(x, y) for x, y in zip(xs, ys))


def random_bits(
    rows: int, hidden: int, dtype: torch.dtype, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random bytes over the whole range of ``dtype``'s width (NaN payloads, infinities,
    subnormals and -0 included), as ``dtype``; from ``generator`` (default: torch's)."""
    from te_paged.stash import storage_dtype

    bits = storage_dtype(dtype)
    width = torch.empty((), dtype=bits).element_size()
    raw = torch.randint(0, 256, (rows, hidden * width), dtype=torch.uint8, device=RUN.device,
                        generator=generator)  # fmt: skip
    return raw.view(bits).view(dtype)


def section(markdown: str, title: str | None = None) -> None:
    """Add ``markdown`` to the report under the running check: a level-3 ``title``, or its own
    headings two levels down."""
    body = [("##" + line if line.startswith("#") else line) for line in markdown.splitlines()]
    head = [f"### {title}", ""] if title else []
    _RUNNING.get().sections.append("\n".join([*head, *body]).rstrip() + "\n")


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Seconds of one call: (CUDA events on the current stream, wall clock between device
    synchronisations); on CPU both are the wall clock."""
    if not RUN.cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0,) * 2
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()  # every stream: side-stream work left over counts in the wall
    return start.elapsed_time(end) / 1e3, time.perf_counter() - t0


#: te_paged's own kernels, as the profiler names them.
STASH_KERNELS = ("_stash_kernel", "_pop_kernel")


def kernel_times(fn: Callable[[], object]) -> dict[str, float]:
    """Device milliseconds per kernel name in one call of ``fn`` (torch.profiler; on CPU the
    CPU time per op, so that a dry run takes this path too)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if RUN.cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        if RUN.cuda:
            torch.cuda.synchronize()
    field = "self_device_time_total" if RUN.cuda else "self_cpu_time_total"
    out: dict[str, float] = {}
    for e in prof.key_averages():
        ms = getattr(e, field, 0.0) / 1e3
        if ms > 0 and (not RUN.cuda or e.device_type.name == "CUDA"):
            out[e.key] = out.get(e.key, 0.0) + ms
    return out


def child_command(index: int, result: str) -> list[str]:
    """The command that runs check ``index`` in a process of its own, as this one runs, and
    writes its result (JSON) to ``result``."""
    return [sys.executable, "-m", __package__, "--child", str(index), "--result", result,
            *RUN.argv()]  # fmt: skip


def run_cases(cases: dict[str, Callable[[], str]], isolate: bool = False) -> str:
    """Run every case; one failing does not stop the next. Raises with all outcomes if any
    failed (Unavailable only if every case was). ``isolate``: each case in a process of its
    own on CUDA, for cases whose failure can leave the process broken (a failed graph capture
    leaves the CUDA generator mid-capture: every later case then fails in ``normal_``)."""
    only = os.environ.get(CASE_ENV)
    if only is not None:  # this is a case process
        return cases[only]()
    done, failed, unavailable = [], [], []
    for label, fn in cases.items():
        try:
            if isolate and RUN.cuda and not RUN.in_process:
                done.append(f"{label}: {_case_in_child(label)}")
            else:
                done.append(f"{label}: {fn()}")
        except Unavailable as e:
            unavailable.append(f"{label}: {e}")
        except Exception as e:
            failed.append(f"{label}: {type(e).__name__}: {e}")
            traceback.print_exc()
    if failed:
        raise AssertionError("; ".join(failed + done + unavailable))
    if unavailable and not done:
        raise Unavailable("; ".join(unavailable))
    return "; ".join(done + unavailable)


def _case_in_child(label: str) -> str:
    """Case ``label`` of the running check in a fresh process: its figures, or its outcome
    raised here as in the case itself (its tables join this check's)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = child_command(_RUNNING.get().index, path)
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, CASE_ENV: label}, timeout=240)
        if not os.path.exists(path):
            raise RuntimeError(f"its process exited with status {proc.returncode} (a crash)")
        with open(path) as f:
            result = json.load(f)
    _RUNNING.get().sections.extend(result["sections"])
    kind = {"PASS": None, "MISS": TargetMissed, "N/A": Unavailable}.get(result["status"], "FAIL")
    if kind == "FAIL":
        raise RuntimeError(result["detail"])
    if kind is not None:
        raise kind(result["detail"])
    return result["detail"]
