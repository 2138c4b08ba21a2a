"""Run a worker under ``torchrun`` or ``forkrun``, or any Python command, with a hard timeout
and no processes left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
_LIVE: dict[subprocess.Popen, threading.Thread] = {}  # running now -> the thread waiting on it
_LIVE_LOCK = threading.Lock()
_BASE = threading.local()  # .env: this thread's base environment for commands (environment())


def torchrun(
    args: list[str], *, nproc: int, timeout_s: int, env: dict | None = None, cwd=None
) -> str:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N *args``; its output
    (stdout and stderr together). Fails the test on a non-zero exit or after ``timeout_s``."""
    cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return _ranks("torchrun", cmd, timeout_s=timeout_s, env=env, cwd=cwd)


def forkrun(
    args: list[str],
    *,
    nproc: int,
    timeout_s: int,
    preload: tuple[str, ...] = (),
    env: dict | None = None,
    cwd=None,
) -> str:
    """:func:`torchrun`'s contract, with the ranks forked from one process that imported
    ``preload`` and the worker once (``functional_tests/forkrun.py``): for the CPU workers
    and docs examples whose imports are most of their CPU time."""
    cmd = ["-m", "functional_tests.forkrun", f"--nproc={nproc}", f"--preload={','.join(preload)}",
           *args]  # fmt: skip
    return _ranks("forkrun", cmd, timeout_s=timeout_s, env=env, cwd=cwd)


def _ranks(what: str, cmd: list[str], *, timeout_s: int, env: dict | None, cwd) -> str:
    # The ranks share the CPU cores.
    proc = run_python(cmd, timeout_s=timeout_s, env={"OMP_NUM_THREADS": "1", **(env or {})},
                      cwd=cwd, merge_output=True)  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({proc.returncode}):\n{proc.stdout[-12000:]}")
    return proc.stdout


@contextlib.contextmanager
def environment(env: Mapping[str, str]) -> Iterator[None]:
    """Commands this thread starts inside the block get ``env``, not the live ``os.environ``,
    as the environment ``run_python`` adds to. A launch on the background lane runs beside the
    tests; a test's ``monkeypatch.setenv`` (``RANK``/``WORLD_SIZE`` for an in-process ``ab``)
    must not reach the ranks it starts."""
    _BASE.env = dict(env)
    try:
        yield
    finally:
        del _BASE.env


def run_python(
    args: list[str],
    *,
    timeout_s: int,
    env: dict | None = None,
    cwd=None,
    merge_output: bool = False,
) -> subprocess.CompletedProcess:
    """``python *args`` from the repository root (or ``cwd``) with the repository on
    ``PYTHONPATH`` and ``env`` added to the environment (``os.environ``, or the one
    :func:`environment` set on this thread); its exit status and output, stderr in stdout with
    ``merge_output``.

    It runs in a session of its own. After ``timeout_s`` (a test failure), or when the test
    session ends first (:func:`end_all`), it gets SIGTERM, on which torchrun and ``te-paged
    ab`` end their ranks; should that not end it within 30 s, its whole process group is killed.
    """
    base = getattr(_BASE, "env", os.environ)
    full_env = {
        **base,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), base.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO_ROOT if cwd is None else cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with _LIVE_LOCK:
        _LIVE[proc] = threading.current_thread()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out, err = _end(proc)
        pytest.fail(f"{' '.join(args[:4])} timed out after {timeout_s} s:\n"
                    f"{(out or '')[-12000:]}{(err or '')[-12000:]}")  # fmt: skip
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(proc, None)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out or "", err or "")


def _end(proc: subprocess.Popen) -> tuple[str | None, str | None]:
    """SIGTERM to the launcher (which ends its ranks); SIGKILL to its whole process group
    when that has not ended it within 30 s. Its output."""
    proc.terminate()
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.communicate()


def end_all(thread: threading.Thread | None = None) -> None:
    """End every command still running, with its ranks, or only those ``thread`` waits on (the
    session is ending: a launch on the background lane must not outlive it)."""
    with _LIVE_LOCK:
        live = [proc for proc, owner in _LIVE.items() if thread in (None, owner)]
    for proc in live:
        if proc.poll() is None:
            proc.terminate()
    for proc in live:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
