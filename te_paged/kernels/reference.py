"""Pure-torch stash copy and pop: the executable specification of the paged stash kernels.

Shape suffixes: ``R`` rows of the static buffer (``max_rows``), ``H`` hidden (elements per row),
``N`` pool rows (``pages × S``), ``P`` pages, ``S`` page size, ``M`` record page slots.

This implementation reads the token count and the free-list counters on the host, which is free
on CPU and a synchronisation on CUDA: it is the reference and the CPU path, not the CUDA hot
path (that is :mod:`te_paged.kernels.triton_stash`, which must leave every tensor below in exactly
the state this one does). Data moves as raw bits: callers pass integer views of float tensors.

On CPU the bookkeeping reads and writes the small int tensors in place through :func:`_ints`
(a ctypes array over the tensor's own memory), so that a stash costs its row copies plus a few
microseconds, not the ~10 µs per tensor op a ``tolist``/``torch.tensor``/``copy_`` round trip
costs: at 2k tokens of hidden 1024 that round trip was a third of the stash's time.

Rows move by runs of consecutive pages, one ``copy_`` each, while a tensor's page list has at
most :data:`_MAX_RUN_COPIES` runs (a fresh pool hands out one run; a 1F1B schedule leaves two or
three). A more fragmented list moves its whole pages with one indexed op each way instead —
``index_put_`` into the pool, ``index_select``/``index`` back — over the pages viewed as rows of
16-byte elements (:func:`_move_pages`): on a pool whose free pages alternate, the page-by-page
``copy_`` reached 0.3–0.7 of a plain copy, the indexed ops reach 0.95–1.05 of it from 16k tokens
up (``te-paged bench``, ``benchmarks/results/``). Which pages a tensor gets never depends on how
its rows move.
"""

from __future__ import annotations

import ctypes

import torch

from te_paged.kernels.backends import StashBackend, register_backend
from te_paged.kernels.layout import Flag, Meta, State, Tier

__all__ = ["torch_stash_copy", "torch_stash_pop"]

_CTYPES = {torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64}


def _ints(t: torch.Tensor) -> ctypes.Array | list[int]:
    """The values of the small int tensor ``t`` as a mutable sequence of Python ints.

    A contiguous CPU tensor gets a ctypes array over its own memory: reads and writes go straight
    to ``t`` (nothing to write back, nothing cached past this call, so a later resize cannot leave
    it dangling). Any other tensor gets a list copy; :func:`_store` writes it back.
    """
    ctype = _CTYPES.get(t.dtype)
    if ctype is not None and t.is_cpu and t.is_contiguous() and t.numel():
        return (ctype * t.numel()).from_address(t.data_ptr())
    return t.tolist()


def _store(t: torch.Tensor, values: ctypes.Array | list[int]) -> None:
    """Write back what :func:`_ints` returned for ``t`` (a no-op for an in-place view)."""
    if isinstance(values, list):
        t.copy_(torch.tensor(values, dtype=t.dtype))


# A page list of more runs than this moves with one indexed op instead of a ``copy_`` per run.
# Each ``copy_`` costs ~4 µs before it moves a byte, and on CPU each opens a parallel region of
# its own, which stalls for a scheduler tick whenever another process holds a core; a fresh
# pool's one run, or the two or three a 1F1B schedule leaves, are still cheaper as slices.
_MAX_RUN_COPIES = 4

# index_select's CPU kernel memcpys slices of fewer elements than ATen's grain size (32768) in
# one parallel loop: stash+pop 10–20 % faster than with index at 2k tokens of hidden 1024–2048.
# A larger slice gets a parallel region of its own, slower than index's single loop.
_MEMCPY_SLICE_ELEMS = 32768

# Element types a byte copy may view the rows as, widest first. index_put_'s and index's CPU
# loops move one element per iteration, so the element's width is their speed: at 2k tokens of
# hidden 2048, as complex128 (16 bytes) they reach ~90 % of ``copy_``, as int64 a quarter of it.
# Moving a complex128 is two 8-byte loads and stores, never arithmetic: NaN payloads survive
# bit for bit (the tests move every special bit pattern through it).
_COPY_DTYPES = (torch.complex128, torch.int64, torch.int32, torch.int16, torch.uint8)


