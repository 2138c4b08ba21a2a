"""The free lists ``te-paged bench`` times the stash from (te_paged.tools.free_lists): each is
what its workload leaves, and a stash started from it takes exactly the prepared pages."""

from __future__ import annotations

import pytest
import torch

from te_paged.kernels import FLAGS_LEN, META_LEN, STATE_LEN, State
from te_paged.kernels.reference import torch_stash_copy, torch_stash_pop
from te_paged.tools.free_lists import FreeList, page_runs, prepare_free_list


def test_page_runs_counts_runs_of_consecutive_ids() -> None:
    assert page_runs([3, 4, 5, 0, 1]) == 2
    assert page_runs([0, 2, 4]) == 3
    assert page_runs([7]) == 1


def test_fresh_is_one_run_from_page_zero() -> None:
    p = prepare_free_list(FreeList.FRESH, 300, 64)
    assert p.pages == (0, 1, 2, 3, 4) and p.runs == 1 and p.num_pages == 5


def test_alternating_leaves_no_two_pages_adjacent() -> None:
    p = prepare_free_list(FreeList.ALTERNATING, 640, 64)
    assert p.pages == tuple(range(0, 20, 2)) and p.runs == 10 and p.num_pages == 20


@pytest.mark.parametrize("tokens", [2048, 16384])
def test_the_1f1b_list_is_fragmented_but_not_alternating(tokens) -> None:
    p = prepare_free_list(FreeList.PIPELINE, tokens, 64)
    need = -(-tokens // 64)
    assert len(p.pages) == need == len(set(p.pages)) == p.tail - p.head
    assert 1 < p.runs < need  # pages from several popped tensors, each mostly one run
    # the pool is sized from the schedule's peak: several microbatches' tensors in flight
    assert p.num_pages > 4 * need
    assert prepare_free_list(FreeList.PIPELINE, tokens, 64) == p  # seeded: reproducible


def test_bad_token_count_is_refused() -> None:
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        prepare_free_list(FreeList.FRESH, 0, 64)


@pytest.mark.parametrize("kind", list(FreeList))
def test_a_stash_from_the_prepared_list_takes_exactly_its_pages(kind) -> None:
    tokens, page_size, hidden = 200, 8, 4
    p = prepare_free_list(kind, tokens, page_size)
    pool = torch.zeros(p.num_pages * page_size, hidden, dtype=torch.int16)
    state = torch.zeros(STATE_LEN, dtype=torch.int64)
    state[State.HEAD], state[State.TAIL] = p.head, p.tail
    free = torch.tensor(p.free_P, dtype=torch.int32)
    host = (torch.empty(0, hidden, dtype=torch.int16), torch.empty(0, dtype=torch.int32))
    flags = torch.zeros(FLAGS_LEN, dtype=torch.int64)
    rec = torch.empty(-(-tokens // page_size), dtype=torch.int32)
    meta = torch.empty(META_LEN, dtype=torch.int64)
    src = torch.arange(tokens * hidden, dtype=torch.int16).view(tokens, hidden)
    args = (pool, free, *host, state)
    torch_stash_copy(src, torch.tensor([tokens]), 1, page_size, *args, flags, rec, meta)
    assert tuple(rec.tolist()) == p.pages and not flags.any()
    for slot, page in enumerate(p.pages):  # row block `slot` sits in page `page`
        rows = src[slot * page_size : (slot + 1) * page_size]
        assert torch.equal(pool[page * page_size : page * page_size + len(rows)], rows)
    dst = torch.zeros_like(src)
    torch_stash_pop(dst, page_size, *args, flags, rec, meta, True)
    assert torch.equal(dst, src)
