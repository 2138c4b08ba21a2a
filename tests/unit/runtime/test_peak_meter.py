"""The CPU figure of compiled work (``PeakMemoryMeter(compiled=True)``): the profiler's allocation
events, with the frees and allocations of threads the profiler does not profile (a gloo
collective's worker) counted where they happen."""

from __future__ import annotations

import threading

import torch

from te_paged.runtime.memory import PeakMemoryMeter

MIB = 1 << 20


def _freed_on_another_thread() -> int:
    """The step allocates A, hands its only reference to a thread that drops it (as gloo's
    worker drops a collective's input after the caller's wait), then allocates B as large."""
    box = [torch.empty(MIB, dtype=torch.uint8)]
    with PeakMemoryMeter("cpu", compiled=True) as meter:
        box.append(torch.ones(MIB, dtype=torch.uint8))  # A
        worker = threading.Thread(target=box.pop)
        worker.start()
        worker.join()
        b = torch.ones(MIB, dtype=torch.uint8)
        del b
    return meter.report.peak_bytes


def test_a_buffer_freed_on_another_thread_leaves_the_peak_when_it_is_freed():
    peak = _freed_on_another_thread()
    assert MIB <= peak < 2 * MIB, (
        f"peak {peak} B: the buffer the other thread freed is still counted (the allocator "
        "counts no thread the profiler does not profile: FLAGS_caffe2_report_cpu_memory_usage)"
    )


def test_what_another_thread_allocates_and_holds_is_not_the_steps():
    held = []
    with PeakMemoryMeter("cpu", compiled=True) as meter:
        worker = threading.Thread(target=lambda: held.append(torch.ones(2 * MIB)))
        worker.start()
        worker.join()
        a = torch.ones(MIB, dtype=torch.uint8)
        del a
    assert MIB <= meter.report.peak_bytes < 2 * MIB, meter.report.peak_bytes
