"""The compiled page mover (``te_paged.kernels.native``): its bytes, its build cache, and every
way it can be unavailable (the reference then keeps its torch ops)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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

    run = subprocess.run

    def no_compiler(cmd, *args, **kwargs):
        if "-shared" in cmd:
            raise AssertionError("compiled again despite the cache")
        return run(cmd, *args, **kwargs)  # the compiler's --version (its identity) is asked

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native.page_mover_status().available
    assert list(fresh.glob("page_mover-*.so")) == [built]  # no stray temporary files
    assert sorted(p.suffix for p in fresh.iterdir()) == [".sha256", ".so"]


needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C compiler: nothing to build")

# A library with the mover's symbol that moves nothing, and whose constructor leaves a mark:
# what a planted file could do the moment it is loaded.
_PLANTED = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void ran(void) {
    FILE *f = fopen(getenv("TE_PAGED_TEST_MARK"), "w");
    if (f) fclose(f);
}
void te_paged_move_pages(char *pool, char *buf, const int32_t *pages, int64_t num_pages,
                         int64_t page_bytes, int64_t tail_bytes, int32_t to_pool,
                         int32_t num_threads) {}
"""


def _built(fresh) -> tuple:
    assert native.page_mover_status().available, native.page_mover_status().reason
    (library,) = fresh.glob("page_mover-*.so")
    return library, library.with_suffix(".sha256")


def _plant(src, library) -> None:
    """Build ``src`` and put it where ``library`` is, as a new file: this process has the real
    library mapped, and writing into that file in place would pull the code from under it."""
    planted = src.with_suffix(".so")
    subprocess.run([native._compiler(), "-shared", "-fPIC", str(src), "-o", str(planted)],
                   check=True)  # fmt: skip
    planted.replace(library)


def _reload(monkeypatch):
    monkeypatch.setattr(native, "_BUILT", [])
    return native.page_mover_status()


def _check_moves() -> None:
    test_mover_moves_pages_and_a_tail_both_ways(48, 1, 0.5)


def _status_in_a_new_process(cache, mark) -> tuple[bool, str]:
    """The status a fresh process sees (this one has the real library mapped already: dlopen
    hands back that handle for the same path, whatever the file holds now)."""
    code = "from te_paged.kernels import native; s = native.page_mover_status(); " \
        "print(s.available); print(s.reason)"  # fmt: skip
    env = {**os.environ, "TE_PAGED_CACHE_DIR": str(cache), "TE_PAGED_TEST_MARK": str(mark)}
    env.pop("TE_PAGED_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    available, reason = out.stdout.strip().splitlines()[-2:]
    return available == "True", reason


@needs_cc
def test_a_planted_library_is_never_loaded_but_rebuilt(fresh, tmp_path_factory) -> None:
    library, manifest = _built(fresh)
    src = tmp_path_factory.mktemp("planted") / "planted.c"
    src.write_text(_PLANTED)
    mark = src.parent / "constructor-ran"
    _plant(src, library)
    available, reason = _status_in_a_new_process(fresh, mark)
    assert available and not mark.exists(), reason  # rebuilt; its constructor never ran
    assert manifest.read_text().strip() == native._sha256(library)
    _check_moves()
    # With a forged hash too, it loads (its constructor runs: only the owner and permission
    # checks keep a stranger's file out), but the self-test refuses to use it.
    _plant(src, library)
    manifest.write_text(native._sha256(library) + "\n")
    available, reason = _status_in_a_new_process(fresh, mark)
    assert not available and "moved pages wrongly" in reason and mark.exists()


@needs_cc
@pytest.mark.parametrize("damage", ["garbage", "no hash", "symlink", "group-writable"])
def test_a_damaged_cache_is_rebuilt(fresh, monkeypatch, tmp_path_factory, damage) -> None:
    library, manifest = _built(fresh)
    if damage == "garbage":
        library.unlink()  # a new file: this process has the old one mapped (see _plant)
        library.write_bytes(b"not a library")
    elif damage == "no hash":
        manifest.unlink()
    elif damage == "symlink":
        real = tmp_path_factory.mktemp("elsewhere") / "lib.so"
        real.write_bytes(library.read_bytes())
        library.unlink()
        library.symlink_to(real)
    else:
        library.chmod(0o770)
    status = _reload(monkeypatch)
    assert status.available, status.reason
    assert library.is_file() and not library.is_symlink()
    assert manifest.read_text().strip() == native._sha256(library)
    _check_moves()


@needs_cc
def test_another_compiler_version_builds_its_own_and_old_libraries_go(fresh, monkeypatch):
    old, _ = _built(fresh)
    identity = native._compiler_identity
    monkeypatch.setattr(native, "_compiler_identity", lambda cc: identity(cc) + b" 99.1")
    status = _reload(monkeypatch)
    assert status.available, status.reason
    (new,) = fresh.glob("page_mover-*.so")
    assert new != old and not old.exists() and not old.with_suffix(".sha256").exists()


@needs_cc
def test_a_cache_directory_others_can_write_is_not_used(fresh, monkeypatch, caplog) -> None:
    fresh.chmod(0o777)
    try:
        with caplog.at_level("INFO", logger=native.__name__):
            assert native.page_mover() is None
        reason = native.page_mover_status().reason
        assert "writable by others (mode 777)" in reason and not any(fresh.iterdir())
        assert len(caplog.records) == 1 and "torch ops" in caplog.records[0].getMessage()
    finally:
        fresh.chmod(0o700)


@pytest.mark.parametrize("value", ["off", "False", " NO ", "0"])
def test_the_usual_false_spellings_disable_it(fresh, monkeypatch, value) -> None:
    monkeypatch.setenv("TE_PAGED_NATIVE", value)
    assert native.page_mover() is None
    assert native.page_mover_status().reason == f"disabled by TE_PAGED_NATIVE={value.strip()}"


def test_an_unknown_setting_is_refused_by_name(fresh, monkeypatch) -> None:
    monkeypatch.setenv("TE_PAGED_NATIVE", "maybe")
    with pytest.raises(ValueError, match=r"TE_PAGED_NATIVE='maybe': use 0, off, false or no"):
        native.page_mover()


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
