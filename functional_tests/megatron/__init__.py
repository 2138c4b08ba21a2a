"""Megatron-core integration: functional tests launched with torchrun.

Two megatron-core releases are installed for the tests (scripts/megatron.sh), each in a folder
of the virtual environment: 0.19.2 (the current release) is what every process imports by
default; a launch for 0.16.1 puts that release's folder first on ``PYTHONPATH``
(:func:`release_env`). Each worker writes the release it imported, and :func:`run_workers`
checks it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

#: The releases the tests launch, the default (what an unqualified import gives) first.
DEFAULT_RELEASE = "0.19.2"
RELEASES = (DEFAULT_RELEASE, "0.16.1")


def release_folder(release: str) -> Path:
    """Where scripts/megatron.sh installed ``release`` (``$VENV/megatron/<release>``)."""
    root = os.environ.get("TE_PAGED_TEST_MEGATRON_ROOT") or str(Path(sys.prefix) / "megatron")
    return Path(root) / release


def release_env(release: str) -> dict[str, str]:
    """Environment for a launch that imports megatron-core ``release`` (fails the test when
    that release is not installed)."""
    folder = release_folder(release)
    if not (folder / "megatron" / "core" / "package_info.py").is_file():
        pytest.fail(f"megatron-core {release} is not in {folder}: run scripts/test.sh once")
    from functional_tests.launch import REPO_ROOT

    path = [str(folder), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}


def run_workers(
    worker: str,
    out: Path,
    *,
    world_size: int,
    timeout_s: int,
    release: str = DEFAULT_RELEASE,
    env: dict[str, str] | None = None,
) -> list[dict]:
    """Launch ``functional_tests.megatron.<worker>`` on ``world_size`` CPU ranks with torchrun
    against megatron-core ``release`` (fails the test when that release is missing or a rank
    fails), ``env`` added to the ranks' environment; each rank's JSON result."""
    from functional_tests.launch import torchrun

    torchrun(
        ["-m", f"functional_tests.megatron.{worker}", "--out", str(out),
         "--timeout-s", str(timeout_s - 30)],
        nproc=world_size,
        timeout_s=timeout_s,
        # Megatron warns at import that TE and Apex are absent.
        env={"PYTHONWARNINGS": "ignore", **release_env(release), **(env or {})},
    )  # fmt: skip
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert all(r["world_size"] == world_size for r in results)
    assert all(r["megatron_core"] == release for r in results), (release, results[0])
    return results
