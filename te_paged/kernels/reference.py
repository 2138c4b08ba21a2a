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
costs: at 2k tokens of hidden 1024 that round trip was a third of the stash's time. What is left
is host work the rows cannot hide at small sizes: ~22 µs a stash+pop with the compiled mover,
24–34 µs with the torch ops (2k tokens of hidden 8), and 1.7–3× that right after a large copy
has flushed the caches.

Rows move on CPU by a compiled ``memcpy`` loop over the pages (:mod:`te_paged.kernels.native`,
built on first use with the system C compiler), one call per stash or pop whatever the page
list. Elsewhere, or without it, they move by runs of consecutive pages, one ``copy_`` each,
while a tensor's page list has at most :data:`_MAX_RUN_COPIES` runs (a fresh pool hands out one
run; a 1F1B schedule leaves two or three), and a more fragmented list moves its whole pages with
one indexed op each way (:func:`_move_pages`) — ``index_put_`` into the pool,
``index_select``/``index`` back — over the pages viewed as rows of 16-byte elements. On a pool
whose free pages alternate the page-by-page ``copy_`` reached 0.3–0.7 of a plain copy, the
indexed ops 0.71 at 2k tokens of hidden 2048 (0.96–1.03 from 16k tokens up), the mover 0.85–0.87
there (``te-paged bench``, ``benchmarks/results/``). Which pages a tensor gets never depends on
how its rows move.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable

import torch

from te_paged.kernels import native
from te_paged.kernels.layout import Flag, Meta, State, Tier

__all__ = ["torch_stash_copy", "torch_stash_pop"]

_CTYPES = {torch.int32: ctypes.c_int32, torch.int64: ctypes.c_int64}
_ARRAYS: dict[tuple[torch.dtype, int], type[ctypes.Array]] = {}  # (dtype, numel) -> array type


def _ints(t: torch.Tensor) -> ctypes.Array | list[int]:
    """The values of the small int tensor ``t`` as a mutable sequence of Python ints.

    A contiguous CPU tensor gets a ctypes array over its own memory: reads and writes go straight
    to ``t`` (nothing to write back, nothing cached past this call, so a later resize cannot leave
    it dangling; only the array *type* per (dtype, length) is cached). Any other tensor gets a
    list copy; :func:`_store` writes it back.
    """
    if t.is_cpu and t.is_contiguous():
        key = (t.dtype, t.numel())
        array = _ARRAYS.get(key)
        if array is None and key[0] in _CTYPES and key[1]:
            array = _ARRAYS[key] = _CTYPES[key[0]] * key[1]
        if array is not None:
            return array.from_address(t.data_ptr())
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

# Whether rows on CPU move by the compiled mover where it can be had (tests switch it off to
# compare the ways).
_NATIVE = True

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
    ``copy_``. With ``limit``, None as soon as a list of two runs or more has more than
    ``limit`` (without walking the rest of a long fragmented list); one run is always returned.
    """
    if not pages:
        return []
    first = pages[0]
    if pages[-1] - first == len(pages) - 1 and pages == list(range(first, pages[-1] + 1)):
        return [(0, first, len(pages))]  # the common case
    runs: list[tuple[int, int, int]] = []
    start = 0
    for slot, (prev, page) in enumerate(itertools.pairwise(pages), 1):
        if page != prev + 1:
            if len(runs) == limit:  # this starts run limit + 2
                return None
            runs.append((start, pages[start], slot - start))
            start = slot
    if len(runs) == limit:
        return None
    runs.append((start, pages[start], len(pages) - start))
    return runs


def _copy_dtype(pool_NH: torch.Tensor, buf_RH: torch.Tensor) -> torch.dtype | None:
    """The widest of :data:`_COPY_DTYPES` that a row's bytes and both tensors' addresses are a
    multiple of, or None where only slice copies apply: different dtypes or devices (the host
    tier of a CUDA pool), a strided buffer, empty rows."""
    if not _plain_rows(pool_NH, buf_RH):
        return None
    row_bytes = buf_RH.shape[1] * buf_RH.element_size()
    # The row's bytes and both addresses (data_ptr includes the storage offset), or-ed: a power
    # of two divides the result iff it divides all three.
    sizes = row_bytes | pool_NH.data_ptr() | buf_RH.data_ptr()
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
        # int32 indices are fine: no conversion to int64.
        index = rec_pages_M if rec_pages_M.shape[0] == whole else rec_pages_M[:whole]
        if index.device != pool_NH.device:
            index = index.to(pool_NH.device)
        page_elems = page_size * buf_RH.shape[1] * buf_RH.element_size() // dtype.itemsize
        pool_PX = pool_NH.view(dtype).view(-1, page_elems)
        # as_strided keeps the buffer's storage offset: its first ``whole`` pages' worth of rows
        # in one call instead of a slice and two views.
        buf_PX = buf_RH.view(dtype).as_strided((whole, page_elems), (page_elems, 1))
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
    ``rec_pages_M``): on CPU by the compiled mover in one call (:func:`_move_native`), else a
    ``copy_`` per run of consecutive pages or, for a list of more runs than
    :data:`_MAX_RUN_COPIES`, :func:`_move_pages`. Every way leaves the same bytes everywhere."""
    mover = _mover_for(pool_NH, buf_RH)
    if mover is not None:
        _move_native(mover, rows, page_size, pages, rec_pages_M, pool_NH, buf_RH, to_pool)
        return
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


