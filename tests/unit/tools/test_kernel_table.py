"""The compiled-kernel table finds the row copy by the cubin's line info: it must read the
sources the cubin was compiled from, never another checkout's (Triton's cache keys a kernel by
its source text and line numbers, not by its file's path)."""

from __future__ import annotations

import subprocess
import types

import pytest

pytest.importorskip("triton")

from triton import knobs

from te_paged.tools import kernel_table
from te_paged.tools.launches import Launch


def _launch(fn) -> Launch:
    return Launch(kernel=types.SimpleNamespace(fn=fn), grid=(1,), args=(), kwargs={})


def test_the_cache_is_one_of_the_kernels_source_files() -> None:
    before = knobs.cache.dir
    here = _launch(test_the_cache_is_one_of_the_kernels_source_files)
    elsewhere = _launch(subprocess.run)  # a function of another file
    with kernel_table.checkout_cache([here]):
        mine = knobs.cache.dir
    with kernel_table.checkout_cache([here]):
        again = knobs.cache.dir
    with kernel_table.checkout_cache([elsewhere]):
        theirs = knobs.cache.dir
    assert knobs.cache.dir == before, "the cache directory was not restored"
    assert mine != before, "compiled into the shared cache, where another checkout's cubins are"
    assert mine == again and mine != theirs, (mine, again, theirs)


def test_line_info_naming_a_missing_file_is_an_error(monkeypatch) -> None:
    dump = (
        '        //## File "/gone/te_paged/kernels/triton_stash.py", line 12\n'
        "        /*0070*/                   STG.E.128 desc[UR4][R2.64], R4 ;\n"
    )
    monkeypatch.setattr(kernel_table, "_tool", lambda name: name)
    monkeypatch.setattr(kernel_table.subprocess, "run",
                        lambda *a, **k: types.SimpleNamespace(stdout=dump))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"/gone/te_paged/kernels/triton_stash\.py"):
        kernel_table._sass(b"cubin")
