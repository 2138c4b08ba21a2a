"""Peak memory of a piece of work, measured by torch's own trackers, and the capacity model
(defined, free of torch, in :mod:`te_paged.runtime.pool_plan`).

* CUDA: the caching allocator's statistics (``max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus what was allocated before).
* CPU: torch's dispatch-based ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which
  sees every storage allocated while the work runs and reports the peak by category. For work
  that runs torch.compile'd code (``compiled=True``), which refuses to run under a dispatch
  mode, the CPU figure is the running sum of the allocations and frees the profiler records
  (``profile_memory=True``), every thread's counted by c10's allocator meanwhile (a gloo
  worker's frees included): its peak above the work's start, as on CUDA.

Either way the figure is the peak of the memory the work itself holds: on CUDA everything
allocated before it (parameters, existing gradients, a stash pool allocated at the step boundary)
is subtracted; on CPU the tracker's parameter, buffer, gradient and optimizer categories are
excluded, leaving activations and temporaries at the moment of the peak. Keep gradients allocated
across steps (``zero_grad(set_to_none=False)``) so the two agree, and add the pool explicitly
when comparing paged stash ON against OFF.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from te_paged.runtime.pool_plan import capacity_model_saving, reload_adjusted_saving

__all__ = [
    "MemoryReport",
    "PeakMemoryMeter",
    "capacity_model_saving",
    "measure_peak",
    "reload_adjusted_saving",
]

# MemTracker categories that exist before a step and stay for the whole run.
_STATIC_CATEGORIES = {"Parameter", "Buffer", "Gradient", "Optstate"}


@dataclasses.dataclass
class MemoryReport:
    peak_bytes: int
    method: str
    by_category: dict[str, int]


class PeakMemoryMeter:
    """Context manager measuring the peak memory of the work inside it (see module docstring).

    ``new_iteration()`` tells the CPU tracker that the same modules are about to run again
    (e.g. a step rerun after an overflow); the peak carries over.

    ``compiled``: the work runs compiled code (CPU: the profiler's allocation events instead of
    ``MemTracker``); ``static`` (with ``compiled``) returns, after the work, the tensors whose
    allocations in it are not the work's own memory — gradients a framework reallocates every
    step, optimizer states — which ``MemTracker`` leaves out by category.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        compiled: bool = False,
        static: Callable[[], Iterable[torch.Tensor]] | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.report: MemoryReport | None = None
        self._tracker = None
        self._profiler = None
        self._base = 0
        self._every_thread: bool | None = None  # the allocator flag's value before __enter__
        self.compiled = compiled  # the work runs compiled code: no dispatch-mode tracker
        self.static = static

    def __enter__(self) -> PeakMemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif self.compiled:
            # The profiler's own start and stop lines (kineto's USDT level) are not for users.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            self._every_thread = _count_every_thread(True)
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self._profiler.__enter__()
        else:
            self._tracker = _step_mem_tracker()
            self._tracker.__enter__()
        return self

    def new_iteration(self) -> None:
        if self._tracker is not None:
            self._tracker.reset_mod_stats()

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._base
            self.report = MemoryReport(
                peak, "CUDA caching allocator peak (max_memory_allocated)", {}
            )
            return
        if self._profiler is not None:
            self._profiler.__exit__(*exc)
            _count_every_thread(self._every_thread)
            static = () if self.static is None else self.static()
            ptrs = {t.untyped_storage().data_ptr() for t in static if t is not None}
            self.report = MemoryReport(
                _allocator_peak(self._profiler, ptrs),
                "CPU allocations the profiler recorded (profile_memory), peak above the start: "
                "compiled code runs under no dispatch-mode tracker",
                {},
            )
            return
        self._tracker.__exit__(*exc)
        snapshot = self._tracker.get_tracker_snapshot("peak").get(self.device, {})
        categories = {
            getattr(k, "value", str(k)): int(v) for k, v in snapshot.items() if k != "Total"
        }
        dynamic = sum(v for k, v in categories.items() if k not in _STATIC_CATEGORIES)
        method = "torch MemTracker (dispatch-based) peak of activations + temporaries"
        self.report = MemoryReport(dynamic, method, categories)