def _mover_for(pool_NH: torch.Tensor, buf_RH: torch.Tensor) -> Callable[..., None] | None:
    """The compiled mover where it applies: both tensors on CPU, contiguous, of one dtype and
    row width (anything else takes the torch ops, which also say what is wrong)."""
    if not (_NATIVE and pool_NH.is_cpu and _plain_rows(pool_NH, buf_RH)):
        return None
    return native.page_mover()


def _plain_rows(pool_NH: torch.Tensor, buf_RH: torch.Tensor) -> bool:
    """Whether rows move as plain bytes between the two: one dtype, device and row width, both
    contiguous (row ``r`` of either starts ``r`` rows' bytes past its data pointer)."""
    return (
        pool_NH.dtype == buf_RH.dtype
        and pool_NH.device == buf_RH.device
        and pool_NH.shape[1:] == buf_RH.shape[1:]
        and pool_NH.is_contiguous()
        and buf_RH.is_contiguous()
    )


def _move_native(
    mover: Callable[..., None],
    rows: int,
    page_size: int,
    pages: list[int],
    rec_pages_M: torch.Tensor,
    pool_NH: torch.Tensor,
    buf_RH: torch.Tensor,
    to_pool: bool,
) -> None:
    """``rows`` rows in one call of the compiled mover: the whole pages, then the last
    ``rows % S`` rows as the tail of page ``pages[rows // S]``, on torch's threads."""
    whole, tail = divmod(rows, page_size)
    need = whole + (tail > 0)
    if not need:
        return
    # The mover trusts its arguments: check here what the torch ops would have refused.
    ids_used, num_pages = pages[:need], pool_NH.shape[0] // page_size
    if len(ids_used) < need or min(ids_used) < 0 or max(ids_used) >= num_pages:
        raise ValueError(f"page ids {ids_used} for {rows} rows are not {need} pages of a pool of "
                         f"{num_pages}")  # fmt: skip
    if rows > buf_RH.shape[0]:
        raise ValueError(f"{rows} rows to move but the buffer has {buf_RH.shape[0]}")
    if rec_pages_M.is_cpu and rec_pages_M.is_contiguous() and rec_pages_M.dtype == torch.int32:
        ids = rec_pages_M.data_ptr()  # the record's own int32 page ids
    else:  # bookkeeping elsewhere: the ids as a host array, alive until the call returns
        ids_M = (ctypes.c_int32 * need)(*ids_used)
        ids = ctypes.addressof(ids_M)
    row_bytes = buf_RH.shape[1] * buf_RH.element_size()
    mover(pool_NH.data_ptr(), buf_RH.data_ptr(), ids, whole, page_size * row_bytes,
          tail * row_bytes, to_pool, torch.get_num_threads())  # fmt: skip


def _copy_slice(
    pool_NH: torch.Tensor, buf_RH: torch.Tensor, p0: int, r0: int, n: int, *, to_pool: bool
) -> None:
    """``n`` consecutive rows, pool rows from ``p0`` ↔ buffer rows from ``r0``, one ``copy_``."""
    if to_pool:
        pool_NH[p0 : p0 + n].copy_(buf_RH[r0 : r0 + n])
    else:
        buf_RH[r0 : r0 + n].copy_(pool_NH[p0 : p0 + n])


def _take(queue: ctypes.Array | list[int], start: int, count: int) -> list[int]:
    """Slots ``[start, start + count)`` of a circular queue (``start`` a monotone counter)."""
    if not count:
        return []
    first = start % len(queue)
    end = first + count
    if end <= len(queue):
        return queue[first:end]
    return queue[first:] + queue[: end - len(queue)]


def _put(queue: ctypes.Array | list[int], start: int, values: list[int]) -> None:
    """Write ``values`` into slots ``[start, start + len(values))`` of a circular queue."""
    if not values:
        return
    first = start % len(queue)
    end = first + len(values)
    if end <= len(queue):
        queue[first:end] = values
    else:
        split = len(queue) - first
        queue[first:] = values[:split]
        queue[: end - len(queue)] = values[split:]


