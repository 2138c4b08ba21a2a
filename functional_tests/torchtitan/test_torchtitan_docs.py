"""docs/torchtitan.md's example, run as written: ``torchrun --nproc_per_node 2`` on CPU."""

from __future__ import annotations

import re

import pytest

from functional_tests.launch import REPO_ROOT, torchrun

pytest.importorskip("torchtitan")  # installed by scripts/test.sh; never skipped in CI

EXAMPLE = re.compile(r"<!-- example: torchtitan-train -->\n```python\n(.*?)\n```", re.DOTALL)


def test_the_docs_example_trains_under_paged_stash_trainer(tmp_path):
    (code,) = EXAMPLE.findall((REPO_ROOT / "docs" / "torchtitan.md").read_text())
    script = tmp_path / "train_paged.py"
    script.write_text(code + "\n")
    out = torchrun(  # in tmp_path: torchtitan writes its dump folder, ./outputs, there
        [str(script)], nproc=2, timeout_s=300, env={"PYTHONWARNINGS": "ignore"}, cwd=tmp_path
    )
    steps = re.findall(r"step (\d+): attempt (\d), paged (True|False)", out)
    assert len(steps) == 2 * 3, out[-3000:]  # both ranks, three steps
    assert {s for s, _a, _p in steps} == {"1", "2", "3"}
    # Every step either kept its paged attempt or reran once without the stash.
    assert all((a, p) in (("1", "True"), ("2", "False")) for _s, a, p in steps)
    assert ("1", "True") in {(a, p) for _s, a, p in steps}
