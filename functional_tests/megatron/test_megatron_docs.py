"""docs/megatron.md's complete example runs as written, on 4 gloo ranks.

The example's code runs unchanged, as each rank's ``__main__``; the ranks are forked from a
launcher that imported megatron-core once (``functional_tests/forkrun.py``, which gives them
what ``torchrun`` gives: 6 s of CPU a rank less on 2 cores). Every import the example needs is
its own ``from ... import`` line, which the launcher's imports cannot stand in for.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from functional_tests.launch import REPO_ROOT, forkrun
from functional_tests.megatron import RELEASES, release_env
from functional_tests.prelaunch import alone

MARKER = "<!-- example: megatron-training-step -->"
ITERATIONS = 4


def extract_example() -> str:
    text = (REPO_ROOT / "docs" / "megatron.md").read_text()
    match = re.search(re.escape(MARKER) + r"\n```python\n(.*?)\n```", text, re.DOTALL)
    assert match, f"docs/megatron.md has no python block after {MARKER}"
    return match.group(1) + "\n"


def _launch(release: str, out: Path) -> str:
    script = out / "example.py"
    # The example as written, plus one line that says which release the ranks imported.
    script.write_text(
        extract_example()
        + "from megatron.core.package_info import VERSION\n"
        # One string, one write: the four ranks share the launcher's output.
        + "print(f\"megatron-core {'.'.join(map(str, VERSION[:3]))}\", flush=True)\n"
    )
    env = {"PYTHONWARNINGS": "ignore", **release_env(release)}
    return forkrun([str(script)], nproc=4, timeout_s=180, env=env,
                   preload=("te_paged.tools.preload_megatron",))  # fmt: skip


LAUNCH = {r: alone(f"megatron docs {r}", functools.partial(_launch, r)) for r in RELEASES}
LAUNCHES = list(LAUNCH.values())


@pytest.mark.parametrize("release", RELEASES)
def test_megatron_docs_example_runs_as_written(launches, release: str) -> None:
    output = launches.result(LAUNCH[release])
    assert output.count(f"megatron-core {release}") == 4, output
    lines = [line for line in output.splitlines() if line.startswith("iteration ")]
    assert [line.split()[1] for line in lines] == [str(i) for i in range(ITERATIONS)], output
    for line in lines:
        assert re.match(r"iteration \d loss \d+\.\d{4} attempt [12] \(stash overflow", line), line
