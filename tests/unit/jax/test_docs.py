"""docs/jax.md's example runs as written, and the pages that name the JAX port link to it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytestmark = pytest.mark.torch_free  # also run without torch (scripts/jax_env.sh)

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "jax.md"


def _example() -> str:
    section = DOC.read_text().split("### Example", 1)[1]
    (code,) = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], flags=re.DOTALL)
    return code


def test_the_example_runs(capsys) -> None:
    exec(compile(_example(), str(DOC), "exec"), {"__name__": "docs_jax_example"})
    assert capsys.readouterr().out.strip() == "bitwise equal; overflow flagged"


def test_readme_and_design_link_the_jax_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "https://github.com/te-paged/te_paged/blob/main/docs/jax.md" in readme
    assert "(jax.md)" in (ROOT / "docs" / "design.md").read_text()
