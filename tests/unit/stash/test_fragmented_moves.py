"""The reference's fragmented-pool path: a page list of more than ``_MAX_RUN_COPIES`` runs moves
its whole pages with one indexed op each way (``reference._move_pages``). It must leave every
tensor byte-identical to the one ``copy_`` per run it replaces, on any free list.

Each sequence runs twice on identical pools: once as before (``_MAX_RUN_COPIES`` huge: slices
only) and once with the indexed path for every list of two runs or more (``_MAX_RUN_COPIES`` =
0); pools, free lists, counters, flags, records and popped rows are compared after every op.
"""

from __future__ import annotations

import itertools
import random
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from te_paged.kernels import native, reference
from te_paged.stash import PagedStashBuffer, StashKey, storage_dtype

from .conftest import KernelHarness, random_bits

SLICES_ONLY, INDEXED = 2**62, 0

# (dtype, hidden) pairs whose rows are a multiple of 16, 8, 4, 2 and 1 bytes: every copy dtype.
_WIDTHS = {
    torch.complex128: (torch.bfloat16, 8),
    torch.int64: (torch.float8_e4m3fn, 8),
    torch.int32: (torch.float32, 3),
    torch.int16: (torch.bfloat16, 3),
    torch.uint8: (torch.float8_e5m2, 3),
}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (NaN payloads included), for any strides: a trailing dim of one element
    has stride 1, so every tensor views as bytes."""
    return a.dtype == b.dtype and torch.equal(
        a.unsqueeze(-1).view(torch.uint8), b.unsqueeze(-1).view(torch.uint8)
    )


def _spy():
    """Counts :func:`reference._move_pages` calls (the indexed path), passing them through."""
    return mock.patch.object(reference, "_move_pages", wraps=reference._move_pages)


def _run(ops, *, dtype, hidden, page_size, pages, host_pages, limit, strided=False, native=True):
    """Apply ``ops`` — ``("stash", max_rows, tokens, tokens_per_row, seed)`` or ``("pop",
    index, zero_padding)`` — with ``_MAX_RUN_COPIES = limit`` and the compiled page mover on or
    off; return every tensor after each op (records, popped rows, then the pool's and the
    flags)."""
    old = reference._MAX_RUN_COPIES, reference._NATIVE
    # Slices only: the torch path (the compiled mover takes every list in one call).
    reference._MAX_RUN_COPIES, reference._NATIVE = limit, native and limit != SLICES_ONLY
    try:
        buf = PagedStashBuffer(StashKey(dtype, hidden), pages, page_size, "cpu", host_pages)
        h = KernelHarness(buf, strided=strided)
        live, states = [], []
        for op in ops:
            out = None
            if op[0] == "stash":
                _, max_rows, tokens, per_row, seed = op
                x = random_bits(max_rows, hidden, dtype, seed)
                live.append((h.stash(x, tokens, per_row), x))
            elif live:
                record, x = live.pop(op[1] % len(live))
                out = h.pop(record, x, zero_padding=op[2])
            snapshot = [t.clone() for t in (*buf.kernel_args(), h.flags)]
            snapshot += [t.clone() for (pages_M, meta), _ in live for t in (pages_M, meta)]
            states.append((snapshot, out))
        return states
    finally:
        reference._MAX_RUN_COPIES, reference._NATIVE = old


def _assert_same_states(a, b) -> None:
    for step, ((sa, oa), (sb, ob)) in enumerate(zip(a, b, strict=True)):
        assert len(sa) == len(sb)
        for i, (ta, tb) in enumerate(zip(sa, sb)):
            assert _bits_equal(ta, tb), (step, i)
        assert (oa is None) == (ob is None), step
        if oa is not None:
            assert _bits_equal(oa, ob), step


@st.composite
def _sequences(draw):
    """A pool fragmented by one-page tensors popped in a random order, then random stashes (up
    to the pool's size, tails and MXFP8 scale rows included) and pops in any order."""
    dtype, hidden = draw(st.sampled_from([*_WIDTHS.values(), (torch.bfloat16, 16)]))
    page_size = draw(st.integers(1, 5))
    pages = draw(st.integers(4, 24))
    host_pages = draw(st.sampled_from([0, 0, 6]))
    small = draw(st.sampled_from([pages, pages, pages // 2]))  # all: no fresh page stays queued
    ops = [("stash", page_size, page_size, 1, i) for i in range(small)]
    freed = draw(st.lists(st.integers(0, 23), min_size=small // 2, max_size=small))
    ops += [("pop", i, draw(st.booleans())) for i in freed]
    for _ in range(draw(st.integers(1, 16))):
        if draw(st.booleans()):
            ops.append(("pop", draw(st.integers(0, 29)), draw(st.booleans())))
        else:
            per_row = draw(st.sampled_from([1, 1, 1, 32]))
            max_rows = draw(st.integers(1, pages * page_size // 2 + 2))  # rarely overflows
            tokens = draw(st.integers(0, max_rows * per_row))
            ops.append(("stash", max_rows, tokens, per_row, draw(st.integers(0, 2**16))))
    return dict(dtype=dtype, hidden=hidden, page_size=page_size, pages=pages,
                host_pages=host_pages), ops  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_sequences())
def test_random_fragmented_sequences_match_slice_copies(case) -> None:
    shape, ops = case
    with _spy() as spy:
        before = _run(ops, **shape, limit=SLICES_ONLY)
        assert spy.call_count == 0
        by_torch = _run(ops, **shape, limit=INDEXED, native=False)
        by_mover = _run(ops, **shape, limit=INDEXED)  # the compiled mover, where it builds
    event(f"indexed moves: {'some' if spy.call_count else 'none'}")
    _assert_same_states(before, by_torch)
    _assert_same_states(before, by_mover)


def _alternating(page_size: int, pages: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """Stash ``pages`` one-page tensors, pop every other one: the free list alternates."""
    ops = [("stash", page_size, page_size, 1, seed + i) for i in range(pages)]
    ops += [("pop", i, True) for i in range(0, pages // 2)]  # live: 0 1 2 ... -> pops 0, 2, 4
    return ops


@pytest.mark.parametrize("copy_dtype", list(_WIDTHS))
def test_every_copy_dtype_round_trips_on_an_alternating_pool(copy_dtype) -> None:
    dtype, hidden = _WIDTHS[copy_dtype]
    pool = torch.empty(8, hidden, dtype=storage_dtype(dtype))
    assert reference._copy_dtype(pool, pool[:2]) == copy_dtype
    # 12 pages of 3 rows: every other one freed, then 5 pages' worth + a 2-row tail (17 rows)
    # scattered over pages 0, 2, 4, 6, 8, 10 and popped back, zeroing 1 padding row.
    ops = _alternating(3, 12, hidden, dtype)
    ops += [("stash", 18, 17, 1, 99), ("pop", 6, True), ("stash", 18, 18, 1, 7), ("pop", 6, False)]
    shape = dict(dtype=dtype, hidden=hidden, page_size=3, pages=12, host_pages=0)
    with _spy() as spy:
        before = _run(ops, **shape, limit=SLICES_ONLY)
        after = _run(ops, **shape, limit=INDEXED, native=False)
    assert spy.call_count == 4  # the two 6-run stashes and their pops
    _assert_same_states(before, after)
    _assert_same_states(before, _run(ops, **shape, limit=INDEXED))


@pytest.mark.parametrize("use_mover", [True, False], ids=["mover", "torch"])
def test_the_alternating_pages_and_the_rows_they_hold(make_harness, monkeypatch, use_mover):
    # 12 pages of 2 rows, pages 1 3 5 ... 11 held: an 11-row tensor takes pages 0 2 4 6 8 10
    # (six runs, the last page half full) and its rows land there, page by page.
    monkeypatch.setattr(reference, "_NATIVE", use_mover)
    h = make_harness(dtype=torch.float32, hidden=4, pages=12, page_size=2)
    ones = [h.stash(torch.randn(2, 4), 2) for _ in range(12)]
    for record in ones[::2]:
        h.pop(record, torch.randn(2, 4))
    x = torch.randn(12, 4)
    with _spy() as spy:
        record = h.stash(x, 11)
    assert spy.call_count == (not use_mover or native.page_mover() is None)
    pages = [0, 2, 4, 6, 8, 10]
    assert record[0][:6].tolist() == pages
    pool = h.buffer.pool_NH.view(torch.float32)
    for slot, page in enumerate(pages):
        rows = min(2, 11 - 2 * slot)
        assert torch.equal(pool[2 * page : 2 * page + rows], x[2 * slot : 2 * slot + rows])
    pool[2 * 10 + 1] = 7.0  # past the tensor's rows: a pop must not read it
    out = h.pop(record, x)
    assert torch.equal(out[:11], x[:11]) and not out[11:].any()


def test_nan_payloads_survive_the_complex128_view() -> None:
    # Signalling and quiet NaNs with payloads, infinities and -0 in float32 rows of 4: each
    # complex128 element the indexed ops move carries two of them.
    specials = torch.tensor([0x7FA00001, 0x7FC00123, 0xFF800001, 0x7F800000, 0x80000000],
                            dtype=torch.int64).to(torch.int32)  # fmt: skip
    x = specials[torch.arange(40) % 5].view(10, 4).view(torch.float32)
    pool = torch.zeros(24, 4, dtype=torch.int32)
    assert reference._copy_dtype(pool, x.view(torch.int32)) == torch.complex128
    buf = PagedStashBuffer(StashKey(torch.float32, 4), 12, 2, "cpu")
    h = KernelHarness(buf)
    held = [h.stash(torch.randn(2, 4), 2) for _ in range(12)]
    for record in held[::2]:
        h.pop(record, torch.randn(2, 4))
    record = h.stash(x, 10)  # pages 0 2 4 6 8: five runs, the indexed path
    assert record[0][:5].tolist() == [0, 2, 4, 6, 8]
    assert _bits_equal(h.pop(record, x), x)


@pytest.mark.parametrize("use_mover", [True, False], ids=["mover", "torch"])
def test_misaligned_or_strided_buffers_fall_back(monkeypatch, use_mover) -> None:
    monkeypatch.setattr(reference, "_NATIVE", use_mover)
    # A buffer two bytes off a 16-byte boundary moves as int16 rows; a strided one as slices.
    flat = torch.zeros(1 + 6 * 8, dtype=torch.int16)
    shifted = flat[1:].view(6, 8)
    pool = torch.zeros(12, 8, dtype=torch.int16)
    assert reference._copy_dtype(pool, shifted) == torch.int16
    strided = torch.zeros(6, 16, dtype=torch.int16)[:, ::2]
    assert reference._copy_dtype(pool, strided) is None
    assert reference._copy_dtype(pool, shifted.to(torch.int32)) is None  # dtypes differ
    for buf_RH in (shifted, strided):
        ref = buf_RH.clone()
        ref.copy_(torch.arange(48, dtype=torch.int16).view(6, 8))
        buf_RH.copy_(ref)
        for limit in (SLICES_ONLY, INDEXED):
            monkeypatch.setattr(reference, "_MAX_RUN_COPIES", limit)
            pool.zero_()
            reference._move_rows(5, 2, [4, 1, 3], torch.tensor([4, 1, 3], dtype=torch.int32),
                                 pool, buf_RH, to_pool=True)  # fmt: skip
            assert torch.equal(pool[8:10], ref[0:2]) and torch.equal(pool[2:4], ref[2:4])
            assert torch.equal(pool[6:7], ref[4:5]) and not pool[7].any()
            buf_RH.zero_()
            reference._move_rows(5, 2, [4, 1, 3], torch.tensor([4, 1, 3], dtype=torch.int32),
                                 pool, buf_RH, to_pool=False)  # fmt: skip
            assert torch.equal(buf_RH[:5], ref[:5]) and not buf_RH[5].any()
            buf_RH.copy_(ref)


def test_gather_by_index_when_a_page_is_over_the_memcpy_grain(monkeypatch) -> None:
    # Pages of more than _MEMCPY_SLICE_ELEMS elements come back through aten.index rather than
    # index_select: shrink the grain so that a tiny pool takes that branch.
    monkeypatch.setattr(reference, "_MEMCPY_SLICE_ELEMS", 2)
    shape = dict(dtype=torch.bfloat16, hidden=8, page_size=2, pages=12, host_pages=0)
    ops = [*_alternating(2, 12, 8, torch.bfloat16), ("stash", 11, 11, 1, 5), ("pop", 6, True)]
    _assert_same_states(_run(ops, **shape, limit=SLICES_ONLY),
                        _run(ops, **shape, limit=INDEXED, native=False))  # fmt: skip


def test_deterministic_mode_and_strided_bookkeeping_agree() -> None:
    # index_put_ takes another path under torch.use_deterministic_algorithms; bookkeeping kept
    # in host lists (strided tensors) hands the moves the same pages.
    rng = random.Random(3)
    shape = dict(dtype=torch.bfloat16, hidden=16, page_size=2, pages=16, host_pages=4)
    ops = _alternating(2, 16, 16, torch.bfloat16)
    for i in range(12):
        ops.append(("stash", 9, rng.randint(0, 9), 1, i) if i % 3 else ("pop", rng.randint(0, 9),
                    bool(i % 2)))  # fmt: skip
    before = _run(ops, **shape, limit=SLICES_ONLY)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _assert_same_states(before, _run(ops, **shape, limit=INDEXED, native=False))
    finally:
        torch.use_deterministic_algorithms(was)
    # Strided records: the compiled mover gets the page ids as a host array instead.
    _assert_same_states(before, _run(ops, **shape, limit=INDEXED, strided=True))
    _assert_same_states(before, _run(ops, **shape, limit=INDEXED, strided=True, native=False))


@settings(max_examples=200, deadline=None)
@given(pages=st.lists(st.integers(0, 40), unique=True, max_size=24),
       limit=st.none() | st.integers(0, 6))  # fmt: skip
def test_page_runs_split_a_list_into_maximal_runs(pages, limit) -> None:
    runs = reference._page_runs(pages)
    assert [p for _, first, n in runs for p in range(first, first + n)] == pages
    assert [slot for slot, _, _ in runs] == [sum(n for *_, n in runs[:i]) for i in range(len(runs))]
    # Maximal runs: none continues the one before it.
    assert all(a[1] + a[2] != b[1] for a, b in itertools.pairwise(runs))
    limited = reference._page_runs(pages, limit=limit)
    # One run is one copy whatever the limit (limit 0: every list of two runs or more is None).
    assert limited == (None if limit is not None and len(runs) > max(limit, 1) else runs)


def test_the_compiled_mover_moves_every_stash_and_pop_on_cpu(monkeypatch) -> None:
    # Where a C compiler is found the mover builds, and each stash and pop goes through it in
    # one call, tail included (the comparisons above would pass with it never called).
    status = native.page_mover_status()
    assert status.available == (native._compiler() is not None), status.reason
    if not status.available:
        return  # no compiler here: the torch ops moved every page in the tests above
    calls = []
    mover = native.page_mover()
    monkeypatch.setattr(native, "page_mover", lambda: lambda *a: (calls.append(a), mover(*a)))
    shape = dict(dtype=torch.bfloat16, hidden=8, page_size=2, pages=12, host_pages=0)
    ops = [*_alternating(2, 12, 8, torch.bfloat16), ("stash", 11, 11, 1, 5), ("pop", 6, True)]
    after = _run(ops, **shape, limit=INDEXED)
    # 12 one-page stashes and 6 pops, then 5 whole pages + 1 of 2 rows (of 16 bytes) each way.
    assert [(a[3], a[5], a[6]) for a in calls[18:]] == [(5, 16, True), (5, 16, False)]
    assert len(calls) == 20 and all(a[3:6] == (1, 32, 0) for a in calls[:18])
    _assert_same_states(_run(ops, **shape, limit=SLICES_ONLY), after)
