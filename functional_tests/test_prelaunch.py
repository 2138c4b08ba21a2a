"""The background lane of launches (prelaunch.py) and the session-end clean-up (launch.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from functional_tests import launch
from functional_tests.prelaunch import Lane, Launch


@pytest.fixture(autouse=True)
def _lane_on(monkeypatch) -> None:
    monkeypatch.setenv("TE_PAGED_PRELAUNCH", "1")  # whatever the session runs with


def _lane(tmp_path) -> Lane:
    return Lane(lambda name: tmp_path / name)


def test_launches_of_one_group_run_once_with_every_part_in_test_order(tmp_path) -> None:
    calls = []

    def run(parts, out):
        calls.append((parts, out.name))
        return {part: f"{part} done" for part in parts}

    first, second = Launch("g", "b", run), Launch("g", "a", run)
    other = Launch("h", "x", lambda parts, out: {"x": threading.current_thread().name})
    lane = _lane(tmp_path)
    lane.plan([first, other, second, first])
    assert lane.result(second) == "a done" and lane.result(first) == "b done"
    assert calls == [(("b", "a"), "g")]
    assert lane.result(other) == "prelaunch"  # ran on the lane's thread, not the test's


def test_a_failed_launch_fails_every_test_that_reads_it(tmp_path) -> None:
    def run(parts, out):
        pytest.fail("rank 2 exited with 1")

    failing = Launch("g", "p", run)
    lane = _lane(tmp_path)
    lane.plan([failing])
    for _ in range(2):
        with pytest.raises(pytest.fail.Exception, match="rank 2 exited with 1"):
            lane.result(failing)


def test_an_unplanned_launch_runs_on_the_tests_thread(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TE_PAGED_PRELAUNCH", "0")
    planned = Launch("g", "p", lambda parts, out: {"p": threading.current_thread().name})
    lane = _lane(tmp_path)
    lane.plan([planned])  # the lane is off: nothing starts in the background
    unplanned = Launch("h", "q", lambda parts, out: {"q": threading.current_thread().name})
    main = threading.current_thread().name
    assert lane.result(planned) == main and lane.result(unplanned) == main


def test_drain_waits_for_every_queued_launch(tmp_path) -> None:
    done = []

    def slow(parts, out):
        time.sleep(0.3)
        done.append(parts)
        return {p: None for p in parts}

    lane = _lane(tmp_path)
    lane.plan([Launch("g", "a", slow), Launch("h", "b", slow), Launch("i", "c", slow)])
    lane.drain()
    assert sorted(done) == [("a",), ("b",), ("c",)]  # each once; some on this thread


def test_end_all_ends_a_launch_still_running_on_another_thread() -> None:
    results = []
    sleeper = ["-c", "import time; time.sleep(120)"]
    thread = threading.Thread(
        target=lambda: results.append(launch.run_python(sleeper, timeout_s=300))
    )
    thread.start()
    deadline = time.monotonic() + 30
    while thread not in launch._LIVE.values() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    launch.end_all(thread)  # only this test's command: the lane's launches run on
    thread.join(timeout=30)
    assert results and results[0].returncode < 0  # ended by a signal
    assert time.monotonic() - started < 30 and sys.executable in results[0].args
