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
    rec_meta.zero_()
    if int(flags[Flag.OVERFLOW]) != 0:
        return
    n = int(num_tokens.reshape(-1)[0])
    rows = -(-n // tokens_per_row)
    if n < 0 or rows > src_RH.shape[0]:
        flags[Flag.OVERFLOW] += 1
        return
    need = -(-rows // page_size)

    head, tail = int(state[State.HEAD]), int(state[State.TAIL])
    host_head, host_tail = int(state[State.HOST_HEAD]), int(state[State.HOST_TAIL])
    if need <= tail - head:
        tier, free, pool = Tier.DEVICE, dev_free_P, dev_pool_NH
        slots = [(head + i) % free.numel() for i in range(need)]
        state[State.HEAD] = head + need
        in_use = free.numel() - (tail - head - need)
        state[State.HWM] = max(int(state[State.HWM]), in_use)
    elif need <= host_tail - host_head:
        tier, free, pool = Tier.HOST, host_free_P, host_pool_NH
        slots = [(host_head + i) % free.numel() for i in range(need)]
        state[State.HOST_HEAD] = host_head + need
        in_use = free.numel() - (host_tail - host_head - need)
        state[State.HOST_HWM] = max(int(state[State.HOST_HWM]), in_use)
        state[State.SPILLED] += 1
        flags[Flag.HOST_SPILL] += 1
    else:
        flags[Flag.OVERFLOW] += 1
        return

    pages = [int(free[s]) for s in slots]
    if need:
        rec_pages_M[:need].copy_(torch.tensor(pages, dtype=rec_pages_M.dtype))
    _move_rows(rows, page_size, pages, pool, src_RH, to_pool=True)
    state[State.ROWS_STASHED] += rows
    rec_meta[Meta.ROWS] = rows
    rec_meta[Meta.TIER] = int(tier)


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
    overflowed = int(flags[Flag.OVERFLOW]) != 0
    tier = Tier(int(rec_meta[Meta.TIER]))
    rows = 0 if overflowed or tier is Tier.NONE else int(rec_meta[Meta.ROWS])
    if zero_padding:
        dst_RH[rows:].zero_()
    if overflowed or tier is Tier.NONE:
        return
    need = -(-rows // page_size)
    pages = [int(p) for p in rec_pages_M[:need]]
    if tier is Tier.DEVICE:
        pool, free, tail_idx = dev_pool_NH, dev_free_P, State.TAIL
    else:
        pool, free, tail_idx = host_pool_NH, host_free_P, State.HOST_TAIL
    _move_rows(rows, page_size, pages, pool, dst_RH, to_pool=False)
    tail = int(state[tail_idx])
    for i, page in enumerate(pages):
        free[(tail + i) % free.numel()] = page
    state[tail_idx] = tail + need
