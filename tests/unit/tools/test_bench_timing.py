"""The benchmarks' timing: ``torch.utils.benchmark.Timer`` medians and mins over ``repeats``
interleaved rounds, and ``triton.testing.do_bench`` for the stash kernels on CUDA."""

from __future__ import annotations

import sys
import types

import torch

from te_paged.tools import bench


def test_time_calls_interleaves_repeats_rounds_of_timer_calls() -> None:
    calls = []
    timings = bench.time_calls(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 5, torch.device("cpu")
    )
    # 5 rounds; in each, every function is timed once, after the Timer's own 2 warm-up calls
    assert calls == (["a"] * 3 + ["b"] * 3) * 5
    for t in timings.values():
        assert 0 < t.min <= t.median < 0.1
    assert bench.timing_method(torch.device("cpu"), 5) == (
        "median and min of 5 interleaved runs (torch.utils.benchmark.Timer)"
    )
    assert bench.timing_method(torch.device("cpu"), 5, kernels=False) == (
        "median of 5 (torch.utils.benchmark.Timer)"
    )


def test_timing_ratio_is_the_other_over_this() -> None:
    fast, slow = bench.Timing(median=1.0, min=0.5), bench.Timing(median=2.0, min=2.0)
    assert fast.ratio(slow) == (2.0, 4.0) and slow.ratio(fast) == (0.5, 0.25)


def test_the_timer_keeps_the_process_thread_count() -> None:
    # The Timer's default is one thread: the reports say "N threads", so it must not change.
    seen = []
    bench.time_calls({"f": lambda: seen.append(torch.get_num_threads())}, 1, torch.device("cpu"))
    assert set(seen) == {torch.get_num_threads()}


def test_on_cuda_the_kernels_are_timed_by_do_bench(monkeypatch) -> None:
    asked = {}

    def do_bench(fn, **kwargs):
        asked.update(kwargs)
        fn()
        return [2.5, 1.5, 4.0]  # milliseconds, one per run

    fake = types.ModuleType("triton.testing")
    fake.do_bench = do_bench
    monkeypatch.setitem(sys.modules, "triton.testing", fake)
    monkeypatch.setattr(bench, "_do_bench_applies", lambda device: device.type == "cuda")
    calls = []
    cuda = torch.device("cuda")
    assert bench.time_calls({"f": lambda: calls.append(1)}, 7, cuda) == {
        "f": bench.Timing(median=0.0025, min=0.0015)
    }
    assert asked == {"return_mode": "all"} and calls == [1]
    assert "triton.testing.do_bench" in bench.timing_method(cuda, 7)
    # a whole training step is not a kernel: the Timer, which synchronises the device
    assert bench.timing_method(cuda, 7, kernels=False).startswith("median of 7 (torch.utils")
