"""Random interleavings of stash and pop across many microbatches in flight, as pipeline
schedules produce them (forwards of later microbatches while earlier ones pop in backward, in
any order): pages are never shared by two live tensors, every pop returns its bytes exactly,
and the pool's high-water mark equals the model's peak of live pages."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from te_paged.kernels import State, stash_copy, stash_pop
from te_paged.kernels.layout import FLAGS_LEN, META_LEN, Meta, Tier
from te_paged.stash import PagedStashBuffer, StashKey

PAGE, H, MAX_ROWS, POOL_PAGES = 4, 8, 24, 40


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(0, MAX_ROWS), st.integers(0, 10**6)),
        min_size=1,
        max_size=60,
    )
)
def test_interleaved_microbatches_never_share_pages(ops) -> None:
    buf = PagedStashBuffer(StashKey(torch.float32, H), POOL_PAGES, PAGE, "cpu")
    flags = torch.zeros(FLAGS_LEN, dtype=torch.int64)
    live: dict[int, tuple] = {}  # record id -> (source rows, pages, meta, rows)
    model_pages, model_peak, next_id = 0, 0, 0
    for is_stash, rows, pick in ops:
        if is_stash or not live:
            src = torch.randn(MAX_ROWS, H, generator=torch.Generator().manual_seed(next_id))
            pages = torch.full((-(-MAX_ROWS // PAGE),), -1, dtype=torch.int32)
            meta = torch.zeros(META_LEN, dtype=torch.int64)
            n = torch.tensor([rows])
            stash_copy("torch", src.view(torch.int32), n, 1, PAGE, *buf.kernel_args(), flags,
                       pages, meta)  # fmt: skip
            need = -(-rows // PAGE)
            if model_pages + need > POOL_PAGES:  # the pool is full: flagged, nothing stored
                assert flags[0] > 0 and int(meta[Meta.TIER]) == Tier.NONE
                return  # a real step reruns from here
            model_pages += need
            model_peak = max(model_peak, model_pages)
            live[next_id] = (src, pages[:need].clone(), meta, rows)
            next_id += 1
        else:
            rid = sorted(live)[pick % len(live)]  # any live record: pops come in any order
            src, pages, meta, rows = live.pop(rid)
            full = torch.full((-(-MAX_ROWS // PAGE),), -1, dtype=torch.int32)
            full[: len(pages)] = pages
            dst = torch.full((MAX_ROWS, H), 7.0)
            stash_pop("torch", dst.view(torch.int32), PAGE, *buf.kernel_args(), flags, full,
                      meta, True)  # fmt: skip
            assert torch.equal(dst[:rows], src[:rows]) and not dst[rows:].any()
            model_pages -= len(pages)
        # No page is held by two live records, and the free list holds the rest.
        held = [int(p) for _, pages, _, _ in live.values() for p in pages]
        assert len(held) == len(set(held)) == model_pages
        state = buf.state.tolist()
        assert state[State.TAIL] - state[State.HEAD] == POOL_PAGES - model_pages
        assert state[State.HWM] == model_peak
    assert not flags.any()