def _page_runs(pages: list[int], limit: int | None = None) -> list[tuple[int, int, int]] | None:
    """Split a page list into runs of consecutive ids: ``(first_slot, first_page, length)``.

    A fresh free list hands out consecutive pages, so most tensors are one run and move with one
    ``copy_``. With ``limit``, None as soon as there are more runs than that (without walking
    the rest of a long fragmented list).
    """
    if not pages or pages == list(range(pages[0], pages[0] + len(pages))):  # the common case
        return [(0, pages[0], len(pages))] if pages else []
    runs: list[tuple[int, int, int]] = []
    for slot, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            first_slot, first_page, length = runs[-1]
            runs[-1] = (first_slot, first_page, length + 1)
        elif limit is not None and len(runs) == limit:
            return None
        else:
            runs.append((slot, page, 1))
    return runs


def _copy_dtype(pool_NH: torch.Tensor, buf_RH: torch.Tensor) -> torch.dtype | None:
    """The widest of :data:`_COPY_DTYPES` that a row's bytes and both tensors' addresses are a
    multiple of, or None where only slice copies apply: different dtypes or devices (the host
    tier of a CUDA pool), a strided buffer, empty rows."""
    if (
        pool_NH.dtype != buf_RH.dtype
        or pool_NH.device != buf_RH.device
        or not (pool_NH.is_contiguous() and buf_RH.is_contiguous())
    ):
        return None
    row_bytes = buf_RH.shape[1] * buf_RH.element_size()
    # Every byte count and address involved, or-ed: a power of two divides it iff it divides all.
    sizes = row_bytes | pool_NH.data_ptr() | buf_RH.data_ptr()
    for t in (pool_NH, buf_RH):
        sizes |= t.storage_offset() * t.element_size()
    for dtype in _COPY_DTYPES:
        if row_bytes and sizes % dtype.itemsize == 0:
            return dtype
    return None


def _move_pages(
    rows: int,
    page_size: int,
    pages: list[int],
    rec_pages_M: torch.Tensor,
    pool_NH: torch.Tensor,
    buf_RH: torch.Tensor,
    dtype: torch.dtype,
    *,
    to_pool: bool,
) -> None:
    """Whole pages with one indexed op over page-sized rows viewed as ``dtype`` — row ``i`` of
    ``buf`` as pages is page ``pages[i]`` of the pool: ``index_put_`` to the pool,
    ``index_select`` or ``index`` back —, then the last ``rows % S`` rows with a ``copy_``.

    Example: S = 4, pages ``[5 2]``, 7 rows: rows 0–3 ↔ page 5 by the indexed op, rows 4–6 ↔
    pool rows 8–10 by the ``copy_``.
    """
    whole = rows // page_size
    if whole:
        index = rec_pages_M[:whole]  # int32 indices are fine: no conversion to int64
        if index.device != pool_NH.device:
            index = index.to(pool_NH.device)
        page_elems = page_size * buf_RH.shape[1] * buf_RH.element_size() // dtype.itemsize
        pool_PX = pool_NH.view(dtype).view(-1, page_elems)
        buf_PX = buf_RH[: whole * page_size].view(dtype).view(whole, page_elems)
        if to_pool:
            pool_PX.index_put_((index,), buf_PX)
        elif page_elems < _MEMCPY_SLICE_ELEMS:
            torch.index_select(pool_PX, 0, index, out=buf_PX)
        else:
            torch.ops.aten.index.Tensor_out(pool_PX, [index], out=buf_PX)
    r0 = whole * page_size
    if r0 < rows:
        p0 = pages[whole] * page_size
        _copy_slice(pool_NH, buf_RH, p0, r0, rows - r0, to_pool=to_pool)


