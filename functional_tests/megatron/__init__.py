"""Megatron-core integration: functional tests on 4 CPU ranks (gloo).

Two megatron-core releases are installed for the tests (scripts/megatron.sh), each in a folder
of the virtual environment: 0.19.2 (the current release) is what every process imports by
default; a launch for 0.16.1 puts that release's folder first on ``PYTHONPATH``
(:func:`release_env`). Each worker writes the release it imported, and :func:`run_workers`
checks it.

The workers on one release run in one launch (``launch_workers.py``): megatron-core's import
and gloo's set-up are paid once. A test module declares its worker with
:func:`workers_launch` in its ``LAUNCHES`` (``functional_tests/prelaunch.py``), and reads its
results with ``launches.result(...)``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from functional_tests.prelaunch import Launch

# pytest and the lane are imported where they are used: a rank's multiprocessing children
# (megatron-core's dist_checkpointing starts one with "spawn") import this package again.

#: The releases the tests launch, the default (what an unqualified import gives) first.
DEFAULT_RELEASE = "0.19.2"
RELEASES = (DEFAULT_RELEASE, "0.16.1")
#: The ranks every worker launch runs on.
WORLD_SIZE = 4
#: ``(group, worker)`` -> that worker's share of its launch's timeout (:func:`workers_launch`).
timeouts: dict[tuple[str, str], int] = {}


def release_folder(release: str) -> Path:
    """Where scripts/megatron.sh installed ``release`` (``$VENV/megatron/<release>``)."""
    root = os.environ.get("TE_PAGED_TEST_MEGATRON_ROOT") or str(Path(sys.prefix) / "megatron")
    return Path(root) / release


def release_env(release: str) -> dict[str, str]:
    """Environment for a launch that imports megatron-core ``release`` (fails the test when
    that release is not installed)."""
    import pytest

    folder = release_folder(release)
    if not (folder / "megatron" / "core" / "package_info.py").is_file():
        pytest.fail(f"megatron-core {release} is not in {folder}: run scripts/test.sh once")
    from functional_tests.launch import REPO_ROOT

    path = [str(folder), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}


def worker_module(worker: str) -> str:
    """A worker's module: ``functional_tests.megatron.<worker>``, or ``worker`` itself when it
    is a dotted name (a worker of another package, e.g. ``functional_tests.megatron_bridge``)."""
    return worker if "." in worker else f"functional_tests.megatron.{worker}"


def run_workers(
    workers: tuple[str, ...],
    out: Path,
    *,
    world_size: int,
    timeout_s: int,
    release: str = DEFAULT_RELEASE,
    env: dict[str, str] | None = None,
    stand_ins: tuple[str, ...] = (),
    preload: tuple[str, ...] = ("te_paged.tools.preload_megatron",),
) -> dict[str, list[dict]]:
    """Launch ``functional_tests.megatron.launch_workers`` on ``world_size`` CPU ranks against
    megatron-core ``release``, running ``workers`` one after another in one process group,
    ``env`` added to the ranks' environment, the ``stand_ins`` modules (``functional_tests.
    stand_ins``: each installs a library's stand-in when imported) imported before megatron-core
    (fails the test when that release is missing or a
    rank fails); each worker's list of per-rank JSON results. The ranks are forked from a
    process that imported ``preload`` (megatron-core's modules) and the workers once
    (``functional_tests/forkrun.py``): 6 to 10 s of CPU a rank otherwise."""
    from functional_tests.launch import forkrun

    path = [*(env or {}).get("PYTHONPATH", "").split(os.pathsep),
            release_env(release)["PYTHONPATH"]]  # fmt: skip
    forkrun(
        ["-m", "functional_tests.megatron.launch_workers", "--workers", ",".join(workers),
         "--out", str(out), "--timeout-s", str(timeout_s - 30)],
        nproc=world_size,
        timeout_s=timeout_s,
        preload=(*stand_ins, *preload, *map(worker_module, workers)),
        # Megatron warns at import that TE and Apex are absent.
        env={"PYTHONWARNINGS": "ignore", **(env or {}),
             "PYTHONPATH": os.pathsep.join(p for p in path if p)},
    )  # fmt: skip
    results = {}
    for worker in workers:
        name = worker.rsplit(".", 1)[-1]
        ranks = [json.loads((out / name / f"rank{r}.json").read_text())
                 for r in range(world_size)]  # fmt: skip
        assert all(r["world_size"] == world_size for r in ranks)
        assert all(r["megatron_core"] == release for r in ranks), (release, ranks[0])
        results[worker] = ranks
    return results


def workers_launch(
    worker: str,
    *,
    timeout_s: int,
    release: str = DEFAULT_RELEASE,
    env: dict[str, str] | None = None,
    own_launch: bool = False,
    stand_ins: tuple[str, ...] = (),
    preload: tuple[str, ...] = ("te_paged.tools.preload_megatron",),
) -> Launch:
    """``worker`` on 4 ranks as a :class:`~functional_tests.prelaunch.Launch`: every worker the
    collected tests need on the same release and environment runs in one launch, whose timeout
    is the sum of theirs (``own_launch``: a launch of its own, for a worker whose length alone
    is most of a test's timeout; ``stand_ins``: see :func:`run_workers`, a launch of their
    own; ``preload``: see :func:`run_workers`, the group's). Its result is the worker's list
    of per-rank results."""
    from functional_tests.prelaunch import Launch

    words = ["megatron", release, *(f"{k}={v}" for k, v in sorted((env or {}).items()))]
    words += [f"stand-in:{name.rsplit('.', 1)[-1]}" for name in stand_ins]
    words += [f"preload:{name.rsplit('.', 1)[-1]}" for name in preload
              if name != "te_paged.tools.preload_megatron"]  # fmt: skip
    group = " ".join([*words, worker] if own_launch else words)
    timeouts[group, worker] = timeout_s

    def run(parts: tuple[str, ...], out: Path) -> dict[str, list[dict]]:
        total = sum(timeouts[group, part] for part in parts)
        return run_workers(parts, out, world_size=WORLD_SIZE, timeout_s=total, release=release,
                           env=env, stand_ins=stand_ins, preload=preload)  # fmt: skip

    return Launch(group, worker, run)