def _count_every_thread(on: bool | None) -> bool | None:
    """Set c10's ``FLAGS_caffe2_report_cpu_memory_usage`` to ``on`` (None: leave it); returns
    its value before, or None where this build of torch does not export it.

    c10's CPU allocator keeps the running total the profiler's allocation events carry only for
    the threads the profiler profiles, unless this flag is set: a free on another thread is
    then counted nowhere. A gloo collective's worker thread drops its references to the
    collective's tensors after the caller has returned from the wait; where it was descheduled
    in between, the last reference to a buffer the step allocated (a functional collective's
    input, under torch.compile) is its, and without the flag that buffer would stay in the
    step's figure to its end (benchmarks/results/gloo-linger-2026-12-05.md)."""
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.*"))
    try:
        flag = ctypes.c_bool.in_dll(ctypes.CDLL(libs[0]), "FLAGS_caffe2_report_cpu_memory_usage")
    except (IndexError, OSError, ValueError):
        return None
    before = flag.value
    if on is not None:
        flag.value = on
    return before


def _allocator_peak(profiler: torch.profiler.profile, static_ptrs: set[int] = frozenset()) -> int:
    """The peak of the step's own CPU memory from the profiler's allocation events, in time
    order, less the allocations still live at the end at a ``static_ptrs`` address.

    The events are those of the threads the profiler profiles (the step's own, autograd's
    backward included); each also carries the allocator's total, of every thread while the meter
    sets :func:`_count_every_thread`. A collective's worker thread (gloo's) allocates buffers
    of its own, which the step does not hold, and may drop the last reference to a tensor the
    step allocated, a free no event records. Between two events the total's change not
    explained by the event is the other threads' net: what they allocate is theirs, what they
    free is first theirs and, past that, the step's."""
    events, stack = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            events.append((node.start_time_ns, fields.ptr, fields.alloc_size,
                           fields.total_allocated))  # fmt: skip
        stack.extend(node.children)
    events.sort()
    # The allocation of each static address that is still live at the end: not counted.
    last: dict[int, int] = {}  # address -> index of its live allocation
    for i, (_, ptr, size, _) in enumerate(events):
        if size > 0:
            last[ptr] = i
        else:
            last.pop(ptr, None)
    skip = {last[p] for p in static_ptrs if p in last}
    peak = live = theirs = 0
    total = events[0][3] - events[0][2] if events else 0
    for i, (_, _, size, after) in enumerate(events):
        other, total = after - size - total, after
        if other > 0:
            theirs += other
        elif other < 0:
            mine = max(0, -other - theirs)
            theirs = max(0, theirs + other)
            live -= mine
        if i not in skip:
            live += size
        peak = max(peak, live)
    return peak


class _ModuleTensors:
    """A module's parameters and buffers through ``nn.Module``'s methods, whatever attributes
    the module itself defines under those names."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def parameters(self, recurse: bool = True):
        return torch.nn.Module.parameters(self._module, recurse)

    def buffers(self, recurse: bool = True):
        return torch.nn.Module.buffers(self._module, recurse)


def _step_mem_tracker():
    """torch's ``MemTracker`` for a whole training step: a step may call the same root module
    once per microbatch (gradient accumulation, a pipeline schedule), which ``MemTracker``
    refuses as "multiple iterative calls". Here a root module's next forward starts its
    module statistics afresh (what ``reset_mod_stats`` does, for that module only); the
    device-wide peak this meter reports is not per module and carries over.

    A module may shadow ``nn.Module.buffers``/``parameters`` with an attribute (Megatron's
    ``DistributedDataParallel`` keeps its gradient buffers in a list named ``buffers``): the
    tracker then reads them through ``nn.Module``'s own methods."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            if not (callable(module.buffers) and callable(module.parameters)):
                module = _ModuleTensors(module)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _pre_fw_hook(self, module, inputs):
            tracker = self._mod_tracker
            if module in self.memory_tracking and not tracker.is_bw:
                name = tracker.get_known_fqn(module)
                if set(tracker.parents) - {name} == {"Global"}:  # a root module, called again
                    del self.memory_tracking[module]
            return super()._pre_fw_hook(module, inputs)

    return StepMemTracker()


def measure_peak(
    fn: Callable[[], Any],
    device: torch.device | str,
    *,
    compiled: bool = False,
    static: Callable[[], Iterable[torch.Tensor]] | None = None,
) -> tuple[Any, MemoryReport]:
    """Run ``fn`` and return its result and the peak bytes it held on ``device`` (``compiled``:
    as :class:`PeakMemoryMeter`'s)."""
    with PeakMemoryMeter(device, compiled=compiled, static=static) as meter:
        result = fn()
    return result, meter.report
