"""Start the ranks of ``te-paged ab``, watch them, and end a run whose ranks stall or die.

The parent makes a private temporary directory (mode 0700, a fresh name: nothing another user
could plant or read), spawns the ranks, and polls them. Each rank keeps a heartbeat file there
(``rank<r>.json``: its pid and the last step it finished) and writes its failure there when it
fails; rank 0 writes its result there. Inside each rank a :class:`RankWatchdog` ends the
process when it makes no progress for the timeout (a peer that stopped leaves it blocked in a
collective); the process group's own timeout usually fires first. When any rank fails, the
parent names the culprits — ranks whose process is stopped or was killed by a signal, else the
ranks that fell behind — kills every rank still there (SIGKILL also ends a stopped process) and
raises :class:`RankFailure` with one line. No process is left behind, and the directory is
removed.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Interrupted", "RankFailure", "RankWatchdog", "rendezvous_url", "spawn_ranks"]

RESULT = "result.pkl"
_POLL_S = 0.2


class RankFailure(RuntimeError):
    """A rank failed, stalled or died; the message names it and what it last finished."""


class Interrupted(Exception):
    """The parent got SIGINT, SIGTERM or SIGHUP: every rank was ended and the temporary
    directory removed before this was raised."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Signals:
    """The parent's handlers while ranks run. A signal that comes while the ranks are being
    started is held (raising then would lose the processes already started) and acted on once
    they are; one that comes while they run raises :class:`Interrupted` at once; any that come
    during the clean-up (a second Ctrl-C) are ignored, so the clean-up always finishes."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self.raising = False
        self.saved: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():  # handlers: main thread only
            for signum in _SIGNALS:
                self.saved[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.pending is None:
            self.pending = signum
        if self.raising:
            self.raising = False  # the clean-up runs with no more raises
            raise Interrupted(signum)

    def arm(self) -> None:
        """The ranks are started: raise now for a held signal, and at once from here on."""
        if self.pending is not None:
            raise Interrupted(self.pending)
        self.raising = True

    def disarm(self) -> None:
        self.raising = False

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


class RankWatchdog:
    """In a rank: :meth:`progress` records what finished (and the heartbeat file, when the run
    has a directory); a daemon thread ends the process with status 3 when no progress came for
    ``timeout_s`` — a rank blocked forever in a collective cannot raise by itself."""

    def __init__(self, rank: int, timeout_s: float, directory: Path | None = None) -> None:
        self.rank, self.timeout_s, self.directory = rank, timeout_s, directory
        self.last = "start"
        self._stamp = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="te-paged-watchdog")
        self._write({"last": self.last})

    def start(self) -> RankWatchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()

    def progress(self, what: str) -> None:
        self.last, self._stamp = what, time.monotonic()
        self._write({"last": what})

    def fail(self, error: BaseException) -> None:
        """Record why this rank fails (one line), for the parent's message."""
        line = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        self._write({"last": self.last, "error": line})

    def _write(self, fields: dict[str, Any]) -> None:
        if self.directory is None:
            return
        path = self.directory / f"rank{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "pid": os.getpid(), **fields}))
        tmp.replace(path)  # atomic: the parent never reads half a file

    def _watch(self) -> None:
        while not self._done.wait(1.0):
            idle = time.monotonic() - self._stamp
            if idle > self.timeout_s:
                message = (
                    f"te-paged ab: rank {self.rank} made no progress for {idle:.0f} s after "
                    f"{self.last} (waiting for a rank that stopped?); ending it"
                )
                print(message, file=sys.stderr, flush=True)
                self._write({"last": self.last, "error": message})
                os._exit(3)


