"""docs/megatron.md's complete examples run as written, on 4 gloo ranks: the training step of
one's own (both releases), and the ``pretrain()`` script with its command (0.19.2).

The example's code runs unchanged, as each rank's ``__main__``; the ranks are forked from a
launcher that imported megatron-core once (``functional_tests/forkrun.py``, which gives them
what ``torchrun`` gives: 6 s of CPU a rank less on 2 cores). Every import the example needs is
its own ``from ... import`` line, which the launcher's imports cannot stand in for.
"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

import pytest

from functional_tests.launch import REPO_ROOT, forkrun
from functional_tests.megatron import RELEASES, release_env
from functional_tests.prelaunch import alone

MARKER = "<!-- example: megatron-training-step -->"
PRETRAIN = "<!-- example: megatron-pretrain -->"
PRETRAIN_COMMAND = "<!-- example: megatron-pretrain-command -->"
ITERATIONS = 4


def extract_example(
    marker: str = MARKER, language: str = "python", doc: str = "megatron.md"
) -> str:
    text = (REPO_ROOT / "docs" / doc).read_text()
    pattern = re.escape(marker) + rf"\n```{language}\n(.*?)\n```"
    match = re.search(pattern, text, re.DOTALL)
    assert match, f"docs/{doc} has no {language} block after {marker}"
    return match.group(1) + "\n"


def pretrain_command() -> tuple[str, list[str]]:
    """The documented command's script name and flags (``torchrun --nproc_per_node=4``)."""
    words = shlex.split(extract_example(PRETRAIN_COMMAND, "bash").replace("\\\n", " "))
    assert words[:2] == ["torchrun", "--nproc_per_node=4"], words[:3]
    return words[2], words[3:]


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


def _launch_pretrain(out: Path) -> str:
    name, flags = pretrain_command()
    script = out / name
    script.write_text(extract_example(PRETRAIN))  # as written
    env = {"PYTHONWARNINGS": "ignore", **release_env("0.19.2")}
    return forkrun([str(script), *flags], nproc=4, timeout_s=240, env=env, cwd=out,
                   preload=("te_paged.tools.preload_megatron",))  # fmt: skip


LAUNCH = {r: alone(f"megatron docs {r}", functools.partial(_launch, r)) for r in RELEASES}
LAUNCH_PRETRAIN = alone("megatron docs pretrain", _launch_pretrain)
LAUNCHES = [*LAUNCH.values(), LAUNCH_PRETRAIN]


@pytest.mark.parametrize("release", RELEASES)
def test_megatron_docs_example_runs_as_written(launches, release: str) -> None:
    output = launches.result(LAUNCH[release])
    assert output.count(f"megatron-core {release}") == 4, output
    lines = [line for line in output.splitlines() if line.startswith("iteration ")]
    assert [line.split()[1] for line in lines] == [str(i) for i in range(ITERATIONS)], output
    for line in lines:
        assert re.match(r"iteration \d loss \d+\.\d{4} attempt [12] \(stash overflow", line), line


def check_four_iterations_paged(output: str) -> None:
    """A 4-iteration ``pretrain()`` log with evaluations at 2 and 4: Megatron's iteration lines
    (a loss and a grad norm each), and te_paged's line per iteration (rank 0): the stash ran,
    nothing fell back."""
    line = r"iteration +(\d+)/ +4 \|.*lm loss: (\S+) .*grad norm: (\S+) \|"
    iterations = re.findall(line, output)
    assert [i for i, _, _ in iterations] == ["1", "2", "3", "4"], output[-6000:]
    assert all(float(loss) > 0 and float(norm) > 0 for _, loss, norm in iterations), iterations
    assert "validation loss at iteration 2" in output and "validation loss at iteration 4" in output
    lines = re.findall(r"te_paged: iteration (\d+): (\d+) fallback\(s\).*pools (\S+) MiB", output)
    assert [i for i, _, _ in lines] == ["1", "2", "3", "4"], output[-6000:]
    assert all(n == "0" and float(mib) > 0 for _, n, mib in lines), lines


def test_megatron_docs_pretrain_script_runs_as_written(launches) -> None:
    output = launches.result(LAUNCH_PRETRAIN)
    check_four_iterations_paged(output)
    assert "Traceback" not in output
