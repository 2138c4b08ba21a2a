"""Pure-torch stash copy and pop: the executable specification of the paged stash kernels.

Shape suffixes: ``R`` rows of the static buffer (``max_rows``), ``H`` hidden (elements per row),
``N`` pool rows (``pages × S``), ``P`` pages, ``S`` page size, ``M`` record page slots.

This implementation reads the token count and the free-list counters on the host, which is free
on CPU and a synchronisation on CUDA: it is the reference and the CPU path, not the CUDA hot
path (that is :mod:`te_paged.kernels.triton_stash`, which must leave every tensor below in exactly
the state this one does). Data moves as raw bits: callers pass integer views of float tensors.
"""

from __future__ import annotations

import torch

from te_paged.kernels.layout import Flag, Meta, State, Tier

__all__ = ["torch_stash_copy", "torch_stash_pop"]


def _page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """Split a page list into runs of consecutive ids: ``(first_slot, first_page, length)``.

    A fresh free list hands out consecutive pages, so most tensors are one run and move with one
    ``copy_``; a fragmented list degrades gracefully to one copy per page.
    """
    runs: list[tuple[int, int, int]] = []
    for slot, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            first_slot, first_page, length = runs[-1]
            runs[-1] = (first_slot, first_page, length + 1)
        else:
            runs.append((slot, page, 1))
    return runs


def _move_rows(
    rows: int,
    page_size: int,
    pages: list[int],
    pool_NH: torch.Tensor,
    buf_RH: torch.Tensor,
    *,
    to_pool: bool,
) -> None:
    for slot, page, length in _page_runs(pages):
        r0 = slot * page_size
        n = min(length * page_size, rows - r0)
        p0 = page * page_size
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

    Bookkeeping is done on Python copies of the small state tensors (one read and at most one
    write each), so the fixed cost per call stays a handful of tensor ops.
    """
    if rec_pages_M.numel() < -(-src_RH.shape[0] // page_size):
        raise ValueError(
            f"rec_pages_M has {rec_pages_M.numel()} slots; {src_RH.shape[0]} rows of pages of "
            f"{page_size} need {-(-src_RH.shape[0] // page_size)}"
        )
    meta = [0] * len(Meta)
    meta[Meta.TIER] = int(Tier.NONE)
    fl = flags.tolist()
    if fl[Flag.OVERFLOW] != 0:
        rec_meta.copy_(torch.tensor(meta))
        return
    n = int(num_tokens.reshape(-1)[0])
    rows = -(-n // tokens_per_row)
    need = -(-rows // page_size)
    st = state.tolist()
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
        pages: list[int] = []
        for _, first, length in _queue_range(st[head_i], need, free.numel()):
            pages += free[first : first + length].tolist()
        st[head_i] += need
        in_use = free.numel() - (st[tail_i] - st[head_i])
        st[hwm_i] = max(st[hwm_i], in_use)
        st[State.ROWS_STASHED] += rows
        if need:
            rec_pages_M[:need].copy_(torch.tensor(pages, dtype=rec_pages_M.dtype))
        _move_rows(rows, page_size, pages, pool, src_RH, to_pool=True)
        meta[Meta.ROWS], meta[Meta.TIER] = rows, int(tier)
        state.copy_(torch.tensor(st))
    if tier is not Tier.DEVICE:  # only a spill or an overflow changes the flags
        flags.copy_(torch.tensor(fl))
    rec_meta.copy_(torch.tensor(meta))


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

    With ``zero_padding`` the rows past the stored ones are zeroed (so nothing downstream can see
    stale memory); otherwise they are left as they were. After an overflow the pool is left
    untouched and no row is read (all of ``dst_RH`` is padding).
    """
    overflowed = flags.tolist()[Flag.OVERFLOW] != 0
    meta = rec_meta.tolist()
    rows, tier = meta[Meta.ROWS], Tier(meta[Meta.TIER])
    if overflowed or tier is Tier.NONE:
        rows = 0
    if rows > dst_RH.shape[0]:
        raise ValueError(f"record holds {rows} rows but dst_RH has only {dst_RH.shape[0]}")
    if zero_padding and rows < dst_RH.shape[0]:
        dst_RH[rows:].zero_()
    if overflowed or tier is Tier.NONE:
        return
    need = -(-rows // page_size)
    pages_t = rec_pages_M[:need]
    if tier is Tier.DEVICE:
        pool, free, tail_i = dev_pool_NH, dev_free_P, State.TAIL
    else:
        pool, free, tail_i = host_pool_NH, host_free_P, State.HOST_TAIL
    _move_rows(rows, page_size, pages_t.tolist(), pool, dst_RH, to_pool=False)
    tail = int(state[tail_i])
    for pos, first, length in _queue_range(tail, need, free.numel()):
        free[first : first + length] = pages_t[pos : pos + length]
    state[tail_i] = tail + need
