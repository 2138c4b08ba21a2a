"""te_paged reports runtime events through ``logging`` only: quiet below WARNING by default."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import te_paged

PACKAGE = pathlib.Path(te_paged.__file__).parent
CLI = {PACKAGE / "cli.py", PACKAGE / "tools"}  # the command line's own output may print


def test_without_logging_configured_a_fallback_warns_on_stderr_and_info_stays_quiet() -> None:
    # A fresh interpreter with no logging configuration: te_paged adds no handler (not even a
    # NullHandler, which would swallow WARNINGs too), so Python's last-resort handler shows
    # WARNING and above on stderr, and INFO (the pool sizing) is not shown.
    code = textwrap.dedent(
        """
        import logging
        import te_paged
        from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch
        assert logging.getLogger("te_paged").handlers == []
        cfg = ModelConfig(layers=2, experts=4, topk=2, hidden=16, ffn=32, tokens=24,
                          page_size=4, buffer_factor_cuda=0.3, steps=2)
        model = ToyMoEModel(cfg, paged=True, group=None)
        runner = te_paged.PagedStashRunner(model, model.manager, grow_pool=False)
        for step in range(2):
            x, target = make_batch(cfg, step, 0)
            record = runner.step(lambda: model(x, target).backward())[1]
        assert record.attempt == 2, record
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("PagedStashRunner: step 1 reruns dropless without the paged stash")
    assert "pools sized" not in out.stderr


def _prints(path: pathlib.Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "print"
    ]


def test_the_library_never_prints() -> None:
    found = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path == c or c in path.parents for c in CLI)
        if (lines := _prints(path))
    }
    assert found == {}, f"print() in the library (use logging.getLogger(__name__)): {found}"


def test_the_print_scan_finds_a_print(tmp_path) -> None:
    path = tmp_path / "m.py"
    path.write_text("def f():\n    print('x')\n")
    assert _prints(path) == [2]
