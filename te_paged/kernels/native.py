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

It is built once per source, compiler (its resolved path and its ``--version``) and flags into
the cache directory and loaded with :mod:`ctypes`. Loading a shared library runs its code, so
nothing is loaded that this module did not build: the build records the library's SHA-256 next
to it (``page_mover-<tag>.sha256``), and a cached library is loaded only if it is a regular file
(not a link) owned by this user and writable by no one else, in a directory owned by this user
and writable by no one else, with the recorded hash. A library that fails a check is rebuilt
(a directory that fails one is not used at all); libraries of other tags (an older source or
compiler) are removed after a build. A freshly loaded mover must also move a few pages right
before it is used. Without a C compiler with OpenMP, with a build that fails, with a cache
directory others can write, or with ``TE_PAGED_NATIVE`` off, :func:`page_mover` returns None and
the reference keeps its torch ops (the reason logged once): the bytes are the same either way
(tests compare them). Environment, read here and only here, at the first call (never at
import):

``TE_PAGED_NATIVE``
    ``0``, ``off``, ``false`` or ``no`` (any case) to never build or load the helper; ``1``,
    ``on``, ``true``, ``yes`` or unset to use it where it can be built. Anything else is a
    ``ValueError`` naming the variable.
``TE_PAGED_CACHE_DIR``
    Where the built library goes (default ``$XDG_CACHE_HOME/te_paged``, else
    ``~/.cache/te_paged``).
``CC``
    The C compiler (default: the first of ``cc``, ``gcc``, ``clang`` on ``PATH``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import logging
import os
import pathlib
import shutil
import stat
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


_OFF = {"0", "off", "false", "no"}
_ON = {"", "1", "on", "true", "yes"}


def _enabled() -> bool:
    value = os.environ.get("TE_PAGED_NATIVE", "").strip().lower()
    if value not in _OFF | _ON:
        raise ValueError(
            f"TE_PAGED_NATIVE={os.environ['TE_PAGED_NATIVE']!r}: use 0, off, false or no to "
            "turn the compiled page mover off, 1, on, true or yes (or leave it unset) to use it"
        )
    return value not in _OFF


def _compiler_identity(cc: str) -> bytes:
    """The compiler's resolved path and what ``--version`` prints: a new compiler version at
    the same path builds (and caches) its own library."""
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, timeout=30, check=False)
        version = out.stdout + out.stderr
    except (OSError, subprocess.SubprocessError):
        version = b""
    return os.path.realpath(cc).encode() + b"\0" + version


def _private(path: pathlib.Path, what: str, *, directory: bool) -> str | None:
    """None if ``path`` is this user's and writable by no one else; else why not."""
    st = path.lstat()  # the link itself: a link is never trusted
    kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind:
        return f"{what} {path} is not a {'directory' if directory else 'regular file'}"
    if st.st_uid != os.getuid():
        return f"{what} {path} belongs to uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile(cc: str, target: pathlib.Path, manifest: pathlib.Path) -> str | None:
    """Build the library into ``target`` and record its hash in ``manifest`` (atomically: ranks
    building at once each write their own files and rename them); None, or what went wrong."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    fd, tmp_manifest = tempfile.mkstemp(suffix=".sha256", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True,
                             text=True, timeout=_BUILD_TIMEOUT_S)  # fmt: skip
        if out.returncode != 0:
            return f"{cc} {' '.join(_FLAGS)} failed: {out.stderr.strip()[-400:]}"
        os.chmod(tmp, 0o700)
        pathlib.Path(tmp_manifest).write_text(_sha256(pathlib.Path(tmp)) + "\n")
        os.replace(tmp, target)
        os.replace(tmp_manifest, manifest)
        return None
    finally:
        for leftover in (tmp, tmp_manifest):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _cached(target: pathlib.Path, manifest: pathlib.Path) -> str | None:
    """None if ``target`` is the library this module built (see the module docstring)."""
    if not target.exists() and not target.is_symlink():
        return "not built yet"
    for path, what in ((target, "library"), (manifest, "its recorded hash")):
        if not path.exists() and not path.is_symlink():
            return f"{what} {path} is missing"
        if (why := _private(path, what, directory=False)) is not None:
            return why
    if manifest.read_text().strip() != _sha256(target):
        return f"{target} is not the library that was built there (its SHA-256 differs)"
    return None


def _remove_others(directory: pathlib.Path, keep: str) -> None:
    """Libraries (and hashes) of other tags: an older source or compiler left them."""
    for path in directory.glob("page_mover-*"):
        if path.name.startswith(keep) or path.suffix not in (".so", ".sha256"):
            continue
        with contextlib.suppress(OSError):
            if path.lstat().st_uid == os.getuid():
                path.unlink()


def _self_test(fn: Callable[..., None]) -> bool:
    """Move three pages and a tail out and back through the loaded mover; compare the bytes."""
    page = 16
    pool = (ctypes.c_uint8 * (4 * page))()
    buf = (ctypes.c_uint8 * (4 * page))(*[(7 * i + 3) % 251 for i in range(4 * page)])
    back = (ctypes.c_uint8 * (4 * page))()
    pages = (ctypes.c_int32 * 4)(2, 0, 3, 1)
    fn(ctypes.addressof(pool), ctypes.addressof(buf), ctypes.addressof(pages), 3, page, 5, 1, 1)
    fn(ctypes.addressof(pool), ctypes.addressof(back), ctypes.addressof(pages), 3, page, 5, 0, 1)
    moved = 3 * page + 5
    expect = bytes(buf)[:moved]
    placed = bytes(pool)[2 * page : 3 * page] == expect[:page]
    return bytes(back)[:moved] == expect and placed and not any(bytes(back)[moved:])


def _build() -> tuple[Callable[..., None] | None, NativeStatus]:
    if not _enabled():
        value = os.environ["TE_PAGED_NATIVE"].strip()
        return None, NativeStatus(False, f"disabled by TE_PAGED_NATIVE={value}")
    cc = _compiler()
    if cc is None:
        return None, NativeStatus(False, "no C compiler on PATH (set CC to one with OpenMP)")
    tag = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), _compiler_identity(cc), *map(str.encode, _FLAGS)])
    ).hexdigest()[:16]
    directory = _cache_dir()
    target = directory / f"page_mover-{tag}.so"
    manifest = target.with_suffix(".sha256")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if (why := _private(directory, "cache directory", directory=True)) is not None:
            return None, NativeStatus(False, f"{why}: not building or loading the mover there")
        stale = _cached(target, manifest)
        if stale is not None:
            if stale != "not built yet":
                logger.info("te_paged: rebuilding the compiled page mover: %s", stale)
                for path in (target, manifest):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
            if (error := _compile(cc, target, manifest)) is not None:
                return None, NativeStatus(False, error)
            _remove_others(directory, keep=f"page_mover-{tag}")
            if (stale := _cached(target, manifest)) is not None:  # another process's file?
                return None, NativeStatus(False, f"after building: {stale}")
        fn = getattr(ctypes.CDLL(str(target)), _SYMBOL)
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        return None, NativeStatus(False, f"{type(e).__name__}: {e}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]  # fmt: skip
    fn.restype = None
    if not _self_test(fn):
        return None, NativeStatus(False, f"{target} loaded but moved pages wrongly: not used")
    built = f"{os.path.basename(cc)} {' '.join(_FLAGS[:2])}"
    return fn, NativeStatus(True, f"built with {built}, cached as {target.name} (SHA-256 checked)")


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
