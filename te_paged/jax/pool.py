"""The page pool in JAX: functional state, and stash/pop with static shapes.

Shape suffixes: ``R`` rows of the static buffer (``max_rows``), ``H`` hidden (elements per row),
``N`` pool rows (``pages × S``), ``P`` pages, ``S`` page size, ``M`` record page slots
(``ceil(R / S)``).

The semantics are those of the torch reference (:mod:`te_paged.kernels.reference`) and its
layout (:mod:`te_paged.kernels.layout`, whose ``State``/``Flag``/``Meta``/``Tier`` indices
this module uses as they are): a tensor is stashed whole or not at all; not enough free pages
adds one to ``flags[OVERFLOW]`` and from then on every stash and pop is a no-op (never a
truncation); a count the static buffer cannot hold (negative, or more tokens than ``src_RH``'s
rows) stores nothing and adds one to ``flags[INVALID]`` instead: invalid input, which a rerun
would see again, so the JAX runner raises rather than rerun; pages are reached through the
record, so pops may come in any order; a pop zeroes the rows past the stored ones. Where JAX
differs:

* **Functional.** :class:`PagedPool` is a pytree of arrays; :func:`stash` and :func:`pop` return
  a new pool instead of writing in place (under ``jit`` with the pool donated, or as a
  ``lax.scan`` carry, XLA updates the buffers in place). The token count is a traced value: one
  compiled function serves every count.
* **No host tier.** ``HOST_*`` counters stay 0 and ``Tier.HOST`` never occurs.
* **A second pop** is told by page ownership, not by a flag in the record (a JAX record is an
  immutable value, so it cannot remember that it was popped): ``owner_P`` holds the stamp of the
  record that holds each page (``-1``: free), and a pop whose pages are not all stamped with its
  record's stamp counts ``INVALID`` and moves and frees nothing. A record of 0 rows holds no page;
  popping it twice moves and frees nothing either, and is not counted. A record also carries its
  pool's identity and generation: popped from another pool, after :func:`reset_pool`, or into a
  buffer of fewer rows than it stored, it counts ``INVALID`` and moves and frees nothing (the
  JAX runner raises on it). A token count must be an integer (a float is a ``TypeError``).
* **Bits.** Every float32 bit pattern moves unchanged (NaN payloads, signalling NaNs, -0.0),
  and every bfloat16 one except NaN payloads: XLA's CPU backend moves 16-bit floats through
  float32 and canonicalises their NaNs (0x7f81 and 0x7fc1 both become 0x7fc0) in any copy it
  fuses, with paged stash or without; a NaN stays a NaN. Moving the rows as integers would
  keep the payloads, but XLA then copied the whole pool instead of scattering into it in place.
* **Bookkeeping dtype.** ``free_P``, ``owner_P``, ``state`` and ``flags`` are int32, or float32
  holding exact integers for a pool that is threaded through a backward pass as a cotangent
  (:func:`te_paged.jax.paged_checkpoint`: JAX gives an integer array a ``float0`` cotangent,
  which carries no value). float32 is exact up to 2**24: :func:`make_pool` refuses a pool of
  that many rows, and the monotone counters (``HEAD``/``TAIL``, ``ROWS_STASHED``) must stay
  below it between two :func:`reset_pool` (a step's stashes: 58 DeepSeek-V3 layers of 65,536
  rows are 3.8M).

Worked example (4 pages of 2 rows, free list ``[0 1 2 3]``, head 0, tail 4, as in
:mod:`te_paged.kernels.layout`): stash A (3 rows) takes pages ``[0 1]`` (record ``[0 1 -1]``
for a static buffer of 5 rows, ``owner_P`` ``[a a -1 -1]``), head 2; stash B (1 row) takes
``[2]``, head 3; stash C (3 rows) needs 2 pages, 1 is free: ``flags[OVERFLOW]`` 1, C's record
``ROWS 0, TIER NONE``. Pop A returns ``[A's 3 rows, 0 0]`` and writes pages 0, 1 into free slots
0, 1, tail 6 — unless the overflow came first, as here, in which case it returns zeros and
leaves the pool as it is (the step is rerun without stashing).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_paged.kernels.layout import FLAGS_LEN, META_LEN, STATE_LEN, Flag, Meta, State, Tier

__all__ = [
    "STAMP",
    "PagedPool",
    "StashRecord",
    "make_pool",
    "overflowed",
    "pop",
    "reset_pool",
    "stash",
]

#: The JAX pool's state slots past the shared layout: the stamp the next stash gives its
#: record (see the module docstring: how a second pop is told), the pool's identity (from
#: make_pool) and its generation (reset_pool adds one). A record carries all three, and a pop
#: from another pool or generation counts ``INVALID`` and moves and frees nothing.
STAMP = STATE_LEN
POOL_ID = STATE_LEN + 1
GENERATION = STATE_LEN + 2
_EXTRA = 3
_POOL_IDS = itertools.count(1)

#: float32 holds every integer up to this exactly: the limit of a float bookkeeping dtype.
_FLOAT_EXACT = 2**24


class PagedPool(NamedTuple):
    """One pool (one dtype and hidden size): data, free list, page owners, counters, flags.

    ``pool_NH`` is ``[pages × page_size, hidden]`` in the stashed dtype; the page size is
    ``pool_NH.shape[0] // free_P.shape[0]``, so it is static wherever the shapes are.
    ``state`` is the shared layout's ``STATE_LEN`` counters plus :data:`STAMP`.
    """

    pool_NH: jax.Array
    free_P: jax.Array
    owner_P: jax.Array
    state: jax.Array
    flags: jax.Array

    @property
    def num_pages(self) -> int:
        return self.free_P.shape[0]

    @property
    def page_size(self) -> int:
        return self.pool_NH.shape[0] // self.free_P.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the page data (the bookkeeping is a few ints per page on top)."""
        return self.pool_NH.size * self.pool_NH.dtype.itemsize


