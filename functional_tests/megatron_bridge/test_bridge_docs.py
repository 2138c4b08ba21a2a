"""docs/megatron-bridge.md's complete script runs as written, with its command, on 4 gloo ranks
(forked from a launcher that imported Bridge once, ``functional_tests/forkrun.py``, which gives
the ranks what ``torchrun`` gives; the script's code runs unchanged as each rank's
``__main__``)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from functional_tests.launch import forkrun
from functional_tests.megatron import release_env
from functional_tests.megatron.test_megatron_docs import (
    check_four_iterations_paged,
    extract_example,
)
from functional_tests.megatron_bridge import MEGATRON_RELEASE, PRELOAD, bridge_env, bridge_folder
from functional_tests.prelaunch import alone

SCRIPT = "<!-- example: megatron-bridge -->"
COMMAND = "<!-- example: megatron-bridge-command -->"
DOC = "megatron-bridge.md"


def _launch(out: Path) -> str:
    bridge_env()  # fails the test, naming the folder, where Bridge is not installed
    words = shlex.split(extract_example(COMMAND, "bash", DOC).replace("\\\n", " "))
    assert words[:2] == ["torchrun", "--nproc_per_node=4"], words[:3]
    script = out / words[2]
    script.write_text(extract_example(SCRIPT, "python", DOC))  # as written
    path = [str(bridge_folder()), release_env(MEGATRON_RELEASE)["PYTHONPATH"]]
    env = {"PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(path)}
    return forkrun([str(script), *words[3:]], nproc=4, timeout_s=180, env=env, cwd=out,
                   preload=PRELOAD)  # fmt: skip


LAUNCH = alone("megatron-bridge docs", _launch)
LAUNCHES = [LAUNCH]


def test_the_bridge_script_runs_as_written(launches) -> None:
    output = launches.result(LAUNCH)
    check_four_iterations_paged(output)  # te_paged's line through Bridge's state
    # No exception: Bridge's import logs (INFO) the tracebacks of its optional imports that
    # fail without Transformer Engine ("Import of ... failed with: Traceback ..."), mid-line.
    assert not re.search(r"^(\[rank\d\]: )?Traceback", output, re.MULTILINE), output[-6000:]
