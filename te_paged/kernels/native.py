"""A compiled page mover for the reference kernels on CPU, built with the system C compiler on
first use.

The reference moves a fragmented page list (more than a few runs of consecutive pages) with
two indexed torch ops. Their data movement is as fast as a plain copy, but each op costs
13–35 µs of launch work right after a large copy has flushed the caches, which at 2k tokens of
hidden 2048 held a stash+pop on an alternating free list to 0.71 of a plain copy
(``te-paged bench``). ``page_mover.c`` is a short ``memcpy`` loop over the pages, shared among
the OpenMP threads torch's own intra-op parallelism uses (torch's ``libgomp.so.1`` is already
loaded when this library is, so there is one thread pool, not two): one ``ctypes`` call per
stash or pop, whatever the page list, instead of a ``copy_`` per run or two views and an
indexed op.

It is built once per source, compiler and flags into the cache directory and loaded with
:mod:`ctypes`. Without a C compiler with OpenMP, with a build that fails, or with
``TE_PAGED_NATIVE=0``, :func:`page_mover` returns None and the reference keeps its torch ops:
the bytes are the same either way (tests compare them). Environment, read here and only here,
at the first call (never at import):

``TE_PAGED_NATIVE``
    ``0`` to never build or load the helper.
``TE_PAGED_CACHE_DIR``
    Where the built library goes (default ``$XDG_CACHE_HOME/te_paged``, else
    ``~/.cache/te_paged``).
``CC``
    The C compiler (default: the first of ``cc``, ``gcc``, ``clang`` on ``PATH``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable

__all__ = ["NativeStatus", "page_mover", "page_mover_status"]

logger = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).with_name("page_mover.c")
_FLAGS = ("-O2", "-fopenmp", "-shared", "-fPIC")
_SYMBOL = "te_paged_move_pages"
_BUILD_TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class NativeStatus:
    """Whether the compiled page mover is in use, and why (or why not)."""

    available: bool
    reason: str  # how it was built and where it is cached, or what stopped it


# One build per process, made under the lock at the first call: a compiled library is a
# process-wide resource (ctypes cannot unload it), so this is the one module-level cache here.
_LOCK = threading.Lock()
_BUILT: list[tuple[Callable[..., None] | None, NativeStatus]] = []


def _cache_dir() -> pathlib.Path:
    explicit = os.environ.get("TE_PAGED_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "te_paged"


def _compiler() -> str | None:
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return next((path for cc in ("cc", "gcc", "clang") if (path := shutil.which(cc))), None)


def _compile(cc: str, target: pathlib.Path) -> str | None:
    """Build the library into ``target`` (atomically: ranks building at once each write their
    own file and rename it); None, or what went wrong."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True,
                             text=True, timeout=_BUILD_TIMEOUT_S)  # fmt: skip
        if out.returncode != 0:
            return f"{cc} {' '.join(_FLAGS)} failed: {out.stderr.strip()[-400:]}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build() -> tuple[Callable[..., None] | None, NativeStatus]:
    if os.environ.get("TE_PAGED_NATIVE", "").strip() == "0":
        return None, NativeStatus(False, "disabled by TE_PAGED_NATIVE=0")
    cc = _compiler()
    if cc is None:
        return None, NativeStatus(False, "no C compiler on PATH (set CC to one with OpenMP)")
    tag = hashlib.sha256(b"\0".join([_SOURCE.read_bytes(), cc.encode(), *map(str.encode, _FLAGS)]))
    target = _cache_dir() / f"page_mover-{tag.hexdigest()[:16]}.so"
    try:
        if not target.exists() and (error := _compile(cc, target)) is not None:
            return None, NativeStatus(False, error)
        fn = getattr(ctypes.CDLL(str(target)), _SYMBOL)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        return None, NativeStatus(False, f"{type(e).__name__}: {e}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]  # fmt: skip
    fn.restype = None
    built = f"{os.path.basename(cc)} {' '.join(_FLAGS[:2])}"
    return fn, NativeStatus(True, f"built with {built}, cached as {target.name}")


def _load() -> tuple[Callable[..., None] | None, NativeStatus]:
    if not _BUILT:
        with _LOCK:
            if not _BUILT:
                fn, status = _build()
                if not status.available:
                    logger.info(
                        "te_paged: the reference kernels move fragmented pages with torch ops; "
                        "the compiled page mover is unavailable: %s",
                        status.reason,
                    )
                _BUILT.append((fn, status))
    return _BUILT[0]


def page_mover() -> Callable[..., None] | None:
    """``move(pool_ptr, buf_ptr, pages_ptr, num_pages, page_bytes, tail_bytes, to_pool,
    num_threads)``, the compiled mover, or None where it cannot be had (module docstring).

    Pointers are ints; slot ``i`` of the buffer is page ``pages[i]`` of the pool (int32 ids) for
    ``num_pages`` whole pages, then ``tail_bytes`` (< ``page_bytes``) of slot ``num_pages``."""
    return _load()[0]


def page_mover_status() -> NativeStatus:
    """Whether :func:`page_mover` is available, and why (for reports)."""
    return _load()[1]
