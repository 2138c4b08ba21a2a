"""The compiled-kernel table finds the row copy by the cubin's line info: it reads the sources
imported here, whichever checkout compiled the cubin (Triton's cache keys a kernel by its source
text and line numbers, not by its file's path; a cubin another checkout cached names that
checkout's files, which may be gone)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import te_paged
from te_paged.tools import kernel_table
from te_paged.tools.launches import Launch

STASH = Path(te_paged.__file__).parent / "kernels" / "triton_stash.py"


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _sass(monkeypatch, recorded: str, line: int):
    dump = (
        f'        //## File "{recorded}", line {line}\n'
        "        /*0070*/                   STG.E.128 desc[UR4][R2.64], R4 ;\n"
    )
    monkeypatch.setattr(kernel_table, "_tool", lambda name: name)
    monkeypatch.setattr(kernel_table, "resource_usage", lambda cubin: {})
    monkeypatch.setattr(kernel_table.subprocess, "run",
                        lambda *a, **k: types.SimpleNamespace(stdout=dump))  # fmt: skip
    launch = Launch(kernel=types.SimpleNamespace(fn=kernel_table.analyse), grid=(1,), args=(),
                    kwargs={})  # fmt: skip
    roots = kernel_table.source_roots([launch])
    assert roots == {"te_paged": STASH.parents[1]}, roots
    return kernel_table._sass(b"cubin", roots)


def test_a_cubin_cached_by_a_checkout_that_is_gone_reads_this_checkouts_sources(
    monkeypatch,
) -> None:
    line = _line(STASH, "tl.store(dev_pool_ptr + pool_off")
    (store,), _ = _sass(monkeypatch, "/gone/checkout/te_paged/kernels/triton_stash.py", line)
    assert store.row_store, "the row copy's store was not found from the gone checkout's path"


def test_line_info_naming_no_source_imported_here_is_an_error(monkeypatch) -> None:
    with pytest.raises(RuntimeError, match=r"names /gone/elsewhere/stash\.py, which is not among"):
        _sass(monkeypatch, "/gone/elsewhere/stash.py", 3)
