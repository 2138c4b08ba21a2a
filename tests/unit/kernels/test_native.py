"""The compiled page mover (``te_paged.kernels.native``): its bytes, its build cache, and every
way it can be unavailable (the reference then keeps its torch ops)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from te_paged.kernels import native, reference


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not built the mover yet, with its own cache directory."""
    monkeypatch.setattr(native, "_BUILT", [])
    monkeypatch.setenv("TE_PAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TE_PAGED_NATIVE", raising=False)
    return tmp_path


def _mover():
    mover = native.page_mover()
    assert mover is not None, native.page_mover_status().reason
    return mover


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler: nothing to build")
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("page_bytes", [2, 48, 300_000, 2 * (1 << 18)])  # across chunk sizes
@pytest.mark.parametrize("tail", [0, 1, 0.5])  # no tail, one byte, half a page
def test_mover_moves_pages_and_a_tail_both_ways(page_bytes, threads, tail) -> None:
    mover = _mover()
    tail_bytes = int(tail * page_bytes) if tail != 1 else 1
    gen = torch.Generator().manual_seed(page_bytes + threads)
    pool = torch.randint(0, 256, (9, page_bytes), generator=gen, dtype=torch.uint8)
    buf = torch.randint(0, 256, (6, page_bytes), generator=gen, dtype=torch.uint8)
    pages = torch.tensor([7, 0, 3, 8, 5, 1], dtype=torch.int32)  # slot 5: the tail's page
    want = pool.clone()
    want[pages[:5].long()] = buf[:5]
    want[1, :tail_bytes] = buf[5, :tail_bytes]
    args = (pages.data_ptr(), 5, page_bytes, tail_bytes)
    mover(pool.data_ptr(), buf.data_ptr(), *args, True, threads)
    assert torch.equal(pool, want)
    back = torch.zeros_like(buf)
    mover(pool.data_ptr(), back.data_ptr(), *args, False, threads)
    assert torch.equal(back[:5], buf[:5])
    assert torch.equal(back[5, :tail_bytes], buf[5, :tail_bytes]) and not back[5, tail_bytes:].any()
    for bad in ((0, page_bytes, 0), (5, page_bytes, page_bytes), (5, 0, 0), (-1, page_bytes, 0)):
        mover(pool.data_ptr(), buf.data_ptr(), pages.data_ptr(), *bad, True, threads)
    assert torch.equal(pool, want)  # nothing to move, or refused: nothing moves


def test_builds_where_a_compiler_is_found_and_reuses_the_cache(fresh, monkeypatch) -> None:
    status = native.page_mover_status()
    if native._compiler() is None:  # this machine cannot build it: it must say so
        assert not status.available and "no C compiler" in status.reason
        return
    assert status.available, status.reason
    (built,) = fresh.glob("page_mover-*.so")
    # A second process loads the cached library without compiling.
    monkeypatch.setattr(native, "_BUILT", [])

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again despite the cache")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native.page_mover_status().available
    assert list(fresh.glob("page_mover-*.so")) == [built]  # no stray temporary files


def test_disabled_by_the_environment(fresh, monkeypatch) -> None:
    monkeypatch.setenv("TE_PAGED_NATIVE", "0")
    assert native.page_mover() is None
    assert native.page_mover_status().reason == "disabled by TE_PAGED_NATIVE=0"
    assert not any(fresh.iterdir())


def test_no_compiler_is_reported_and_logged(fresh, monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", "te-paged-no-such-compiler")
    with caplog.at_level("INFO", logger=native.__name__):
        assert native.page_mover() is None
        native.page_mover()
    assert "no C compiler" in native.page_mover_status().reason
    assert len(caplog.records) == 1  # once per process, not per stash
    assert "torch ops" in caplog.records[0].getMessage()


@pytest.mark.skipif(shutil.which("false") is None, reason="needs the 'false' command")
def test_a_failing_build_is_reported_and_leaves_nothing(fresh, monkeypatch) -> None:
    monkeypatch.setenv("CC", "false")  # exits 1 like a compiler without OpenMP would
    assert native.page_mover() is None
    assert "failed" in native.page_mover_status().reason
    assert not list(fresh.glob("*.so"))


def test_an_unwritable_cache_is_reported(fresh, monkeypatch) -> None:
    blocker = fresh / "file"
    blocker.write_text("")
    monkeypatch.setenv("TE_PAGED_CACHE_DIR", str(blocker / "cache"))  # under a file: no mkdir
    if native._compiler() is None:
        assert "no C compiler" in native.page_mover_status().reason
        return
    status = native.page_mover_status()
    assert not status.available and status.reason.startswith(("NotADirectoryError", "FileExists"))


@pytest.mark.skipif(native._compiler() is None, reason="no C compiler: nothing to build")
@pytest.mark.parametrize("pages", [[0, 4], [0, -1], [0]], ids=["past pool", "negative", "short"])
def test_the_reference_refuses_page_ids_the_mover_would_write_outside(pages) -> None:
    # 2 pages of 2 rows; 3 rows need 2 page ids inside the pool, else no byte moves.
    pool, buf = torch.zeros(4, 3, dtype=torch.int16), torch.ones(3, 3, dtype=torch.int16)
    ids = torch.tensor(pages, dtype=torch.int32)
    with pytest.raises(ValueError, match="are not 2 pages of a pool of 2"):
        reference._move_rows(3, 2, pages, ids, pool, buf, to_pool=True)
    assert not pool.any()
    with pytest.raises(ValueError, match="buffer has 3"):
        reference._move_rows(5, 2, [0, 1, 0], ids, torch.zeros(6, 3, dtype=torch.int16), buf,
                             to_pool=True)  # fmt: skip
