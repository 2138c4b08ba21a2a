"""Triton stash copy and pop: the CUDA hot path, bit-identical to :mod:`.reference`.

Shape suffixes: ``R`` rows of the static buffer (``max_rows``), ``H`` hidden (elements per row),
``N`` pool rows (``pages × S``), ``P`` pages, ``S`` page size, ``M`` record page slots.

Nothing here reads a device value on the host: the token count, the free-list counters and the
flags are read by the kernels, and every launch grid comes from static shapes, so both ops are
CUDA-graph safe. Each op is two launches on the current stream (they run in order):

========================  ==================================  =====================================
kernel (grid)             reads                               writes
========================  ==================================  =====================================
``_alloc_kernel`` (1,)    num_tokens, flags, state,           rec_meta, rec_pages_M, state (HEAD,
                          dev/host free lists                 HWM, ROWS_STASHED, SPILLED, host
                                                              counters, DEMANDED, DEMAND_HWM),
                                                              flags
``_move_kernel`` (tiles)  rec_meta, rec_pages_M, src_RH;      dev or host pool rows (copy);
                          flags + a pool (pop)                dst_RH rows and zero padding (pop)
``_free_kernel`` (1,)     flags, rec_meta, rec_pages_M,       the record tier's free list at
                          state                               ``(tail + i) % P``, TAIL/HOST_TAIL,
                                                              RETURNED, rec_meta
========================  ==================================  =====================================

Data moves as raw bits: callers pass integer views (int16 for bf16, uint8 for fp8, ...); loads
and stores do no arithmetic, so float views work too. On CUDA the host pool is a pinned CPU
tensor that the kernels address directly (unified virtual addressing); a host tier with zero
pages compiles its branch out (``HAS_HOST``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from te_paged.kernels.layout import Flag, Meta, State, Tier

__all__ = ["triton_stash_copy", "triton_stash_pop"]

_MAX_ROW_PROGRAMS = 2048  # beyond this the row tiles are looped over, not launched
_BLOCK_PAGES = 128  # page ids handled per loop step of the (1,)-grid bookkeeping kernels

# The layout's enums as compile-time constants: @triton.jit code may only read constexpr globals.
_HEAD = tl.constexpr(int(State.HEAD))
_TAIL = tl.constexpr(int(State.TAIL))
_HWM = tl.constexpr(int(State.HWM))
_HOST_HEAD = tl.constexpr(int(State.HOST_HEAD))
_HOST_TAIL = tl.constexpr(int(State.HOST_TAIL))
_HOST_HWM = tl.constexpr(int(State.HOST_HWM))
_ROWS_STASHED = tl.constexpr(int(State.ROWS_STASHED))
_SPILLED = tl.constexpr(int(State.SPILLED))
_DEMANDED = tl.constexpr(int(State.DEMANDED))
_RETURNED = tl.constexpr(int(State.RETURNED))
_DEMAND_HWM = tl.constexpr(int(State.DEMAND_HWM))
_OVERFLOW = tl.constexpr(int(Flag.OVERFLOW))
_HOST_SPILL = tl.constexpr(int(Flag.HOST_SPILL))
_INVALID = tl.constexpr(int(Flag.INVALID))
_ROWS = tl.constexpr(int(Meta.ROWS))
_TIER = tl.constexpr(int(Meta.TIER))
_POPPED = tl.constexpr(int(Meta.POPPED))
_NEED = tl.constexpr(int(Meta.NEED))
_DEVICE = tl.constexpr(int(Tier.DEVICE))
_HOST = tl.constexpr(int(Tier.HOST))


# Masks are built by comparing offsets with per-tier counts (``offs < n_dev``) rather than by
# and-ing a scalar bool into a block: Triton 3.9's interpreter splats a scalar comparison result
# as int64, which then makes the mask an integer and the load fail.


@triton.jit
def _alloc_kernel(
    num_tokens_ptr, state_ptr, flags_ptr, dev_free_ptr, host_free_ptr, rec_pages_ptr,
    rec_meta_ptr, max_rows, tokens_per_row, page_size, dev_pages, host_pages,
    HAS_HOST: tl.constexpr,  # no host tier: drop its loads and its `% host_pages` (0) entirely
    BLOCK_PAGES: tl.constexpr,  # tile size of the page-id loop: a tl.arange length
):  # fmt: skip
    active = tl.load(flags_ptr + _OVERFLOW) == 0
    n = tl.load(num_tokens_ptr).to(tl.int64)
    # Divide non-negative values only: C and Python round a negative `//` differently.
    rows = (tl.maximum(n, 0) + tokens_per_row - 1) // tokens_per_row
    # A count the static buffer cannot hold, or negative: invalid input, not a full pool.
    bad = (n < 0) | (n > max_rows * tokens_per_row)
    need = (rows + page_size - 1) // page_size
    head = tl.load(state_ptr + _HEAD)
    tail = tl.load(state_ptr + _TAIL)
    host_head = tl.load(state_ptr + _HOST_HEAD)
    host_tail = tl.load(state_ptr + _HOST_TAIL)
    fits_dev = need <= tail - head
    fits_host = (need <= host_tail - host_head) & (host_pages > 0)
    to_dev = active & ~bad & fits_dev
    to_host = active & ~bad & ~fits_dev & fits_host
    stored = to_dev | to_host
    overflow = active & ~bad & ~stored
    invalid = active & bad

    stored_rows = tl.where(stored, rows, 0)
    tier = to_dev.to(tl.int64) * _DEVICE + to_host.to(tl.int64) * _HOST  # Tier.NONE is 0
    # What the step asks of the pool, stored or not, even after an overflow (layout.py).
    asked = tl.where(bad, 0, need)
    demanded = tl.load(state_ptr + _DEMANDED) + asked
    outstanding = demanded - tl.load(state_ptr + _RETURNED)
    tl.store(state_ptr + _DEMANDED, demanded)
    tl.store(state_ptr + _DEMAND_HWM, tl.maximum(tl.load(state_ptr + _DEMAND_HWM), outstanding))
    tl.store(rec_meta_ptr + _NEED, asked)
    tl.store(rec_meta_ptr + _ROWS, stored_rows)
    tl.store(rec_meta_ptr + _TIER, tier)
    tl.store(rec_meta_ptr + _POPPED, tier * 0)
    # Stored only when counted: with stream overlap this runs on the pack stream, and the flags
    # are one tensor that other streams update too.
    tl.store(flags_ptr + _OVERFLOW, tl.load(flags_ptr + _OVERFLOW) + 1, mask=overflow)
    tl.store(flags_ptr + _INVALID, tl.load(flags_ptr + _INVALID) + 1, mask=invalid)
    tl.store(flags_ptr + _HOST_SPILL, tl.load(flags_ptr + _HOST_SPILL) + 1, mask=to_host)
    tl.store(state_ptr + _ROWS_STASHED, tl.load(state_ptr + _ROWS_STASHED) + stored_rows)

    # Record pages: queue slots head .. head+need-1 of the chosen tier's free list.
    n_dev = tl.where(to_dev, need, 0)
    n_host = tl.where(to_host, need, 0)
    dev_mod = tl.maximum(dev_pages, 1)  # a masked-off lane must not divide by zero
    for start in range(0, n_dev + n_host, BLOCK_PAGES):
        offs = start + tl.arange(0, BLOCK_PAGES).to(tl.int64)
        page = tl.load(dev_free_ptr + (head + offs) % dev_mod, mask=offs < n_dev, other=0)
        if HAS_HOST:
            slot = (host_head + offs) % host_pages
            host_page = tl.load(host_free_ptr + slot, mask=offs < n_host, other=0)
            page = tl.where(offs < n_host, host_page, page)
        page = page.to(rec_pages_ptr.dtype.element_ty)
        tl.store(rec_pages_ptr + offs, page, mask=offs < n_dev + n_host)

    hwm = tl.load(state_ptr + _HWM)
    dev_in_use = dev_pages - (tail - head - need)
    tl.store(state_ptr + _HEAD, head + n_dev)
    tl.store(state_ptr + _HWM, tl.where(to_dev, tl.maximum(hwm, dev_in_use), hwm))
    if HAS_HOST:
        host_hwm = tl.load(state_ptr + _HOST_HWM)
        host_in_use = host_pages - (host_tail - host_head - need)
        tl.store(state_ptr + _HOST_HEAD, host_head + n_host)
        tl.store(
            state_ptr + _HOST_HWM, tl.where(to_host, tl.maximum(host_hwm, host_in_use), host_hwm)
        )
        tl.store(state_ptr + _SPILLED, tl.load(state_ptr + _SPILLED) + to_host.to(tl.int64))


@triton.jit
def _move_kernel(
    buf_ptr, buf_stride_r, buf_stride_h, dev_pool_ptr, host_pool_ptr, rec_pages_ptr,
    rec_meta_ptr, flags_ptr, max_rows, hidden, page_size,
    TO_POOL: tl.constexpr,  # copy (buf -> pool) or pop (pool -> buf): different loads/stores
    ZERO_PADDING: tl.constexpr,  # pop only: also visit rows past the stored ones, write zeros
    HAS_HOST: tl.constexpr,  # no host tier: its pointer is a placeholder never dereferenced
    BLOCK_ROWS: tl.constexpr,  # tile sizes: tl.arange lengths must be compile-time
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    tier = tl.load(rec_meta_ptr + _TIER)
    rows = tl.load(rec_meta_ptr + _ROWS)  # 0 for Tier.NONE: the alloc kernel wrote it so
    if not TO_POOL:  # after an overflow the record's pages may hold anything: read none
        rows = tl.where(tl.load(flags_ptr + _OVERFLOW) == 0, rows, 0)
        # Popped before: the pages may belong to another tensor by now. Read none.
        rows = tl.where(tl.load(rec_meta_ptr + _POPPED) == 0, rows, 0)
        # A dst shorter than the record is a caller bug the reference raises on; never write
        # past the end of dst for it (the free kernel still returns all the record's pages).
        rows = tl.minimum(rows, max_rows)
    rows_dev = tl.where(tier == _DEVICE, rows, 0)
    rows_host = tl.where(tier == _HOST, rows, 0)
    rows = rows_dev + rows_host

    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    mask_h = offs_h[None, :] < hidden
    visit = rows
    if ZERO_PADDING:
        visit = max_rows
    n_tiles = (visit + BLOCK_ROWS - 1) // BLOCK_ROWS
    step = tl.num_programs(0).to(tl.int64)
    for t in range(tl.program_id(0).to(tl.int64), n_tiles, step):
        r = t * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        page = tl.load(rec_pages_ptr + r // page_size, mask=r < rows, other=0).to(tl.int64)
        pool_off = ((page * page_size + r % page_size) * hidden)[:, None] + offs_h[None, :]
        buf_off = r[:, None] * buf_stride_r + offs_h[None, :] * buf_stride_h
        on_dev = (r < rows_dev)[:, None] & mask_h
        on_host = (r < rows_host)[:, None] & mask_h
        if TO_POOL:
            x = tl.load(buf_ptr + buf_off, mask=(r < rows)[:, None] & mask_h)
            tl.store(dev_pool_ptr + pool_off, x, mask=on_dev)
            if HAS_HOST:
                tl.store(host_pool_ptr + pool_off, x, mask=on_host)
        else:
            x = tl.load(dev_pool_ptr + pool_off, mask=on_dev, other=0)
            if HAS_HOST:
                x = tl.where(on_host, tl.load(host_pool_ptr + pool_off, mask=on_host, other=0), x)
            if ZERO_PADDING:  # x is already 0 past the stored rows (masked loads, other=0)
                tl.store(buf_ptr + buf_off, x, mask=(r < max_rows)[:, None] & mask_h)
            else:
                tl.store(buf_ptr + buf_off, x, mask=(r < rows)[:, None] & mask_h)


@triton.jit
def _free_kernel(
    state_ptr, flags_ptr, dev_free_ptr, host_free_ptr, rec_pages_ptr, rec_meta_ptr,
    page_size, dev_pages, host_pages,
    HAS_HOST: tl.constexpr,  # no host tier: drop its stores and its `% host_pages` (0) entirely
    BLOCK_PAGES: tl.constexpr,  # tile size of the page-id loop: a tl.arange length
):  # fmt: skip
    tier = tl.load(rec_meta_ptr + _TIER)
    need = (tl.load(rec_meta_ptr + _ROWS) + page_size - 1) // page_size
    active = tl.load(flags_ptr + _OVERFLOW) == 0  # overflow: pool untouched
    popped = tl.load(rec_meta_ptr + _POPPED) != 0  # a second pop: free nothing, count it
    need = tl.where(active & ~popped, need, 0)
    stored = (tier == _DEVICE) | (tier == _HOST)
    # Only a second pop writes the flag: the compute stream adds to it too (the experts'
    # count checks), and an unconditional read-modify-write from the unpack stream could undo
    # its update.
    tl.store(flags_ptr + _INVALID, tl.load(flags_ptr + _INVALID) + 1, mask=popped)
    tl.store(rec_meta_ptr + _POPPED, (popped | (active & stored)).to(tl.int64))
    # The demand comes back once, stored or not (a second pop finds NEED cleared, or POPPED).
    back = tl.where(popped, 0, tl.load(rec_meta_ptr + _NEED))
    tl.store(state_ptr + _RETURNED, tl.load(state_ptr + _RETURNED) + back)
    tl.store(rec_meta_ptr + _NEED, back * 0)
    n_dev = tl.where(tier == _DEVICE, need, 0)
    n_host = tl.where(tier == _HOST, need, 0)
    tail = tl.load(state_ptr + _TAIL)
    host_tail = tl.load(state_ptr + _HOST_TAIL)
    dev_mod = tl.maximum(dev_pages, 1)  # a masked-off lane must not divide by zero
    for start in range(0, n_dev + n_host, BLOCK_PAGES):
        offs = start + tl.arange(0, BLOCK_PAGES).to(tl.int64)
        page = tl.load(rec_pages_ptr + offs, mask=offs < n_dev + n_host, other=0)
        dev_page = page.to(dev_free_ptr.dtype.element_ty)
        tl.store(dev_free_ptr + (tail + offs) % dev_mod, dev_page, mask=offs < n_dev)
        if HAS_HOST:
            host_page = page.to(host_free_ptr.dtype.element_ty)
            slot = (host_tail + offs) % host_pages
            tl.store(host_free_ptr + slot, host_page, mask=offs < n_host)
    tl.store(state_ptr + _TAIL, tail + n_dev)
    if HAS_HOST:
        tl.store(state_ptr + _HOST_TAIL, host_tail + n_host)


def _check(
    buf_RH: torch.Tensor, page_size: int, dev_pool_NH: torch.Tensor, host_pool_NH: torch.Tensor,
    rec_pages_M: torch.Tensor,
) -> None:  # fmt: skip
    """Static (shape/dtype) checks only: nothing here may read device memory."""
    if buf_RH.dim() != 2 or page_size < 1:
        raise ValueError(
            f"need a 2-D buffer and page_size >= 1, got {tuple(buf_RH.shape)}, "
            f"page_size={page_size}"
        )
    for name, pool in (("dev_pool_NH", dev_pool_NH), ("host_pool_NH", host_pool_NH)):
        if pool.numel() and (pool.dtype != buf_RH.dtype or pool.shape[1:] != buf_RH.shape[1:]):
            raise ValueError(
                f"{name} is {pool.dtype} {tuple(pool.shape)} but the buffer is "
                f"{buf_RH.dtype} {tuple(buf_RH.shape)}: dtype and hidden must match"
            )
        if not pool.is_contiguous():
            raise ValueError(f"{name} must be contiguous: its rows are addressed as page*S*H")
    slots = triton.cdiv(buf_RH.shape[0], page_size)
    if rec_pages_M.numel() < slots:
        raise ValueError(
            f"rec_pages_M has {rec_pages_M.numel()} slots; {buf_RH.shape[0]} rows at "
            f"page size {page_size} need {slots}"
        )


def _launch_move(
    buf_RH: torch.Tensor, page_size: int, dev_pool_NH: torch.Tensor, host_pool_NH: torch.Tensor,
    has_host: bool, rec_pages_M: torch.Tensor, rec_meta: torch.Tensor, flags: torch.Tensor, *,
    to_pool: bool, zero_padding: bool,
) -> None:  # fmt: skip
    max_rows, hidden = buf_RH.shape
    block_h = min(triton.next_power_of_2(max(hidden, 1)), 1024)
    # At most 64 rows and ~16 KiB per tile; at least one row.
    block_rows = max(1, min(64, 16384 // (block_h * buf_RH.element_size())))
    block_rows = 1 << (block_rows.bit_length() - 1)  # tl.arange wants a power of two
    row_programs = min(max(triton.cdiv(max_rows, block_rows), 1), _MAX_ROW_PROGRAMS)
    grid = (row_programs, max(triton.cdiv(hidden, block_h), 1))
    _move_kernel[grid](
        buf_RH, buf_RH.stride(0), buf_RH.stride(1), dev_pool_NH,
        host_pool_NH if has_host else dev_pool_NH, rec_pages_M, rec_meta, flags, max_rows,
        hidden, page_size, TO_POOL=to_pool, ZERO_PADDING=zero_padding, HAS_HOST=has_host,
        BLOCK_ROWS=block_rows, BLOCK_H=block_h,
    )  # fmt: skip


def triton_stash_copy(
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
    """Same contract as :func:`~te_paged.kernels.reference.torch_stash_copy`, without host reads.

    Also raises ``ValueError`` up front, from shapes alone, where the reference would fail (or
    write out of bounds) only for some token counts: ``rec_pages_M`` must hold
    ``ceil(max_rows / page_size)`` slots.
    """
    _check(src_RH, page_size, dev_pool_NH, host_pool_NH, rec_pages_M)
    if tokens_per_row < 1:
        raise ValueError(f"tokens_per_row must be >= 1, got {tokens_per_row}")
    has_host = host_free_P.numel() > 0  # an empty host tier's tensors are never dereferenced
    _alloc_kernel[(1,)](
        num_tokens, state, flags, dev_free_P, host_free_P if has_host else dev_free_P,
        rec_pages_M, rec_meta, src_RH.shape[0], tokens_per_row, page_size, dev_free_P.numel(),
        host_free_P.numel(), HAS_HOST=has_host, BLOCK_PAGES=_BLOCK_PAGES,
    )  # fmt: skip
    _launch_move(
        src_RH, page_size, dev_pool_NH, host_pool_NH, has_host, rec_pages_M, rec_meta, flags,
        to_pool=True, zero_padding=False,
    )  # fmt: skip


def triton_stash_pop(
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
    """Same contract as :func:`~te_paged.kernels.reference.torch_stash_pop`, without host reads.

    The free kernel is launched after the data kernel on the same stream, so no page returns to
    a free list (and to the next copy) before its rows have been read.
    """
    _check(dst_RH, page_size, dev_pool_NH, host_pool_NH, rec_pages_M)
    has_host = host_free_P.numel() > 0
    _launch_move(
        dst_RH, page_size, dev_pool_NH, host_pool_NH, has_host, rec_pages_M, rec_meta, flags,
        to_pool=False, zero_padding=zero_padding,
    )  # fmt: skip
    _free_kernel[(1,)](
        state, flags, dev_free_P, host_free_P if has_host else dev_free_P, rec_pages_M, rec_meta,
        page_size, dev_free_P.numel(), host_free_P.numel(), HAS_HOST=has_host,
        BLOCK_PAGES=_BLOCK_PAGES,
    )  # fmt: skip
