"""The torch reference kernels: bit-exact round trips, tiers, overflow and the free list."""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from te_paged.kernels import Flag, State, Tier
from te_paged.stash import PagedStashBuffer, StashKey, storage_dtype

from .conftest import KernelHarness, random_bits

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(storage_dtype(a.dtype)), b.view(storage_dtype(b.dtype)))


@st.composite
def roundtrip_case(draw):
    page_size = draw(st.integers(1, 9))
    rows = draw(st.integers(1, 70))
    hidden = draw(st.integers(1, 12))
    dtype = draw(st.sampled_from(DTYPES))
    full_pages = (rows // page_size) * page_size
    n = draw(
        st.sampled_from(
            sorted({0, rows, full_pages, min(rows, page_size + 1), min(rows, page_size)})
        )
        | st.integers(0, rows)
    )
    spare = draw(st.integers(0, 3))
    return page_size, rows, hidden, dtype, n, spare


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=roundtrip_case(), seed=st.integers(0, 2**16))
def test_roundtrip_is_bit_exact(case, seed) -> None:
    page_size, rows, hidden, dtype, n, spare = case
    pages = -(-rows // page_size) + spare
    h = KernelHarness(PagedStashBuffer(StashKey(dtype, hidden), pages, page_size, "cpu"))
    x = random_bits(rows, hidden, dtype, seed)
    record = h.stash(x, n)
    assert h.tier(record) is Tier.DEVICE
    assert int(h.buffer.state[State.HEAD]) == -(-n // page_size)
    out = h.pop(record, x)
    assert bits_equal(out[:n], x[:n])
    assert not out.view(storage_dtype(dtype))[n:].any()  # padding zeroed
    assert int(h.buffer.state[State.TAIL]) - int(h.buffer.state[State.HEAD]) == pages
    assert h.flags.tolist() == [0, 0, 0]


def test_pop_without_zero_padding_leaves_padding_alone(make_harness) -> None:
    h = make_harness()
    x = torch.randn(6, 4)
    out = h.pop(h.stash(x, 3), x, zero_padding=False)
    assert torch.equal(out[:3], x[:3])
    assert torch.equal(out[3:].view(torch.int32), torch.full((3, 4), 7, dtype=torch.int32))


def test_scale_rows_use_one_row_per_32_tokens(make_harness) -> None:
    h = make_harness(hidden=4, pages=4, page_size=2)
    s = torch.randn(4, 4)  # max 128 tokens -> 4 scale rows
    record = h.stash(s, 65, tokens_per_row=32)  # ceil(65 / 32) = 3 rows -> 2 pages
    assert int(record[1][0]) == 3 and int(h.buffer.state[State.HEAD]) == 2
    out = h.pop(record, s)
    assert torch.equal(out[:3], s[:3]) and not out[3:].any()


def test_device_full_spills_to_host_then_overflows(make_harness) -> None:
    h = make_harness(pages=2, page_size=2, host_pages=2)
    a, b, c = (torch.randn(4, 4) for _ in range(3))
    ra, rb = h.stash(a, 4), h.stash(b, 3)
    assert h.tier(ra) is Tier.DEVICE and h.tier(rb) is Tier.HOST
    assert h.flags[Flag.HOST_SPILL] == 1 and h.buffer.state[State.SPILLED] == 1
    before = [t.clone() for t in h.buffer.kernel_args()]
    rc = h.stash(c, 1)
    assert h.tier(rc) is Tier.NONE and h.flags[Flag.OVERFLOW] == 1
    # Nothing stored, nothing moved: only the demand counters saw its 1 page.
    before[-1][[State.DEMANDED, State.DEMAND_HWM]] += 1
    assert all(torch.equal(p, q) for p, q in zip(before, h.buffer.kernel_args()))


def test_whole_tensor_goes_to_one_tier(make_harness) -> None:
    # 1 device page free but the tensor needs 2: it goes whole to the host, never split.
    h = make_harness(pages=1, page_size=2, host_pages=4)
    x = torch.randn(4, 4)
    rec = h.stash(x, 3)
    assert h.tier(rec) is Tier.HOST and int(h.buffer.state[State.HEAD]) == 0
    assert torch.equal(h.pop(rec, x)[:3], x[:3])
    assert int(h.buffer.state[State.HOST_TAIL]) - int(h.buffer.state[State.HOST_HEAD]) == 4


def test_after_overflow_copies_and_pops_are_noops(make_harness) -> None:
    h = make_harness(pages=2, page_size=2)
    a = torch.randn(4, 4)
    ra = h.stash(a, 4)
    h.stash(a, 1)  # no room: overflow
    assert h.flags[Flag.OVERFLOW] == 1
    demand = [State.DEMANDED, State.RETURNED, State.DEMAND_HWM]  # these go on counting

    def pool_state() -> torch.Tensor:
        state = h.buffer.state.clone()
        state[demand] = 0
        return state

    state = pool_state()
    rd = h.stash(a, 1)
    assert h.tier(rd) is Tier.NONE and torch.equal(state, pool_state())
    out = h.pop(ra, a)
    assert not out.any()  # nothing read: all padding
    assert torch.equal(state, pool_state())  # pages not returned either
    assert h.buffer.state[demand].tolist() == [4, 2, 4]  # 2 + 1 + 1 asked, A's 2 returned


def test_more_tokens_than_the_static_buffer_is_invalid(make_harness) -> None:
    h = make_harness(pages=8, page_size=2)
    x = torch.randn(4, 4)
    rec = h.stash(x, 5)
    assert h.tier(rec) is Tier.NONE and h.flags[Flag.INVALID] == 1
    assert h.flags[Flag.OVERFLOW] == 0
    assert int(h.buffer.state[State.HEAD]) == 0


def test_out_of_order_pops_recycle_pages(make_harness) -> None:
    # The worked example of kernels/layout.py: 4 pages of 2 rows.
    h = make_harness(pages=4, page_size=2)
    a, b, c = (torch.randn(4, 4) for _ in range(3))
    ra, rb = h.stash(a, 3), h.stash(b, 1)
    assert ra[0].tolist() == [0, 1] and rb[0][:1].tolist() == [2]
    assert torch.equal(h.pop(ra, a)[:3], a[:3])  # pop A before B
    assert h.buffer.free_P.tolist() == [0, 1, 2, 3]
    assert h.buffer.state[State.HEAD] == 3 and h.buffer.state[State.TAIL] == 6
    rc = h.stash(c, 3)  # takes queue slots 3 and 4 -> pages 3 then 0
    assert rc[0].tolist() == [3, 0]
    assert torch.equal(h.pop(rc, c)[:3], c[:3]) and torch.equal(h.pop(rb, b)[:1], b[:1])
    state = h.buffer.state
    assert int(state[State.TAIL]) - int(state[State.HEAD]) == 4
    assert sorted(h.buffer.free_P.tolist()) == [0, 1, 2, 3]
    assert int(state[State.HWM]) == 3  # A+B, then B+C


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    order=st.randoms(use_true_random=False),
)
def test_any_pop_order_returns_every_page(sizes, order) -> None:
    h = KernelHarness(PagedStashBuffer(StashKey(torch.bfloat16, 3), 40, 2, "cpu"))
    xs = [random_bits(9, 3, torch.bfloat16, i) for i in range(len(sizes))]
    records = [h.stash(x, n) for x, n in zip(xs, sizes)]
    idx = list(range(len(sizes)))
    order.shuffle(idx)
    for i in idx:
        assert bits_equal(h.pop(records[i], xs[i])[: sizes[i]], xs[i][: sizes[i]])
    state = h.buffer.state
    assert int(state[State.TAIL]) - int(state[State.HEAD]) == 40
    assert sorted(h.buffer.free_P.tolist()) == list(range(40))


def test_reset_restores_the_initial_state_in_place(make_harness) -> None:
    h = make_harness(pages=3, page_size=2, host_pages=1)
    ptrs = [t.data_ptr() for t in h.buffer.kernel_args()]
    h.stash(torch.randn(6, 4), 6)
    h.stash(torch.randn(6, 4), 2)
    h.buffer.reset()
    assert h.buffer.free_P.tolist() == [0, 1, 2]
    assert h.buffer.state.tolist()[: State.HOST_HWM + 1] == [0, 3, 0, 0, 1, 0]
    assert [t.data_ptr() for t in h.buffer.kernel_args()] == ptrs


def test_large_fragmented_pool_round_trips() -> None:
    # The reference alone at a realistic size: 4096 static rows of 512 bf16, page size 64,
    # with pops out of order so later stashes get scattered pages.
    h = KernelHarness(PagedStashBuffer(StashKey(torch.bfloat16, 512), 110, 64, "cpu"))
    xs = [random_bits(4096, 512, torch.bfloat16, seed) for seed in range(3)]
    counts = [3000, 2500, 4096]
    recs = [h.stash(x, n) for x, n in zip(xs[:2], counts[:2])]
    assert bits_equal(h.pop(recs[0], xs[0])[:3000], xs[0][:3000])
    rec = h.stash(xs[2], counts[2])  # reuses A's pages after B's: not one contiguous run
    pages = rec[0].tolist()
    assert any(b != a + 1 for a, b in itertools.pairwise(pages))
    assert bits_equal(h.pop(rec, xs[2]), xs[2])
    assert bits_equal(h.pop(recs[1], xs[1])[:2500], xs[1][:2500])
    assert int(h.buffer.state[State.TAIL]) - int(h.buffer.state[State.HEAD]) == 110


def test_scale_rows_budget_is_rows_times_32_tokens(make_harness) -> None:
    # A scale-inverse of R rows covers 32·R tokens: that is its static budget in tokens.
    h = make_harness(hidden=4, pages=8, page_size=2)
    rec = h.stash(torch.randn(5, 4), 129, tokens_per_row=32)  # 5 rows x 32 = 160 >= 129: fits
    assert h.tier(rec) is Tier.DEVICE
    rec = h.stash(torch.randn(4, 4), 129, tokens_per_row=32)  # 4 rows x 32 = 128 < 129
    assert h.tier(rec) is Tier.NONE and h.flags[Flag.INVALID] == 1


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(0, 7)), max_size=14),
)
def test_in_place_and_written_back_bookkeeping_agree(ops) -> None:
    # On CPU the kernels update contiguous bookkeeping tensors in place; anything else goes
    # through a host copy and a write-back. Both must leave every tensor in the same state,
    # through spills to the host tier and overflows.
    harnesses = [
        KernelHarness(PagedStashBuffer(StashKey(torch.bfloat16, 3), 5, 2, "cpu", 2), strided)
        for strided in (False, True)
    ]
    assert not harnesses[1].buffer.state.is_contiguous()
    x = random_bits(9, 3, torch.bfloat16, 0)
    live: list[list] = [[], []]
    for is_pop, n, pick in ops:
        for h, recs in zip(harnesses, live):
            if is_pop and recs:
                out = h.pop(recs.pop(pick % len(recs)), x)
                recs.append(out)  # outputs are compared below, then dropped
            elif not is_pop:
                recs.append(h.stash(x, n))
        if is_pop and live[0]:
            assert bits_equal(live[0].pop(), live[1].pop())
        a, b = (h.buffer for h in harnesses)
        for t, u in zip(
            (*a.kernel_args(), harnesses[0].flags), (*b.kernel_args(), harnesses[1].flags)
        ):
            assert torch.equal(t, u)
        for (pa, ma), (pb, mb) in zip(*live):
            assert torch.equal(pa, pb) and torch.equal(ma, mb)
