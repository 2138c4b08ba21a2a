"""Triton stash copy and pop: the CUDA hot path, bit-identical to :mod:`.reference`.

Shape suffixes: ``R`` rows of the static buffer (``max_rows``), ``H`` hidden (elements per row),
``N`` pool rows (``pages × S``), ``P`` pages, ``S`` page size, ``M`` record page slots.

Nothing here reads a device value on the host: the token count, the free-list counters and the
flags are read by the kernels, and every launch grid comes from static shapes, so both ops are
CUDA-graph safe. Each op is **one launch** on the current stream:

==================  =======================================  ====================================
kernel (grid)       every program                            the last program to finish
==================  =======================================  ====================================
``_stash_kernel``   loads num_tokens, flags, the free-list   rec_meta, state (HEAD, HWM,
(row tiles)         counters; derives the allocation; for    ROWS_STASHED, SPILLED, host
                    its rows: page ids from the free list    counters, DEMANDED, DEMAND_HWM),
                    into rec_pages_M, rows into the pool     flags
``_pop_kernel``     loads rec_meta, flags; for its rows:     the record tier's free list at
(row tiles)         page ids from rec_pages_M, pool rows     ``(tail + i) % P``, TAIL/HOST_TAIL,
                    into dst_RH (zeros past them)            RETURNED, rec_meta, flags
==================  =======================================  ====================================

**Why one launch is race-free.** Every program loads the state it needs before writing anything
the others read, and derives the same allocation from it (the pages at the head of the free list
are a pure function of the counters). What the launch changes is written by exactly one program,
the last to finish: each program, once done with its rows, takes a ticket with an acq_rel atomic
add on ``state[COPY_TICKET]`` (``POP_TICKET`` for a pop); the one that draws ``programs − 1``
knows every other program has loaded what it needed and, for a pop, read every row of the pages
it is about to free (release orders a program's loads and stores before its ticket, acquire
orders the last program's writes after all of them). It writes the counters and the record, then
puts the ticket back to 0 for the next launch — no side tensor, no ``copy_`` after the launch,
no spinning (no program waits for another, so nothing depends on all programs being resident).
Across streams, copies and pops are already ordered by the manager's events (``reuse after
pop``, ``pop after stash``), and the two tickets are separate in any case.

Worked example (3 programs): programs 1, 0, 2 finish in that order and draw tickets 0, 1, 2;
program 2 draws ``3 − 1``, writes HEAD, the record's meta and the flags, and stores ticket 0.

Data moves as raw bits: callers pass integer views (int16 for bf16, uint8 for fp8, ...); loads
and stores do no arithmetic, so float views work too. The row width is a compile-time constant
(``HIDDEN``): pools are per (dtype, hidden), so a model compiles a handful of variants, and the
compiler then knows each row's alignment and moves it in 128-bit accesses where the row's bytes
allow (``te-paged bench --compiled`` prints the widths). On CUDA the host pool is a pinned CPU
tensor that the kernels address directly (unified virtual addressing); a host tier with zero
pages compiles its branch out (``HAS_HOST``).

The host side is lean: shapes are checked once per (buffer shape, pool) and the launch's grid and
constants are kept (:func:`_plan`); a call is then one dictionary look-up and one launch.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
import triton
import triton.language as tl

from te_paged.kernels.layout import Flag, Meta, State, Tier

__all__ = ["triton_stash_copy", "triton_stash_pop"]

_MAX_ROW_PROGRAMS = 2048  # beyond this the row tiles are looped over, not launched
_BLOCK_PAGES = 128  # page ids handled per loop step of the pop's free-list write
_TILE_BYTES = 16384  # bytes a program moves per step: enough loads in flight per SM
_MAX_BLOCK_H = 1024  # row elements per step; wider rows loop over their columns

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
_COPY_TICKET = tl.constexpr(int(State.COPY_TICKET))
_POP_TICKET = tl.constexpr(int(State.POP_TICKET))
_OVERFLOW = tl.constexpr(int(Flag.OVERFLOW))
_HOST_SPILL = tl.constexpr(int(Flag.HOST_SPILL))
_INVALID = tl.constexpr(int(Flag.INVALID))
_ROWS = tl.constexpr(int(Meta.ROWS))
_TIER = tl.constexpr(int(Meta.TIER))
_POPPED = tl.constexpr(int(Meta.POPPED))
_NEED = tl.constexpr(int(Meta.NEED))
_DEVICE = tl.constexpr(int(Tier.DEVICE))
_HOST = tl.constexpr(int(Tier.HOST))


# Masks are built by comparing offsets with per-tier counts (``r < rows_dev``) rather than by
# and-ing a scalar bool into a block: Triton 3.9's interpreter splats a scalar comparison result
# as int64, which then makes the mask an integer and the load fail.


@triton.jit
def _row_offsets(r, stride_r, stride_h, offs_h, CONTIGUOUS: tl.constexpr, HIDDEN: tl.constexpr):
    """Element offsets of columns ``offs_h`` of buffer rows ``r``: a contiguous buffer's rows
    are ``HIDDEN`` apart, which the compiler then knows (and so their alignment)."""
    if CONTIGUOUS:
        return (r * HIDDEN)[:, None] + offs_h[None, :]
    return (r * stride_r)[:, None] + offs_h[None, :].to(tl.int64) * stride_h


@triton.jit
def _stash_kernel(
    src_ptr, src_stride_r, src_stride_h, num_tokens_ptr, state_ptr, flags_ptr, dev_free_ptr,
    host_free_ptr, dev_pool_ptr, host_pool_ptr, rec_pages_ptr, rec_meta_ptr, max_rows,
    tokens_per_row, page_size, dev_pages, host_pages,
    HIDDEN: tl.constexpr,  # row width: static per pool; known, it fixes alignment and masks
    CONTIGUOUS: tl.constexpr,  # rows HIDDEN apart, columns adjacent (every buffer te_paged has)
    HAS_HOST: tl.constexpr,  # no host tier: drop its loads and its `% host_pages` (0) entirely
    BLOCK_ROWS: tl.constexpr,  # tile sizes: tl.arange lengths must be compile-time
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    # The allocation, derived alike by every program from what it loads before anyone writes.
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
    rows_dev = tl.where(to_dev, rows, 0)
    rows_host = tl.where(to_host, rows, 0)
    stored_rows = rows_dev + rows_host

    # The rows: slot r // S of the record is queue slot head + r // S of the tier's free list.
    dev_mod = tl.maximum(dev_pages, 1)  # a masked-off lane must not divide by zero
    n_tiles = (stored_rows + BLOCK_ROWS - 1) // BLOCK_ROWS
    programs = tl.num_programs(0)
    for t in range(tl.program_id(0).to(tl.int64), n_tiles, programs):
        r = t * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        slot = r // page_size
        page = tl.load(dev_free_ptr + (head + slot) % dev_mod, mask=r < rows_dev, other=0)
        if HAS_HOST:
            host_slot = (host_head + slot) % host_pages
            host_page = tl.load(host_free_ptr + host_slot, mask=r < rows_host, other=0)
            page = tl.where(r < rows_host, host_page, page)
        # Each page id is recorded by the program holding the page's first row.
        first = (r < stored_rows) & (r % page_size == 0)
        tl.store(rec_pages_ptr + slot, page.to(rec_pages_ptr.dtype.element_ty), mask=first)
        pool_r = (page.to(tl.int64) * page_size + r % page_size) * HIDDEN
        for h0 in range(0, HIDDEN, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h[None, :] < HIDDEN
            pool_off = pool_r[:, None] + offs_h[None, :]
            buf_off = _row_offsets(r, src_stride_r, src_stride_h, offs_h, CONTIGUOUS, HIDDEN)
            x = tl.load(src_ptr + buf_off, mask=(r < stored_rows)[:, None] & mask_h)
            if HAS_HOST:  # two stores, each masked to its tier's rows: both stay 128-bit wide
                tl.store(dev_pool_ptr + pool_off, x, mask=(r < rows_dev)[:, None] & mask_h)
                tl.store(host_pool_ptr + pool_off, x, mask=(r < rows_host)[:, None] & mask_h)
            else:
                tl.store(dev_pool_ptr + pool_off, x, mask=(r < stored_rows)[:, None] & mask_h)

    # The bookkeeping, by the last program to finish (module docstring).
    if tl.atomic_add(state_ptr + _COPY_TICKET, 1, sem="acq_rel") == programs - 1:
        stored = to_dev | to_host
        overflow = active & ~bad & ~stored
        invalid = active & bad
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
        # Stored only when counted: with stream overlap this runs on the pack stream, and the
        # flags are one tensor that other streams update too.
        tl.store(flags_ptr + _OVERFLOW, tl.load(flags_ptr + _OVERFLOW) + 1, mask=overflow)
        tl.store(flags_ptr + _INVALID, tl.load(flags_ptr + _INVALID) + 1, mask=invalid)
        tl.store(flags_ptr + _HOST_SPILL, tl.load(flags_ptr + _HOST_SPILL) + 1, mask=to_host)
        tl.store(state_ptr + _ROWS_STASHED, tl.load(state_ptr + _ROWS_STASHED) + stored_rows)
        n_dev = tl.where(to_dev, need, 0)
        hwm = tl.load(state_ptr + _HWM)
        dev_in_use = dev_pages - (tail - head - need)
        tl.store(state_ptr + _HEAD, head + n_dev)
        tl.store(state_ptr + _HWM, tl.where(to_dev, tl.maximum(hwm, dev_in_use), hwm))
        if HAS_HOST:
            host_hwm = tl.load(state_ptr + _HOST_HWM)
            host_in_use = host_pages - (host_tail - host_head - need)
            tl.store(state_ptr + _HOST_HEAD, host_head + tl.where(to_host, need, 0))
            host_hwm = tl.where(to_host, tl.maximum(host_hwm, host_in_use), host_hwm)
            tl.store(state_ptr + _HOST_HWM, host_hwm)
            tl.store(state_ptr + _SPILLED, tl.load(state_ptr + _SPILLED) + to_host.to(tl.int64))
        tl.store(state_ptr + _COPY_TICKET, 0)


@triton.jit
def _pop_kernel(
    dst_ptr, dst_stride_r, dst_stride_h, state_ptr, flags_ptr, dev_free_ptr, host_free_ptr,
    dev_pool_ptr, host_pool_ptr, rec_pages_ptr, rec_meta_ptr, max_rows, page_size, dev_pages,
    host_pages,
    HIDDEN: tl.constexpr,  # row width: static per pool; known, it fixes alignment and masks
    CONTIGUOUS: tl.constexpr,  # rows HIDDEN apart, columns adjacent (every buffer te_paged has)
    ZERO_PADDING: tl.constexpr,  # also visit rows past the stored ones, write zeros
    HAS_HOST: tl.constexpr,  # no host tier: its pointers are placeholders never dereferenced
    BLOCK_ROWS: tl.constexpr,  # tile sizes: tl.arange lengths must be compile-time
    BLOCK_H: tl.constexpr,
    BLOCK_PAGES: tl.constexpr,  # tile size of the free-list write
):  # fmt: skip
    tier = tl.load(rec_meta_ptr + _TIER)
    rec_rows = tl.load(rec_meta_ptr + _ROWS)  # 0 for Tier.NONE: the stash wrote it so
    active = tl.load(flags_ptr + _OVERFLOW) == 0  # after an overflow the pages may hold anything
    popped = tl.load(rec_meta_ptr + _POPPED) != 0  # popped before: pages may be another's now
    rows = tl.where(active & ~popped, rec_rows, 0)
    # A dst shorter than the record is a caller bug the reference raises on; never write past
    # the end of dst for it (all the record's pages are still returned).
    rows = tl.minimum(rows, max_rows)
    rows_dev = tl.where(tier == _DEVICE, rows, 0)
    rows_host = tl.where(tier == _HOST, rows, 0)
    rows = rows_dev + rows_host

    visit = rows
    if ZERO_PADDING:
        visit = max_rows
    n_tiles = (visit + BLOCK_ROWS - 1) // BLOCK_ROWS
    programs = tl.num_programs(0)
    for t in range(tl.program_id(0).to(tl.int64), n_tiles, programs):
        r = t * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        page = tl.load(rec_pages_ptr + r // page_size, mask=r < rows, other=0).to(tl.int64)
        pool_r = (page * page_size + r % page_size) * HIDDEN
        for h0 in range(0, HIDDEN, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            mask_h = offs_h[None, :] < HIDDEN
            pool_off = pool_r[:, None] + offs_h[None, :]
            if HAS_HOST:  # two loads, each masked to its tier's rows: both stay 128-bit wide
                on_host = (r < rows_host)[:, None] & mask_h
                x = tl.load(dev_pool_ptr + pool_off, mask=(r < rows_dev)[:, None] & mask_h,
                            other=0)  # fmt: skip
                x = tl.where(on_host, tl.load(host_pool_ptr + pool_off, mask=on_host, other=0), x)
            else:
                x = tl.load(dev_pool_ptr + pool_off, mask=(r < rows)[:, None] & mask_h, other=0)
            buf_off = _row_offsets(r, dst_stride_r, dst_stride_h, offs_h, CONTIGUOUS, HIDDEN)
            # Past the stored rows x is 0 (a masked load, other=0): the padding, when visited.
            tl.store(dst_ptr + buf_off, x, mask=(r < visit)[:, None] & mask_h)

    # The free list, by the last program to finish: every row of the pages it returns is read.
    if tl.atomic_add(state_ptr + _POP_TICKET, 1, sem="acq_rel") == programs - 1:
        need = (rec_rows + page_size - 1) // page_size
        need = tl.where(active & ~popped, need, 0)
        stored = (tier == _DEVICE) | (tier == _HOST)
        # Only a second pop writes the flag: the compute stream adds to it too (the experts'
        # count checks), and an unconditional read-modify-write from the unpack stream could
        # undo its update.
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
        tl.store(state_ptr + _POP_TICKET, 0)


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """One launch's static part, kept per (buffer shape, pool): the checks it passed, the
    grid, the scalars and the compile-time constants."""

    launch: object  # kernel[grid]: Triton's launcher for the grid
    max_rows: int
    stride_r: int
    stride_h: int
    dev_pages: int
    host_pages: int
    has_host: bool
    constexprs: dict[str, int | bool]


# id(dev_pool) -> (the ids of the pool's other tensors, {buffer key: plan}). A pool's entry goes
# when the pool does (weakref.finalize), so an id reused by a new tensor never finds it.
_POOLS: dict[int, tuple[tuple[int, ...], dict[tuple, _Plan]]] = {}


def _pool_plans(
    page_size: int, dev_pool_NH: torch.Tensor, dev_free_P: torch.Tensor,
    host_pool_NH: torch.Tensor, host_free_P: torch.Tensor,
) -> dict[tuple, _Plan]:  # fmt: skip
    """The plans of the pool, checked once (pools are allocated once and never reshaped)."""
    ids = (id(dev_free_P), id(host_pool_NH), id(host_free_P), page_size)
    entry = _POOLS.get(id(dev_pool_NH))
    if entry is not None and entry[0] == ids:
        return entry[1]
    if page_size < 1:
        raise ValueError(f"need page_size >= 1, got page_size={page_size}")
    for name, pool in (("dev_pool_NH", dev_pool_NH), ("host_pool_NH", host_pool_NH)):
        if pool.dim() != 2:
            raise ValueError(f"{name} must be [pages * page_size, hidden], got {tuple(pool.shape)}")
        if not pool.is_contiguous():
            raise ValueError(f"{name} must be contiguous: its rows are addressed as page*S*H")
    if entry is None:
        weakref.finalize(dev_pool_NH, _POOLS.pop, id(dev_pool_NH), None)
    plans: dict[tuple, _Plan] = {}
    _POOLS[id(dev_pool_NH)] = (ids, plans)
    return plans


def _plan(
    buf_RH: torch.Tensor, page_size: int, dev_pool_NH: torch.Tensor, dev_free_P: torch.Tensor,
    host_pool_NH: torch.Tensor, host_free_P: torch.Tensor, rec_pages_M: torch.Tensor,
    op: tuple[str, int | bool],
) -> _Plan:  # fmt: skip
    """The launch plan of ``op``, ``("copy", tokens_per_row)`` or ``("pop", zero_padding)``,
    for this buffer shape and pool: built and checked on the first call only. Static (shape and
    dtype) checks only: nothing here may read device memory."""
    plans = _pool_plans(page_size, dev_pool_NH, dev_free_P, host_pool_NH, host_free_P)
    key = (buf_RH.shape, buf_RH.stride(), buf_RH.dtype, rec_pages_M.shape, op)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _new_plan(
            buf_RH, page_size, dev_pool_NH, dev_free_P, host_pool_NH, host_free_P, rec_pages_M,
            op,
        )  # fmt: skip
    return plan


def _new_plan(
    buf_RH: torch.Tensor, page_size: int, dev_pool_NH: torch.Tensor, dev_free_P: torch.Tensor,
    host_pool_NH: torch.Tensor, host_free_P: torch.Tensor, rec_pages_M: torch.Tensor,
    op: tuple[str, int | bool],
) -> _Plan:  # fmt: skip
    if buf_RH.dim() != 2:
        raise ValueError(f"need a 2-D buffer, got {tuple(buf_RH.shape)}")
    for name, pool in (("dev_pool_NH", dev_pool_NH), ("host_pool_NH", host_pool_NH)):
        if pool.numel() and (pool.dtype != buf_RH.dtype or pool.shape[1:] != buf_RH.shape[1:]):
            raise ValueError(
                f"{name} is {pool.dtype} {tuple(pool.shape)} but the buffer is "
                f"{buf_RH.dtype} {tuple(buf_RH.shape)}: dtype and hidden must match"
            )
    max_rows, hidden = buf_RH.shape
    slots = triton.cdiv(max_rows, page_size)
    if rec_pages_M.numel() < slots:
        raise ValueError(
            f"rec_pages_M has {rec_pages_M.numel()} slots; {max_rows} rows at "
            f"page size {page_size} need {slots}"
        )
    kind, value = op
    to_pool = kind == "copy"
    if to_pool and value < 1:
        raise ValueError(f"tokens_per_row must be >= 1, got {value}")
    has_host = host_free_P.numel() > 0  # an empty host tier's tensors are never dereferenced
    block_h = min(triton.next_power_of_2(max(hidden, 1)), _MAX_BLOCK_H)
    # At most 64 rows and ~16 KiB per tile (half with a host tier: its second access per
    # element needs the registers); at least one row.
    tile = _TILE_BYTES // 2 if has_host else _TILE_BYTES
    block_rows = max(1, min(64, tile // (block_h * buf_RH.element_size())))
    block_rows = 1 << (block_rows.bit_length() - 1)  # tl.arange wants a power of two
    grid = (min(max(triton.cdiv(max_rows, block_rows), 1), _MAX_ROW_PROGRAMS),)
    constexprs: dict[str, int | bool] = dict(
        HIDDEN=hidden, CONTIGUOUS=buf_RH.stride() == (hidden, 1) or max_rows <= 1,
        HAS_HOST=has_host, BLOCK_ROWS=block_rows, BLOCK_H=block_h,
    )  # fmt: skip
    if not to_pool:
        constexprs.update(ZERO_PADDING=value, BLOCK_PAGES=_BLOCK_PAGES)
    kernel = _stash_kernel if to_pool else _pop_kernel
    return _Plan(
        launch=kernel[grid], max_rows=max_rows, stride_r=buf_RH.stride(0),
        stride_h=buf_RH.stride(1), dev_pages=dev_free_P.numel(), host_pages=host_free_P.numel(),
        has_host=has_host, constexprs=constexprs,
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
    """Same contract as :func:`~te_paged.kernels.reference.torch_stash_copy`, without host reads,
    in one launch.

    Also raises ``ValueError`` up front, from shapes alone, where the reference would fail (or
    write out of bounds) only for some token counts: ``rec_pages_M`` must hold
    ``ceil(max_rows / page_size)`` slots.
    """
    p = _plan(src_RH, page_size, dev_pool_NH, dev_free_P, host_pool_NH, host_free_P,
              rec_pages_M, ("copy", tokens_per_row))  # fmt: skip
    host_free = host_free_P if p.has_host else dev_free_P
    p.launch(
        src_RH, p.stride_r, p.stride_h, num_tokens, state, flags, dev_free_P, host_free,
        dev_pool_NH, host_pool_NH if p.has_host else dev_pool_NH, rec_pages_M, rec_meta,
        p.max_rows, tokens_per_row, page_size, p.dev_pages, p.host_pages, **p.constexprs,
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
    """Same contract as :func:`~te_paged.kernels.reference.torch_stash_pop`, without host reads,
    in one launch, whose last program returns the pages once every row has been read."""
    p = _plan(dst_RH, page_size, dev_pool_NH, dev_free_P, host_pool_NH, host_free_P,
              rec_pages_M, ("pop", bool(zero_padding)))  # fmt: skip
    host_free = host_free_P if p.has_host else dev_free_P
    p.launch(
        dst_RH, p.stride_r, p.stride_h, state, flags, dev_free_P, host_free, dev_pool_NH,
        host_pool_NH if p.has_host else dev_pool_NH, rec_pages_M, rec_meta, p.max_rows,
        page_size, p.dev_pages, p.host_pages, **p.constexprs,
    )  # fmt: skip
