"""docs/torchtitan.md's example, run as written on 2 CPU ranks: the script unchanged, as each
rank's ``__main__``, its ranks forked from a launcher that imported torchtitan's Trainer once
(``functional_tests/forkrun.py``, which gives them what ``torchrun --nproc_per_node 2`` gives:
8 to 9 s of CPU a rank less on 2 cores)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from functional_tests.launch import REPO_ROOT, forkrun
from functional_tests.prelaunch import alone

pytest.importorskip("torchtitan")  # installed by scripts/test.sh; never skipped in CI

EXAMPLE = re.compile(r"<!-- example: torchtitan-train -->\n```python\n(.*?)\n```", re.DOTALL)


def _launch(out: Path) -> str:
    (code,) = EXAMPLE.findall((REPO_ROOT / "docs" / "torchtitan.md").read_text())
    script = out / "train_paged.py"
    script.write_text(code + "\n")
    output = forkrun(  # in out: torchtitan writes its dump folder, ./outputs, there
        [str(script)],
        nproc=2,
        timeout_s=300,
        env={"PYTHONWARNINGS": "ignore"},
        cwd=out,
        preload=("te_paged.tools.preload_torchtitan",),
    )
    return output


LAUNCH = alone("torchtitan docs", _launch)
LAUNCHES = [LAUNCH]


def test_the_docs_example_trains_under_paged_stash_trainer(launches):
    out = launches.result(LAUNCH)
    steps = re.findall(r"step (\d+): attempt (\d), paged (True|False)", out)
    assert len(steps) == 2 * 3, out[-3000:]  # both ranks, three steps
    assert {s for s, _a, _p in steps} == {"1", "2", "3"}
    # Every step either kept its paged attempt or reran once without the stash.
    assert all((a, p) in (("1", "True"), ("2", "False")) for _s, a, p in steps)
    assert ("1", "True") in {(a, p) for _s, a, p in steps}
