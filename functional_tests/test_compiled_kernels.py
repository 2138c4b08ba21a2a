"""Every Triton kernel te_paged launches compiles for Hopper (sm_90) and Blackwell (sm_100) with
Triton's own compiler — no GPU needed, where the interpreter the CPU tests run under accepts what
the compiler may reject — without spilling, and moves rows in 128-bit accesses wherever a row's
bytes allow: ``te-paged bench --only kernels`` (``te_paged/tools/kernel_table.py``), run in the
background lane beside the in-process tests."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from te_paged.tools.kernel_table import ARCHS

from .launch import REPO_ROOT, run_python
from .prelaunch import alone

pytest.importorskip("triton", reason="the kernels are Triton's to compile")


def _run(out: Path):
    proc = run_python(["-m", "te_paged", "bench", "--only", "kernels", "--out-dir", str(out)],
                      timeout_s=600)  # fmt: skip
    return proc, out


KERNELS = alone("compiled kernels", _run)


def launched_kernels(root: Path = REPO_ROOT / "te_paged") -> set[str]:
    """The ``@triton.jit`` functions in te_paged's sources that no other one calls: the ones
    launched (the rest are inlined helpers)."""
    jit, called = set(), set()
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            if not any(ast.unparse(d).endswith("jit") for d in node.decorator_list):
                continue
            jit.add(node.name)
            called |= {c.func.id for c in ast.walk(node)
                       if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}  # fmt: skip
    return jit - called


def test_launched_kernels_are_found_in_the_sources() -> None:
    # The scan the test below relies on: the two kernels, not their inlined helper.
    assert launched_kernels() == {"_stash_kernel", "_pop_kernel"}


@pytest.mark.launch(KERNELS)
def test_every_kernel_compiles_for_hopper_and_blackwell_without_spills_at_full_width(
    launches,
) -> None:
    proc, out = launches.result(KERNELS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (table,) = out.glob("kernels-*.md")
    (js,) = out.glob("kernels-*.json")
    header = "| owner | kernel | sm |"
    assert header in table.read_text() and header in proc.stdout
    data = json.loads(js.read_text())
    rows = [r for r in data["rows"] if r["owner"] == "te_paged"]
    for arch in ARCHS:
        assert {r["kernel"] for r in rows if r["arch"] == arch} == launched_kernels(), arch
    # Every element type te_paged stashes (bf16, fp8/e8m0/NVFP4 bytes, fp32) on both archs.
    assert {r["tensor"].split("x")[0] for r in rows} >= {"bfloat16", "float8_e4m3fn", "float32"}
    assert any(r["host_tier"] for r in rows)
    spilling = [(r["kernel"], r["arch"], r["tensor"]) for r in rows if r["spill_bytes"]]
    assert not spilling, spilling
    narrow = [
        (r["kernel"], r["arch"], r["op"], r["tensor"], r["copy_load_bits"], r["copy_store_bits"])
        for r in rows
        if r["allows_128"] and not r["full_width"]
    ]
    assert not narrow, narrow
    assert all(r["loop_bytes"] > 0 for r in rows)  # each row copy's loop was found
    # megatron-core 0.19.2's two kernels, compiled the same way, side by side.
    theirs = {(r["kernel"], r["arch"]) for r in data["rows"] if r["owner"] == "megatron-core"}
    assert data["megatron_missing"] is None, data["megatron_missing"]
    assert theirs == {(k, a) for k in ("paged_stash_copy_kernel", "paged_stash_pop_kernel")
                      for a in ARCHS}  # fmt: skip