# The layout's indices as plain ints: an IntEnum member costs ~80 ns a lookup and a stash+pop
# made dozens (at 2k tokens the bookkeeping, not the rows, is what the reference spends on top
# of a plain copy).
_ROWS, _TIER, _POPPED = Meta.ROWS.value, Meta.TIER.value, Meta.POPPED.value
_NEED = Meta.NEED.value
_DEMANDED, _RETURNED = State.DEMANDED.value, State.RETURNED.value
_DEMAND_HWM = State.DEMAND_HWM.value
_OVERFLOW, _HOST_SPILL, _INVALID = Flag.OVERFLOW.value, Flag.HOST_SPILL.value, Flag.INVALID.value
_NONE, _DEVICE, _HOST = Tier.NONE.value, Tier.DEVICE.value, Tier.HOST.value
# (head, tail, high-water mark) of each tier's free list in ``state``.
_DEVICE_QUEUE = (State.HEAD.value, State.TAIL.value, State.HWM.value)
_HOST_QUEUE = (State.HOST_HEAD.value, State.HOST_TAIL.value, State.HOST_HWM.value)


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
    max_rows = src_RH.shape[0]
    if rec_pages_M.numel() * page_size < max_rows:
        raise ValueError(
            f"rec_pages_M has {rec_pages_M.numel()} slots; {max_rows} rows of pages of "
            f"{page_size} need {-(-max_rows // page_size)}"
        )
    meta, fl = _ints(rec_meta), _ints(flags)
    meta[_ROWS], meta[_TIER], meta[_POPPED], meta[_NEED] = 0, _NONE, 0, 0
    n = int(num_tokens.item()) if num_tokens.numel() == 1 else int(num_tokens.reshape(-1)[0])
    rows = -(-max(n, 0) // tokens_per_row)
    need = -(-rows // page_size)
    bad = n < 0 or n > max_rows * tokens_per_row
    st = _ints(state)
    if not bad:  # what the step asks of the pool, stored or not (even after an overflow)
        meta[_NEED] = need
        st[_DEMANDED] += need
        st[_DEMAND_HWM] = max(st[_DEMAND_HWM], st[_DEMANDED] - st[_RETURNED])
        _store(state, st)
    if fl[_OVERFLOW] != 0:
        _store(rec_meta, meta)
        return
    tier = _NONE
    if bad:  # invalid input, not a full pool
        fl[_INVALID] += 1
    elif need <= st[_DEVICE_QUEUE[1]] - st[_DEVICE_QUEUE[0]]:
        tier, free, pool, (head_i, tail_i, hwm_i) = _DEVICE, dev_free_P, dev_pool_NH, _DEVICE_QUEUE
    elif need <= st[_HOST_QUEUE[1]] - st[_HOST_QUEUE[0]]:
        tier, free, pool, (head_i, tail_i, hwm_i) = _HOST, host_free_P, host_pool_NH, _HOST_QUEUE
        st[State.SPILLED] += 1
        fl[_HOST_SPILL] += 1
    else:
        fl[_OVERFLOW] += 1

    if tier != _NONE:
        free_ints, rec = _ints(free), _ints(rec_pages_M)
        pages = _take(free_ints, st[head_i], need)
        rec[:need] = pages
        st[head_i] += need
        st[hwm_i] = max(st[hwm_i], len(free_ints) - (st[tail_i] - st[head_i]))
        st[State.ROWS_STASHED] += rows
        _store(rec_pages_M, rec)  # before the move, which may read the page ids from it
        meta[_ROWS], meta[_TIER] = rows, tier
        _store(state, st)
        _move_rows(rows, page_size, pages, rec_pages_M, pool, src_RH, to_pool=True)
    if tier != _DEVICE:  # only a spill or an overflow changes the flags
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
    fl, meta = _ints(flags), _ints(rec_meta)
    rows, tier = meta[_ROWS], meta[_TIER]
    if meta[_POPPED] != 0:  # a second pop: its pages may belong to another tensor by now
        fl[_INVALID] += 1
        _store(flags, fl)
        tier = _NONE
    elif meta[_NEED]:  # the demand comes back once, stored or not
        st = _ints(state)
        st[_RETURNED] += meta[_NEED]
        meta[_NEED] = 0
        _store(state, st)
        _store(rec_meta, meta)
    if fl[_OVERFLOW] != 0 or tier == _NONE:
        rows = 0
    if rows > dst_RH.shape[0]:
        raise ValueError(f"record holds {rows} rows but dst_RH has only {dst_RH.shape[0]}")
    if zero_padding and rows < dst_RH.shape[0]:
        dst_RH[rows:].zero_()
    if fl[_OVERFLOW] != 0 or tier == _NONE:
        return
    meta[_POPPED] = 1
    _store(rec_meta, meta)
    need = -(-rows // page_size)
    pages = _ints(rec_pages_M)[:need]
    if tier == _DEVICE:
        pool, free, tail_i = dev_pool_NH, dev_free_P, _DEVICE_QUEUE[1]
    else:
        pool, free, tail_i = host_pool_NH, host_free_P, _HOST_QUEUE[1]
    # The pages go back to the free list before their rows are read: nothing runs in between
    # on the host, and the move is then the last thing the pop does.
    st, free_ints = _ints(state), _ints(free)
    if need and not free_ints:  # only a record nobody wrote names a tier this pool lacks
        raise ValueError(f"record's pages belong to a tier ({tier}) this pool does not have")
    _put(free_ints, st[tail_i], pages)
    st[tail_i] += need
    _store(free, free_ints)
    _store(state, st)
    _move_rows(rows, page_size, pages, rec_pages_M, pool, dst_RH, to_pool=False)