class StashRecord(NamedTuple):
    """What :func:`pop` needs: the pages (``-1`` past the used slots), ``meta``
    (``Meta.ROWS``, ``Meta.TIER``, ``Meta.NEED``; ``Meta.POPPED`` stays 0, see the module
    docstring) and ``stamp``: the stamp its pages are owned under, the pool's identity and its
    generation. All int32; small (``M + META_LEN + 3`` ints)."""

    pages_M: jax.Array
    meta: jax.Array
    stamp: jax.Array


def make_pool(
    num_pages: int,
    page_size: int,
    hidden: int,
    dtype: jnp.dtype = jnp.float32,
    *,
    differentiable: bool = False,
) -> PagedPool:
    """A fresh pool: every page free, counters and flags zero, data zero.

    ``differentiable`` stores the bookkeeping as float32 (exact integers), as a pool threaded
    through :func:`te_paged.jax.paged_checkpoint` must be (see the module docstring).

    >>> pool = make_pool(num_pages=4, page_size=2, hidden=3)
    >>> pool.pool_NH.shape, pool.free_P.tolist(), pool.page_size
    ((8, 3), [0, 1, 2, 3], 2)
    """
    for name, value in (("num_pages", num_pages), ("page_size", page_size), ("hidden", hidden)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if differentiable and num_pages * page_size >= _FLOAT_EXACT:
        raise ValueError(
            f"{num_pages} pages of {page_size} rows: a differentiable pool keeps its counts in "
            f"float32, exact only below 2**24 rows: use fewer, or smaller, pages"
        )
    book = jnp.float32 if differentiable else jnp.int32
    return PagedPool(
        pool_NH=jnp.zeros((num_pages * page_size, hidden), dtype),
        free_P=jnp.arange(num_pages, dtype=book),
        owner_P=jnp.full((num_pages,), -1, book),
        state=jnp.zeros((STATE_LEN + _EXTRA,), book)
        .at[State.TAIL]
        .set(num_pages)
        .at[POOL_ID]
        .set(next(_POOL_IDS) % _FLOAT_EXACT),
        flags=jnp.zeros((FLAGS_LEN,), book),
    )


def reset_pool(pool: PagedPool) -> PagedPool:
    """Every page free again, counters and flags zero; the data stays (it is never read before
    it is written). Call it at a step boundary, inside the jitted step."""
    book = pool.state.dtype
    p = pool.num_pages
    return PagedPool(
        pool_NH=pool.pool_NH,
        free_P=jnp.arange(p, dtype=book),
        owner_P=jnp.full((p,), -1, book),
        state=jnp.zeros_like(pool.state)
        .at[State.TAIL]
        .set(p)
        .at[POOL_ID]
        .set(pool.state[POOL_ID])
        .at[GENERATION]
        .set((pool.state[GENERATION] + 1) % _FLOAT_EXACT),
        flags=jnp.zeros_like(pool.flags),
    )


def overflowed(pool: PagedPool) -> jax.Array:
    """A traced bool: some stash found no room (or more tokens than its static buffer)."""
    return pool.flags[Flag.OVERFLOW] != 0


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    return -(-a // b)


def stash(
    pool: PagedPool,
    src_RH: jax.Array,
    num_tokens: jax.Array | int,
    *,
    tokens_per_row: int = 1,
) -> tuple[PagedPool, StashRecord]:
    """Copy the first ``ceil(num_tokens / tokens_per_row)`` rows of ``src_RH`` into free pages.

    Whole or nothing: without room for all of them nothing is copied and ``flags[OVERFLOW]``
    counts it; with ``num_tokens`` outside ``[0, R × tokens_per_row]`` nothing is copied and
    ``flags[INVALID]`` counts it (the torch kernels' rule); after an overflow this is a no-op.
    Returns the new pool and the record :func:`pop` needs. ``num_tokens`` may be traced; every
    shape here depends on ``src_RH`` and the pool only.
    """
    if src_RH.ndim != 2 or src_RH.shape[1] != pool.pool_NH.shape[1]:
        raise ValueError(
            f"src_RH must be [rows, {pool.pool_NH.shape[1]}] for this pool, got {src_RH.shape}"
        )
    if src_RH.dtype != pool.pool_NH.dtype:
        raise TypeError(f"src_RH is {src_RH.dtype}, the pool holds {pool.pool_NH.dtype}")
    if not jnp.issubdtype(jnp.result_type(num_tokens), jnp.integer):
        raise TypeError(
            f"num_tokens must be an integer count, got {jnp.result_type(num_tokens)}: a float "
            "would be truncated (the torch manager refuses it too)"
        )
    r_static, n_pool = src_RH.shape[0], pool.pool_NH.shape[0]
    p, s = pool.num_pages, pool.page_size
    m = -(-r_static // s)
    book = pool.state.dtype
    st = pool.state.astype(jnp.int32)
    fl = pool.flags.astype(jnp.int32)
    free = pool.free_P.astype(jnp.int32)
    n = jnp.asarray(num_tokens).astype(jnp.int32).reshape(())
    rows = _ceil_div(n, tokens_per_row)
    need = _ceil_div(rows, s)
    head, tail = st[State.HEAD], st[State.TAIL]
    was_over = fl[Flag.OVERFLOW] != 0
    in_budget = (n >= 0) & (n <= r_static * tokens_per_row)
    ok = ~was_over & in_budget & (need <= tail - head)
    stamp = st[STAMP]
    whose = jnp.stack([stamp, st[POOL_ID], st[GENERATION]])  # the record's owner: see pop

    slot_M = jnp.arange(m, dtype=jnp.int32)
    take_M = ok & (slot_M < need)
    pages_M = jnp.where(take_M, free[(head + slot_M) % p], -1)
    # Row r of src goes to row r % S of page pages_M[r // S]; rows not copied point past the
    # pool (n_pool) and are dropped, so the pool's other rows keep their bytes.
    r_R = jnp.arange(r_static, dtype=jnp.int32)
    dest_R = jnp.where(ok & (r_R < rows), pages_M[r_R // s] * s + r_R % s, n_pool)
    # In the pool's own dtype, not as bits: a bitcast to integers made XLA copy the whole pool
    # (a pool-sized temporary) instead of scattering into it in place. Rows still move as bits:
    # a scatter, gather or select computes nothing (see the module docstring for bfloat16).
    pool_NH = pool.pool_NH.at[dest_R].set(src_RH, mode="drop", unique_indices=True)
    owner = pool.owner_P.at[jnp.where(take_M, pages_M, p)].set(stamp.astype(book), mode="drop")

    new_head = head + jnp.where(ok, need, 0)
    st = st.at[State.HEAD].set(new_head)
    st = st.at[State.HWM].max(p - (tail - new_head))
    st = st.at[State.ROWS_STASHED].add(jnp.where(ok, rows, 0))
    st = st.at[STAMP].add(1)
    # What the step asks of the pool, stored or not (the torch kernels' DEMANDED/DEMAND_HWM).
    asked = jnp.where(in_budget, need, 0)
    st = st.at[State.DEMANDED].add(asked)
    st = st.at[State.DEMAND_HWM].max(st[State.DEMANDED] - st[State.RETURNED])
    fl = fl.at[Flag.OVERFLOW].add((~was_over & in_budget & ~ok).astype(jnp.int32))
    fl = fl.at[Flag.INVALID].add((~was_over & ~in_budget).astype(jnp.int32))
    meta = jnp.zeros((META_LEN,), jnp.int32)
    meta = meta.at[Meta.NEED].set(asked)
    meta = meta.at[Meta.ROWS].set(jnp.where(ok, rows, 0))
    meta = meta.at[Meta.TIER].set(jnp.where(ok, int(Tier.DEVICE), int(Tier.NONE)))
    new = PagedPool(pool_NH, pool.free_P, owner, st.astype(book), fl.astype(book))
    return new, StashRecord(pages_M, meta, whose)


def pop(pool: PagedPool, record: StashRecord, rows: int) -> tuple[PagedPool, jax.Array]:
    """The record's rows, as a ``[rows, H]`` array zero past the stored ones, and the pool with
    its pages returned to the free list (in the record's page order, at the tail).

    ``rows`` is the static buffer's row count (the ``R`` of the :func:`stash`). After an
    overflow the pool is left as it is and the result is all zeros; a record whose pages it no
    longer owns (a second pop) counts ``flags[INVALID]`` and reads and frees nothing.
    """
    p, s = pool.num_pages, pool.page_size
    m = record.pages_M.shape[0]
    if m != -(-rows // s):
        raise ValueError(
            f"the record has {m} page slots; a buffer of {rows} rows in pages of {s} has "
            f"{-(-rows // s)}: pop with the row count it was stashed with"
        )
    book = pool.state.dtype
    st = pool.state.astype(jnp.int32)
    fl = pool.flags.astype(jnp.int32)
    owner = pool.owner_P.astype(jnp.int32)
    stored_rows = record.meta[Meta.ROWS]
    need = _ceil_div(stored_rows, s)
    stored = record.meta[Meta.TIER] == int(Tier.DEVICE)
    slot_M = jnp.arange(m, dtype=jnp.int32)
    used_M = slot_M < need
    page_M = jnp.clip(record.pages_M, 0, p - 1)
    stamp = record.stamp.reshape(-1)
    if stamp.shape != (3,):
        raise TypeError("record is not a StashRecord of this te_paged.jax (stamp of 3 ints)")
    # This pool and this generation (not popped after reset_pool, nor from another pool), and
    # no more rows than the buffer it pops into holds: else INVALID, nothing read or freed.
    mine = (stamp[1] == st[POOL_ID]) & (stamp[2] == st[GENERATION]) & (stored_rows <= rows)
    owned = jnp.all(jnp.where(used_M, owner[page_M] == stamp[0], True))
    ok = (fl[Flag.OVERFLOW] == 0) & stored & owned & mine

    r_R = jnp.arange(rows, dtype=jnp.int32)
    valid_R = ok & (r_R < stored_rows)
    src_R = jnp.where(valid_R, page_M[r_R // s] * s + r_R % s, 0)
    dst_RH = jnp.where(valid_R[:, None], pool.pool_NH[src_R], jnp.zeros((), pool.pool_NH.dtype))

    back_M = ok & used_M
    tail = st[State.TAIL]
    free = pool.free_P.at[jnp.where(back_M, (tail + slot_M) % p, p)].set(
        record.pages_M.astype(book), mode="drop"
    )
    owner_P = pool.owner_P.at[jnp.where(back_M, page_M, p)].set(-1, mode="drop")
    st = st.at[State.TAIL].add(jnp.where(ok, need, 0))
    # The demand comes back, stored or not; a stored record whose pages it no longer owns (a
    # second pop) gives back nothing. (A record is immutable here, so a second pop of one that
    # was never stored returns its demand again: the figure only over-states the peak then.)
    st = st.at[State.RETURNED].add(jnp.where(mine & (~stored | owned), record.meta[Meta.NEED], 0))
    fl = fl.at[Flag.INVALID].add(((stored & ~owned) | ~mine).astype(jnp.int32))
    return PagedPool(pool.pool_NH, free, owner_P, st.astype(book), fl.astype(book)), dst_RH
