"""The benchmarks' timing: ``torch.utils.benchmark.Timer`` medians over ``repeats`` calls, and
``triton.testing.do_bench`` for the stash kernels on CUDA."""

from __future__ import annotations

import sys
import types

import torch

from te_paged.tools import bench


def test_median_seconds_times_repeats_calls_with_the_timer() -> None:
    calls = []
    seconds = bench.median_seconds(lambda: calls.append(1), 5, torch.device("cpu"))
    # 5 timed calls, each after the Timer's own 2 warm-up calls
    assert len(calls) == 5 * 3 and 0 < seconds < 0.1
    assert bench.timing_method(torch.device("cpu"), 5) == (
        "median of 5 (torch.utils.benchmark.Timer)"
    )


def test_the_timer_keeps_the_process_thread_count() -> None:
    # The Timer's default is one thread: the reports say "N threads", so it must not change.
    seen = []
    bench.median_seconds(lambda: seen.append(torch.get_num_threads()), 1, torch.device("cpu"))
    assert set(seen) == {torch.get_num_threads()}


def test_on_cuda_the_kernels_are_timed_by_do_bench(monkeypatch) -> None:
    asked = {}

    def do_bench(fn, **kwargs):
        asked.update(kwargs)
        fn()
        return 2.5  # milliseconds

    fake = types.ModuleType("triton.testing")
    fake.do_bench = do_bench
    monkeypatch.setitem(sys.modules, "triton.testing", fake)
    monkeypatch.setattr(bench, "_do_bench_applies", lambda device: device.type == "cuda")
    calls = []
    cuda = torch.device("cuda")
    assert bench.median_seconds(lambda: calls.append(1), 7, cuda) == 0.0025
    assert asked == {"return_mode": "median"} and calls == [1]
    assert "triton.testing.do_bench" in bench.timing_method(cuda, 7)
    # a whole training step is not a kernel: the Timer, which synchronises the device
    assert bench.timing_method(cuda, 7, kernels=False).startswith("median of 7 (torch.utils")