def _move_rows(
    rows: int,
    page_size: int,
    pages: list[int],
    rec_pages_M: torch.Tensor,
    pool_NH: torch.Tensor,
    buf_RH: torch.Tensor,
    *,
    to_pool: bool,
) -> None:
    """Move ``rows`` rows between ``buf_RH`` and the pages ``pages`` (also the first entries of
    ``rec_pages_M``): a ``copy_`` per run of consecutive pages, or, for a list of more runs than
    :data:`_MAX_RUN_COPIES`, :func:`_move_pages`. Either leaves the same bytes everywhere."""
    runs = _page_runs(pages, limit=_MAX_RUN_COPIES)
    if runs is None:
        dtype = _copy_dtype(pool_NH, buf_RH)
        if dtype is not None:
            _move_pages(rows, page_size, pages, rec_pages_M, pool_NH, buf_RH, dtype,
                        to_pool=to_pool)  # fmt: skip
            return
        runs = _page_runs(pages)
    for slot, page, length in runs:
        r0 = slot * page_size
        n = min(length * page_size, rows - r0)
        _copy_slice(pool_NH, buf_RH, page * page_size, r0, n, to_pool=to_pool)


def _copy_slice(
    pool_NH: torch.Tensor, buf_RH: torch.Tensor, p0: int, r0: int, n: int, *, to_pool: bool
) -> None:
    """``n`` consecutive rows, pool rows from ``p0`` ↔ buffer rows from ``r0``, one ``copy_``."""
    if to_pool:
        pool_NH[p0 : p0 + n].copy_(buf_RH[r0 : r0 + n])
    else:
        buf_RH[r0 : r0 + n].copy_(pool_NH[p0 : p0 + n])


def _queue_range(start: int, count: int, size: int) -> list[tuple[int, int, int]]:
    """Slots ``[start, start + count)`` of a circular queue of ``size`` as at most two slices:
    ``(queue position, first slot, length)``."""
    out, pos = [], 0
    while pos < count:
        first = (start + pos) % size
        length = min(count - pos, size - first)
        out.append((pos, first, length))
        pos += length
    return out


