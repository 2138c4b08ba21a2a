"""The background lane of launches (prelaunch.py) and the session-end clean-up (launch.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from functional_tests import launch, prelaunch
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

    ran = threading.Event()

    def other_run(parts, out):
        ran.set()
        return {"x": threading.current_thread().name}

    first, second = Launch("g", "b", run), Launch("g", "a", run)
    other = Launch("h", "x", other_run)
    lane = _lane(tmp_path)
    lane.plan([first, other, second, first])
    assert ran.wait(timeout=30)  # started in the background: no test asked for it yet
    assert lane.result(second) == "a done" and lane.result(first) == "b done"
    assert calls == [(("b", "a"), "g")]
    assert lane.result(other).startswith("prelaunch-")


def test_a_test_waiting_for_a_running_launch_runs_the_queued_ones_meanwhile(tmp_path) -> None:
    """The lane's one thread runs ``g``, which needs ``h`` to run beside it; the test waiting for
    ``g`` runs ``h`` on its own thread (before, it only waited: one core idle at a run's end)."""
    g_started, h_ran = threading.Event(), threading.Event()

    def g(parts, out):
        g_started.set()
        return {"g": h_ran.wait(timeout=10)}

    def h(parts, out):
        h_ran.set()
        return {"h": threading.current_thread().name}

    lane = _lane(tmp_path)
    launch_g, launch_h = Launch("g", "g", g), Launch("h", "h", h)
    lane.plan([launch_g, launch_h])
    assert g_started.wait(timeout=30)
    assert lane.result(launch_g), "the test's thread did not run the queued launch while it waited"
    assert lane.result(launch_h) == threading.current_thread().name


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


def test_a_launch_gets_the_sessions_environment_not_a_tests_setenv(tmp_path, monkeypatch) -> None:
    # CI caught this: an in-process ``ab`` test set RANK/WORLD_SIZE=1 while the lane started
    # ``te-paged ab --engine torchtitan``, which then ran as one torchrun rank of one.
    monkeypatch.delenv("TE_PAGED_PROBE", raising=False)
    lane = _lane(tmp_path)  # the session's environment: no TE_PAGED_PROBE
    go = threading.Event()
    probe = ["-c", "import os; print(os.environ.get('TE_PAGED_PROBE'))"]

    def run(parts, out):
        go.wait(timeout=30)
        return {"p": launch.run_python(probe, timeout_s=60).stdout.strip()}

    planned = Launch("g", "p", run)
    lane.plan([planned])
    monkeypatch.setenv("TE_PAGED_PROBE", "set by a test")  # while the launch waits to start
    go.set()
    assert lane.result(planned) == "None"
    # Outside a launch, a command gets the live environment.
    assert launch.run_python(probe, timeout_s=60).stdout.strip() == "set by a test"


def test_the_lanes_first_folder_and_a_tests_first_tmp_path_share_one_basetemp(
    tmp_path, monkeypatch
) -> None:
    # CI lost the Megatron launch to this: a session's tmp_path_factory makes its basetemp on
    # first use, and the lane's first launch and the first test asked for it at once. Each
    # made one (pytest-173 and pytest-174), and the launch's mktemp then failed with "... is
    # not a normalized and relative path".
    monkeypatch.setenv("PYTEST_DEBUG_TEMPROOT", str(tmp_path))
    factory = pytest.TempPathFactory(None, 3, "all", lambda *a: None, _ispytest=True)
    make = prelaunch.folders(factory)  # when collection ends
    start, errors, made = threading.Barrier(2), [], []

    def first(call) -> None:
        start.wait(timeout=30)
        try:
            made.append(call())
        except Exception as e:  # every failure is the finding
            errors.append(repr(e))

    lane = threading.Thread(target=first, args=(lambda: make("megatron 0.19.2"),))
    lane.start()
    first(lambda: factory.mktemp("planted"))
    lane.join()
    assert errors == []
    (root,) = tmp_path.iterdir()  # pytest-of-<user>
    assert [p.name for p in root.glob("pytest-[0-9]*")] == [factory.getbasetemp().name]
    assert {p.parent for p in made} == {factory.getbasetemp()}


@pytest.mark.parametrize("setting, threads", [("1", 1), ("3", 3), (None, prelaunch.THREADS)])
def test_the_setting_is_the_number_of_threads(tmp_path, monkeypatch, setting, threads) -> None:
    if setting is None:
        monkeypatch.delenv("TE_PAGED_PRELAUNCH")
    else:
        monkeypatch.setenv("TE_PAGED_PRELAUNCH", setting)
    release, names = threading.Event(), set()

    def hold(parts, out):
        names.add(threading.current_thread().name)
        release.wait(timeout=30)
        return {p: None for p in parts}

    lane = _lane(tmp_path)
    lane.plan([Launch(g, g, hold) for g in "abcd"])
    deadline = time.monotonic() + 30
    while len(names) < threads and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # a thread too many would have started a launch by now
    assert names == {f"prelaunch-{i}" for i in range(threads)}
    release.set()
    lane.drain()


def test_a_bad_setting_is_refused_before_anything_starts(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TE_PAGED_PRELAUNCH", "two")
    started = []
    with pytest.raises(ValueError, match=r"TE_PAGED_PRELAUNCH=.two..*number of threads"):
        _lane(tmp_path).plan([Launch("g", "a", lambda parts, out: started.append(parts))])
    assert started == []


def test_the_log_has_a_line_per_launch_with_its_thread_and_times(tmp_path, monkeypatch) -> None:
    log = tmp_path / "lane.log"
    monkeypatch.setenv("TE_PAGED_PRELAUNCH_LOG", str(log))

    def run(parts, out):
        if parts == ("bad",):
            pytest.fail("rank 0 exited with 1")
        return {p: None for p in parts}

    lane = _lane(tmp_path)
    lane.plan([Launch("g", "a", run), Launch("h", "bad", run)])
    lane.drain()
    lines = sorted(line.split("\t") for line in log.read_text().splitlines())
    assert [line[0] for line in lines] == ["g", "h"]  # the failed launch too
    for _group, thread, start, end in lines:
        assert float(start) <= float(end) <= time.time() + 0.1  # written to 0.1 s
        assert thread.startswith("prelaunch-") or thread == "MainThread"


def test_launches_planned_later_run_on_the_lane_too(tmp_path) -> None:
    # The lane is planned twice in a whole run: the functional tests when collection leaves
    # functional_tests/, the rest when it ends. A lane thread that found its queue empty has
    # left by the second: the second's launches must still run in the background.
    names = {}

    def run(parts, out):
        names[parts] = threading.current_thread().name
        return {p: None for p in parts}

    lane = _lane(tmp_path)
    first = Launch("g", "a", run)
    lane.plan([first])
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t in lane._threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    second = Launch("h", "b", run)
    lane.plan([second, first])  # a group planned again is not run again
    deadline = time.monotonic() + 30
    while ("b",) not in names and time.monotonic() < deadline:
        time.sleep(0.01)
    assert names == {("a",): "prelaunch-0", ("b",): "prelaunch-1"}


def test_a_planned_launch_no_selected_test_reads_is_dropped(tmp_path) -> None:
    release, ran = threading.Event(), []

    def run(parts, out):
        ran.append(parts)
        if parts == ("a",):
            release.wait(timeout=30)
        return {p: None for p in parts}

    lane = _lane(tmp_path)
    lane.plan([Launch(g, g, run) for g in "abc"])
    deadline = time.monotonic() + 30
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    lane.retain(["c"])  # "a" has started: it runs to its end; "b" never starts
    release.set()
    lane.drain()
    assert ran == [("a",), ("c",)]


def test_in_process_tests_run_first_then_functional_then_quiet_ones(request) -> None:
    order = [
        ("quiet_machine" in item.fixturenames, "functional_tests" in item.path.parts, item.nodeid)
        for item in request.session.items
    ]
    assert [o[:2] for o in order] == sorted(o[:2] for o in order), [o[2] for o in order if o[0]]


def test_a_whole_run_plans_the_lane_while_the_rest_is_collected(request) -> None:
    # The lane starts when collection leaves functional_tests/ (collected first), not when it
    # ends: in a whole run, about 20 s of one core. Only where something else is collected
    # after the functional tests, and nothing deselects tests after collection (-k, -m, ...).
    from functional_tests import conftest

    items = request.session.items
    functional = [item for item in items if conftest._functional(item)]
    expected = (
        conftest._early(request.config)
        and len(functional) < len(items)
        and any(conftest._needs(item) for item in functional)
    )
    assert conftest.planned_early(request.config) == expected