def _heartbeats(directory: Path, nproc: int) -> dict[int, dict]:
    beats = {}
    for rank in range(nproc):
        try:
            beats[rank] = json.loads((directory / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            continue
    return beats


def _process_state(pid: int) -> str:
    try:
        import psutil

        return psutil.Process(pid).status()
    except Exception:  # psutil missing, or the process is gone
        return "gone"


def _diagnose(procs: list, beats: dict[int, dict], timeout_s: float) -> str:
    """One line: which ranks are to blame, and how far each got."""
    culprits = []
    for rank, proc in enumerate(procs):
        state = _process_state(proc.pid) if proc.is_alive() else "exited"
        code = proc.exitcode
        last = beats.get(rank, {}).get("last", "start")
        if state == "stopped":
            culprits.append(f"rank {rank} (pid {proc.pid}) is stopped, after {last}")
        elif code is not None and code < 0:
            name = (
                signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else code
            )
            culprits.append(f"rank {rank} (pid {proc.pid}) was killed by {name}, after {last}")
    if not culprits:  # nobody stopped or killed: blame the errors they reported
        for rank in sorted(beats):
            error = beats[rank].get("error")
            if error and "made no progress" not in error:
                last = beats[rank].get("last", "start")
                culprits.append(f"rank {rank} failed after {last}: {error}")
    if not culprits:
        where = "; ".join(f"rank {r}: {b.get('last', 'start')}" for r, b in sorted(beats.items()))
        culprits.append(f"no rank progressed for {timeout_s:.0f} s ({where})")
    return "; ".join(culprits)


def _kill(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)  # also ends a stopped process, unlike SIGTERM
    for proc in procs:
        proc.join(10)


def _entry(
    rank: int, target: Callable, nproc: int, directory: str, timeout_s: float, tb: bool, *args
):
    watchdog = RankWatchdog(rank, timeout_s, Path(directory)).start()
    try:
        result = target(rank, nproc, watchdog, *args)
        if rank == 0:
            with open(Path(directory) / RESULT, "wb") as f:
                pickle.dump(result, f)
    except BaseException as e:
        watchdog.fail(e)
        if tb:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    # Done, result written (rank 0) after the run's final barrier.
    watchdog.stop()
    leave(0)


def leave(status: int):
    """End this rank's process with ``status`` without the interpreter's teardown: under load,
    gloo's native threads were seen to abort a rank at exit ("terminate called without an
    active exception"), failing a complete run (a spawned rank's, and one of torchrun's). What
    the skipped teardown would have released must still be: multiprocessing's own finalizers
    unlink the named semaphores this rank created (torch.fx's interpreter builds a tqdm bar
    under torch.compile, and tqdm's lock is one), else a parent's resource_tracker warns of
    leaked semaphores at exit. The caller has closed its files."""
    multiprocessing.util._run_finalizers(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def rendezvous_url(watchdog: RankWatchdog) -> str:
    """``init_method`` for the ranks of one :func:`spawn_ranks` run: a file in the run's private
    directory. No TCP port is picked, so runs started at the same time cannot race for one (a
    port found free and then bound by another run failed a rank with ``EADDRINUSE``)."""
    if watchdog.directory is None:
        raise ValueError("rendezvous_url needs a rank started by spawn_ranks")
    return (watchdog.directory / "rendezvous").resolve().as_uri()


def spawn_ranks(
    target: Callable,
    nproc: int,
    timeout_s: float,
    *args: Any,
    tracebacks: bool = False,
    preload: tuple[str, ...] = (),
) -> Any:
    """Run ``target(rank, nproc, watchdog, *args)`` on ``nproc`` spawned processes; return
    rank 0's return value, or raise :class:`RankFailure` (every process ended). A failing rank
    reports one line; ``tracebacks`` also prints its traceback.

    ``preload``: modules to import once, in a forkserver the ranks are then forked from, instead
    of in every rank (torch's import alone is seconds of CPU a rank). Only for modules whose
    import touches no accelerator: a process forked after CUDA was initialised cannot use it.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    if preload:
        multiprocessing.set_forkserver_preload(list(preload))

    directory = tempfile.mkdtemp(prefix="te_paged_ab_")  # 0700, a name no one can predict
    procs: list = []
    with _Signals() as signals:
        try:
            ctx = mp.start_processes(
                _entry,
                args=(target, nproc, directory, timeout_s, tracebacks, *args),
                nprocs=nproc,
                join=False,
                start_method="forkserver" if preload else "spawn",
            )
            procs = ctx.processes
            signals.arm()
            return _poll_ranks(procs, directory, timeout_s)
        except BaseException:
            signals.disarm()
            _kill(procs)
            raise
        finally:
            signals.disarm()
            shutil.rmtree(directory, ignore_errors=True)


def _poll_ranks(procs: list, directory: str, timeout_s: float) -> Any:
    """Poll the ranks until all finished (rank 0's result) or one failed (RankFailure)."""
    # The parent's own limit, for ranks that cannot even run their watchdog (stopped).
    grace = timeout_s * 1.5 + 30
    seen: dict[int, str] = {}
    stamp = time.monotonic()
    while not all(p.exitcode == 0 for p in procs):
        beats = _heartbeats(Path(directory), len(procs))
        now = {r: b.get("last", "") for r, b in beats.items()}
        if now != seen:
            seen, stamp = now, time.monotonic()
        failed = any(p.exitcode not in (None, 0) for p in procs)
        if failed or time.monotonic() - stamp > grace:
            raise RankFailure(_diagnose(procs, beats, timeout_s))
        time.sleep(_POLL_S)
    for proc in procs:
        proc.join()
    with open(Path(directory) / RESULT, "rb") as f:
        return pickle.load(f)