def torch_stash_copy(
    src_RH: torch.Tensor,
    num_tokens: torch.Tensor,
    tokens_per_row: int,
    page_size: int,
    dev_pool_NH: torch.Tensor,
    dev_free_P: torch.Tensor,
    host_pool_NH: torch.Tensor,
    host_free_P: torch.Tensor,
    state: torch.Tensor,
    flags: torch.Tensor,
    rec_pages_M: torch.Tensor,
    rec_meta: torch.Tensor,
) -> None:
    """Copy the first ``ceil(num_tokens / tokens_per_row)`` rows of ``src_RH`` into free pages.

    The whole tensor goes to the device tier if it has room, else to the host tier (counting a
    spill), else nowhere (counting an overflow). More tokens than the static buffer holds is an
    overflow too. After an overflow this is a no-op. ``rec_pages_M``/``rec_meta`` receive the
    record :func:`torch_stash_pop` needs.
    """
    slots = -(-src_RH.shape[0] // page_size)
    if rec_pages_M.numel() < slots:
        raise ValueError(
            f"rec_pages_M has {rec_pages_M.numel()} slots; {src_RH.shape[0]} rows of pages of "
            f"{page_size} need {slots}"
        )
    meta = _ints(rec_meta)
    meta[Meta.ROWS], meta[Meta.TIER], meta[Meta.POPPED] = 0, int(Tier.NONE), 0
    fl = _ints(flags)
    if fl[Flag.OVERFLOW] != 0:
        _store(rec_meta, meta)
        return
    n = int(num_tokens.reshape(-1)[0]) if num_tokens.numel() != 1 else int(num_tokens.item())
    rows = -(-n // tokens_per_row)
    need = -(-rows // page_size)
    st = _ints(state)
    if n < 0 or n > src_RH.shape[0] * tokens_per_row:  # more tokens than the static budget
        fl[Flag.OVERFLOW] += 1
        tier = Tier.NONE
    elif need <= st[State.TAIL] - st[State.HEAD]:
        tier, free, pool, head_i, tail_i, hwm_i = (
            Tier.DEVICE, dev_free_P, dev_pool_NH, State.HEAD, State.TAIL, State.HWM
        )  # fmt: skip
    elif need <= st[State.HOST_TAIL] - st[State.HOST_HEAD]:
        tier, free, pool, head_i, tail_i, hwm_i = (
            Tier.HOST, host_free_P, host_pool_NH, State.HOST_HEAD, State.HOST_TAIL, State.HOST_HWM
        )  # fmt: skip
        st[State.SPILLED] += 1
        fl[Flag.HOST_SPILL] += 1
    else:
        fl[Flag.OVERFLOW] += 1
        tier = Tier.NONE

    if tier is not Tier.NONE:
        free_ints, rec = _ints(free), _ints(rec_pages_M)
        pages: list[int] = []
        for _, first, length in _queue_range(st[head_i], need, len(free_ints)):
            pages += free_ints[first : first + length]
        rec[:need] = pages
        st[head_i] += need
        in_use = len(free_ints) - (st[tail_i] - st[head_i])
        st[hwm_i] = max(st[hwm_i], in_use)
        st[State.ROWS_STASHED] += rows
        _store(rec_pages_M, rec)  # before the move, which may read the page ids from it
        _move_rows(rows, page_size, pages, rec_pages_M, pool, src_RH, to_pool=True)
        meta[Meta.ROWS], meta[Meta.TIER] = rows, int(tier)
        _store(state, st)
    if tier is not Tier.DEVICE:  # only a spill or an overflow changes the flags
        _store(flags, fl)
    _store(rec_meta, meta)


def torch_stash_pop(
    dst_RH: torch.Tensor,
    page_size: int,
    dev_pool_NH: torch.Tensor,
    dev_free_P: torch.Tensor,
    host_pool_NH: torch.Tensor,
    host_free_P: torch.Tensor,
    state: torch.Tensor,
    flags: torch.Tensor,
    rec_pages_M: torch.Tensor,
    rec_meta: torch.Tensor,
    zero_padding: bool,
) -> None:
    """Copy a record's rows back into ``dst_RH`` and return its pages to their free list.

    A record pops once: a second pop counts ``INVALID`` and reads and frees nothing. With
    ``zero_padding`` the rows past the stored ones are zeroed (so nothing downstream can see
    stale memory); otherwise they are left as they were. After an overflow the pool is left
    untouched and no row is read (all of ``dst_RH`` is padding).
    """
    fl = _ints(flags)
    overflowed = fl[Flag.OVERFLOW] != 0
    meta = _ints(rec_meta)
    rows, tier = meta[Meta.ROWS], Tier(meta[Meta.TIER])
    popped_before = meta[Meta.POPPED] != 0
    if popped_before:  # a second pop: its pages may belong to another tensor by now
        fl[Flag.INVALID] += 1
        _store(flags, fl)
        tier = Tier.NONE
    if overflowed or tier is Tier.NONE:
        rows = 0
    if rows > dst_RH.shape[0]:
        raise ValueError(f"record holds {rows} rows but dst_RH has only {dst_RH.shape[0]}")
    if zero_padding and rows < dst_RH.shape[0]:
        dst_RH[rows:].zero_()
    if overflowed or tier is Tier.NONE:
        return
    meta[Meta.POPPED] = 1
    _store(rec_meta, meta)
    need = -(-rows // page_size)
    pages = _ints(rec_pages_M)[:need]
    if tier is Tier.DEVICE:
        pool, free, tail_i = dev_pool_NH, dev_free_P, State.TAIL
    else:
        pool, free, tail_i = host_pool_NH, host_free_P, State.HOST_TAIL
    _move_rows(rows, page_size, pages, rec_pages_M, pool, dst_RH, to_pool=False)
    st, free_ints = _ints(state), _ints(free)
    for pos, first, length in _queue_range(st[tail_i], need, len(free_ints)):
        free_ints[first : first + length] = pages[pos : pos + length]
    st[tail_i] += need
    _store(free, free_ints)
    _store(state, st)


register_backend(StashBackend("torch", torch_stash_copy, torch_stash_pop, direct=True))
