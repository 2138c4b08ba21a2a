"""Start the rank launches the collected tests need as soon as they are collected, in the
background.

Most functional tests read the results of one ``torchrun`` launch per module. The in-process
tests that run before them keep one of the machine's two cores busy; a launch started in the
background fills the other. So once the functional tests are collected (they are collected
first and run last: ``functional_tests/conftest.py``), while the rest of the suite is still
being collected, or else when collection ends, the suite starts every :class:`Launch` the
selected tests read (a test's ``@pytest.mark.launch(L)``, or
its module's ``LAUNCHES`` for a module fixture), in the order the tests come, on background
threads (one per four cores, at least one: a launch runs four ranks); a module's fixture then
waits for its launch's result (:meth:`Lane.result`). On two cores one thread is the fastest
while the in-process tests run: two threads' eight ranks starved the tests' own process
(benchmarks/results/suite-time-*.md). Once a test waits for a launch, its thread is the second:
it runs the queued launches while it waits. A launch no collected test declared runs when its
fixture asks for it, on the test's own thread.

Launches that share a :attr:`Launch.group` are one launch: ``run`` gets every part the collected
tests need and returns each part's result. The Megatron workers on one release share one
(megatron-core's import and gloo's set-up paid once; see ``functional_tests/megatron``).

``TE_PAGED_PRELAUNCH=N`` sets the number of background threads; ``0`` turns the lane off:
every launch then runs when its first test needs it (for a failure to read in order, or a timing
without overlap). ``TE_PAGED_PRELAUNCH_LOG=FILE`` appends a line per launch to ``FILE``: its
group, the thread that ran it, and its start and end (seconds since the epoch), to see what the
tests waited for.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from functional_tests import launch as _launch

ENABLE_ENV = "TE_PAGED_PRELAUNCH"
LOG_ENV = "TE_PAGED_PRELAUNCH_LOG"
#: The default number of background threads: one per four cores (a launch runs four ranks).
THREADS = max(1, (os.cpu_count() or 1) // 4)


@dataclass(frozen=True)
class Launch:
    """One launch a test module needs. ``run(parts, folder)`` runs the launch for ``parts`` (the
    parts of this group the collected tests need, in test order) in a fresh folder and returns
    ``{part: result}``; it fails the test (``pytest.fail``) when the launch fails."""

    group: str
    part: str
    run: Callable[[tuple[str, ...], Path], dict[str, Any]]


def alone(name: str, run: Callable[[Path], Any]) -> Launch:
    """A launch that shares its group with no other part: ``run(folder)`` is its result."""
    return Launch(name, name, lambda parts, out: {name: run(out)})


class Lane:
    """The background threads that run the planned launches, each one at a time."""

    def __init__(self, mktemp: Callable[[str], Path]) -> None:
        self._mktemp = mktemp
        self._lock = threading.Lock()
        self._parts: dict[str, list[str]] = {}  # group -> parts, in test order
        self._runs: dict[str, Callable] = {}
        self._futures: dict[str, Future] = {}  # group -> its launch's {part: result}
        self._queue: list[str] = []
        self._stopped = threading.Event()
        self._threads: list[threading.Thread] = []  # every thread started
        self._running: set[threading.Thread] = set()  # those still taking launches
        # The environment the session started with: each launch's commands get it, whatever a
        # test running beside the launch has set in os.environ meanwhile.
        self._env = dict(os.environ)

    def plan(self, launches: Iterable[Launch]) -> None:
        """Queue ``launches`` (merged by group, in the order given, after those queued before)
        and start threads for them, up to the setting's number running at once. A part added
        to a group whose launch has started is not run: plan a group's parts before it starts
        (a module's tests are collected together)."""
        threads = _thread_count()
        with self._lock:
            for launch in launches:
                parts = self._parts.setdefault(launch.group, [])
                if launch.part not in parts:
                    parts.append(launch.part)
                if launch.group not in self._runs:
                    self._runs[launch.group] = launch.run
                    self._queue.append(launch.group)
            waiting = sum(group not in self._futures for group in self._queue)
            for _ in range(min(threads - len(self._running), waiting)):
                thread = threading.Thread(
                    target=self._run_queued, name=f"prelaunch-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                self._running.add(thread)
                thread.start()

    def retain(self, groups: Iterable[str]) -> None:
        """Unqueue every group not in ``groups`` that has not started (the tests that needed it
        were deselected after it was planned)."""
        keep = set(groups)
        with self._lock:
            self._queue = [g for g in self._queue if g in keep or g in self._futures]

    def result(self, launch: Launch) -> Any:
        """``launch``'s result: runs it now when it is not queued (or not started yet), or
        else, while it runs on another thread, runs the queued launches nobody has started, in
        order, on this thread, then waits. The test's thread has nothing else to do meanwhile:
        at the end of a run, when only launches are left, the lane's one thread used 1.2 of the
        two cores (benchmarks/results/suite-time-2026-12-07.md)."""
        future, owner = self._claim(launch.group, launch.part, launch.run)
        if owner:
            self._execute(launch.group, future)
        while not future.done() and self._run_next():
            pass
        return future.result()[launch.part]

    def drain(self) -> None:
        """Run every queued launch before returning (for a test whose timing a launch beside it
        would disturb): those not started yet run here, beside the one on the lane, so the
        wait is shorter."""
        self._run_queued()
        for thread in self._threads:
            thread.join()

    def stop(self) -> None:
        """Start nothing more (the session is ending); a running launch ends by its timeout or
        by the session's end, which ends its process group."""
        self._stopped.set()

    def _claim(self, group: str, part: str, run: Callable) -> tuple[Future, bool]:
        """The group's future, and whether the caller must run it (nobody has yet)."""
        with self._lock:
            if group in self._futures:
                return self._futures[group], False
            parts = self._parts.setdefault(group, [])
            if part not in parts:
                parts.append(part)
            self._runs.setdefault(group, run)
            future = self._futures[group] = Future()
            return future, True

    def _execute(self, group: str, future: Future) -> None:
        start = time.time()
        try:
            with _launch.environment(self._env):
                result = self._runs[group](tuple(self._parts[group]), self._mktemp(group))
        except BaseException as e:  # pytest.fail raises an OutcomeException (a BaseException)
            _log(group, start)
            future.set_exception(e)
        else:
            _log(group, start)
            future.set_result(result)

    def _run_queued(self) -> None:
        """Run, on this thread, each queued launch nobody has started yet, in order, including
        those queued meanwhile; a lane thread then leaves the running set (under the lock that
        :meth:`plan` starts threads under, so no launch is queued with no thread to take it)."""
        while self._run_next():
            pass

    def _run_next(self) -> bool:
        """Run, on this thread, the first queued launch nobody has started; ``False`` when there
        is none (or the session is ending), and then the thread leaves the running set."""
        with self._lock:
            group = next((g for g in self._queue if g not in self._futures), None)
            if group is None or self._stopped.is_set():
                self._running.discard(threading.current_thread())
                return False
            future = self._futures[group] = Future()
        self._execute(group, future)
        return True


def folders(factory: Any) -> Callable[[str], Path]:
    """A new folder per call, named after the launch, under the basetemp of ``factory`` (the
    session's ``tmp_path_factory``): what a :class:`Lane` runs its launches in.

    The basetemp is asked for here, on the thread that plans the lane: the factory makes it on
    first use, and a lane thread and a test asking at once each made one (the launch's
    ``mktemp`` then failed: "... is not a normalized and relative path"). The folders come
    from ``tempfile.mkdtemp``, which is safe on any thread; ``mktemp`` is not meant to be."""
    base = factory.getbasetemp()  # here, on the thread that plans the lane
    # A group's name may hold paths (an environment's PYTHONPATH): one folder name of it.
    return lambda name: Path(tempfile.mkdtemp(prefix=re.sub(r"[^\w.=:-]+", "_", name)[:120]
                                              + "-", dir=base))  # fmt: skip


def _thread_count() -> int:
    value = os.environ.get(ENABLE_ENV, str(THREADS))
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{ENABLE_ENV}={value!r}: a number of threads (0 turns the lane off)")
    return count


def _log(group: str, start: float) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as log:
            name = threading.current_thread().name
            log.write(f"{group}\t{name}\t{start:.1f}\t{time.time():.1f}\n")
