"""``te-paged ab --engine bridge``: Megatron-Bridge's ``pretrain()`` OFF then ON on 4 spawned CPU
ranks (EP 4), with the megatron engine's table and run record (bitwise equality, the saving
against the reload-adjusted model, the wire). A smaller model than the engine's default (64
hidden, 64 tokens a sequence, 2 steps: the capture step and a measured one) keeps it near a
minute and a half on 2 cores."""

from __future__ import annotations

import re

import pytest

from functional_tests.launch import run_python
from functional_tests.megatron_bridge import bridge_env, bridge_folder
from functional_tests.prelaunch import alone
from functional_tests.test_cli import bitwise_with_saving
from functional_tests.test_run_record import check_record

ARGS = ["--engine", "bridge", "--steps", "2", "--layers", "4", "--hidden", "64", "--ffn", "128",
        "--seq-length", "64"]  # fmt: skip


def _ab(out):
    bridge_env()  # fails the test, naming the folder, where Bridge is not installed
    js = out / "ab.json"
    proc = run_python(["-m", "te_paged", "ab", *ARGS, "--json", str(js)], timeout_s=240,
                      env={"PYTHONPATH": str(bridge_folder())})  # fmt: skip
    return proc, js


LAUNCH = alone("cli ab bridge", _ab)
LAUNCHES = [LAUNCH]


@pytest.mark.launch(LAUNCH)
def test_ab_engine_bridge_is_bitwise_and_saves_memory(launches) -> None:
    proc, js = launches.result(LAUNCH)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = ("megatron-bridge 0.6.2 (megatron-core 0.19.2): Bridge's pretrain(), the step "
             "driven by Megatron's own PagedStashRunner")  # fmt: skip
    assert first in proc.stdout and "| step | loss ON | loss OFF |" in proc.stdout
    # No exception (Bridge's import notes of optional TE imports carry a traceback mid-line).
    assert not re.search(r"^(\[rank\d\]: )?Traceback", proc.stderr, re.MULTILINE), proc.stderr
    data = check_record(js)  # strict JSON, valid against the schema
    assert data["engine"] == "bridge" and data["world_size"] == 4
    assert data["megatron_bridge_version"] == "0.6.2"
    assert data["megatron_core_version"] == "0.19.2"
    assert data["config"]["runner"] == "megatron" and data["config"]["layers"] == 4
    assert data["memory"]["step"] == 1 and "| 1 (paged) |" in proc.stdout
    bitwise_with_saving(data)
    assert data["wire"]["on_bytes"] > 0, data["wire"]
