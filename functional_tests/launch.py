"""Run a worker under ``torchrun`` with a hard timeout and no processes left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def torchrun(
    args: list[str], *, nproc: int, timeout_s: int, env: dict | None = None, cwd=None
) -> str:
    """``python -m torch.distributed.run --standalone --nproc_per_node=N *args``; its output.

    Fails the test on a non-zero exit or after ``timeout_s``. The launcher runs in a session of
    its own: on a timeout it gets SIGTERM (on which it ends its workers); should that not end
    it within 30 s, the whole process group is killed.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *args,
    ]
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # the ranks share the CPU cores
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT if cwd is None else cwd,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout_s} s:\n{output[-12000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun failed ({proc.returncode}):\n{output[-12000:]}")
    return output
