"""Megatron-Bridge integration: functional tests on 4 CPU ranks (gloo), Bridge's own
``pretrain()`` and ``finetune()`` around te_paged's MoE layers.

scripts/bridge.sh installs megatron-bridge 0.6.2 and its dependencies (pinned:
``scripts/bridge-requirements.txt``) into a folder of the virtual environment of its own,
``$VENV/megatron-bridge/0.6.2``, imported by path (:func:`bridge_env`): Bridge imports
transformers and modelopt, which megatron-core's ``megatron.training`` imports too wherever
they are installed (5 s of CPU a process), so the rest of the suite does not see them. Bridge
runs on megatron-core 0.19.2.

A worker here is a Megatron functional worker (``STEPS``, ``run_cases(rank, world, out)``)
run by ``functional_tests.megatron.launch_workers`` with :mod:`te_paged.tools.preload_bridge`
imported first: the CPU shims for Bridge's loop, installed before Bridge is imported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from functional_tests.prelaunch import Launch

#: The Megatron-Bridge release the tests install and run, and the megatron-core it runs on.
BRIDGE_RELEASE = "0.6.2"
MEGATRON_RELEASE = "0.19.2"
#: What every Bridge launch imports first, before its workers.
PRELOAD = ("te_paged.tools.preload_bridge",)


def bridge_folder() -> Path:
    """Where scripts/bridge.sh installed Bridge (``$VENV/megatron-bridge/<release>``)."""
    root = os.environ.get("TE_PAGED_TEST_BRIDGE_ROOT") or str(Path(sys.prefix) / "megatron-bridge")
    return Path(root) / BRIDGE_RELEASE


def bridge_env() -> dict[str, str]:
    """Environment for a launch that imports Megatron-Bridge (fails the test when it is not
    installed): its folder first on ``PYTHONPATH``."""
    import pytest

    folder = bridge_folder()
    if not (folder / "megatron" / "bridge" / "package_info.py").is_file():
        pytest.fail(
            f"megatron-bridge {BRIDGE_RELEASE} is not in {folder}: run scripts/test.sh once"
        )
    return {"PYTHONPATH": str(folder)}


def bridge_launch(worker: str, *, timeout_s: int, own_launch: bool = False) -> Launch:
    """``functional_tests.megatron_bridge.<worker>`` on 4 ranks, Bridge imported (see
    :func:`functional_tests.megatron.workers_launch`): the Bridge workers share one launch
    unless ``own_launch``."""
    from functional_tests.megatron import workers_launch
    from functional_tests.prelaunch import Launch

    env = {"PYTHONPATH": str(bridge_folder())}
    launch = workers_launch(f"functional_tests.megatron_bridge.{worker}", timeout_s=timeout_s,
                            release=MEGATRON_RELEASE, env=env, own_launch=own_launch,
                            preload=PRELOAD)  # fmt: skip

    def run(parts: tuple[str, ...], out: Path) -> dict:
        bridge_env()  # fails the test, naming the folder, where Bridge is not installed
        return launch.run(parts, out)

    return Launch(launch.group, launch.part, run)
