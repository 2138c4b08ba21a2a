"""The HybridEP stand-in's contract, and that these tests can tell a wrong stand-in.

The multi-rank behaviour behind real callers (Megatron's dispatcher, torchtitan's) is in
functional_tests (test_megatron_flex.py, test_torchtitan_hybridep.py); here, the layout the
stand-in's docstring states, each part a check function that the real stand-in passes and a
planted wrong one fails (:func:`test_each_check_fails_on_its_planted_wrong_stand_in`), and a
two-rank padded dispatch and combine in bf16, DeepEP's combine dtype.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from functional_tests.stand_ins import deep_ep
from tests.distributed.spawn import run_ranks

# Four tokens, two experts (one rank): token 0 -> e0, e1; token 1 -> e1; token 2 -> e0;
# token 3 -> none. Off-route probabilities are not zero: a read of the wrong column shows.
ROUTING = torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0]], dtype=torch.bool)
PROBS = torch.tensor([[0.25, 0.75], [0.125, 0.5], [1.0, 0.375], [0.0625, 0.03125]])
HIDDEN = torch.arange(12.0).reshape(4, 3)


@pytest.fixture
def group(one_rank_group):
    return one_rank_group


def _dispatch(cls, group, **kw):
    buffer = cls(group, 3, 4, 2)
    out = buffer.dispatch_with_permute(
        hidden=HIDDEN, routing_map=ROUTING, probs=PROBS, num_of_experts_per_rank=2, **kw
    )
    return buffer, out


def check_layout_and_combine(cls, group) -> None:
    buffer, (rows, probs, scale, tokens_per_expert, handle) = _dispatch(
        cls, group, pad_multiple=4, num_permuted_tokens=8, non_blocking=True
    )
    assert scale is None
    assert tokens_per_expert.tolist() == [4, 4]  # 2 and 2 rows, each padded to 4
    # Expert 0: tokens 0, 2, then padding; expert 1: tokens 0, 1, then padding.
    zero = torch.zeros(3)
    want = torch.stack([HIDDEN[0], HIDDEN[2], zero, zero, HIDDEN[0], HIDDEN[1], zero, zero])
    assert torch.equal(rows, want)
    assert probs.tolist() == [0.25, 1.0, 0.0, 0.0, 0.75, 0.5, 0.0, 0.0]
    assert int(handle[-1]) == 0  # no overflow
    combined, none = buffer.combine_with_unpermute(hidden=rows, handle=handle)
    assert none is None
    assert torch.equal(combined, torch.stack([2 * HIDDEN[0], HIDDEN[1], HIDDEN[2], zero]))
    # The backward of dispatch: each row's probability gradient back to its (token, expert),
    # dense, zero where not routed. Distinct per row, so a wrong placement shows.
    grad = torch.tensor([10.0, 20.0, 99.0, 99.0, 30.0, 40.0, 99.0, 99.0])
    _, grad_probs = buffer.combine_with_unpermute(hidden=rows, probs=grad, handle=handle)
    assert grad_probs.tolist() == [[10.0, 30.0], [0.0, 40.0], [20.0, 0.0], [0.0, 0.0]]


def check_tail_dropped_and_flagged(cls, group) -> None:
    _, (rows, _, _, tokens_per_expert, handle) = _dispatch(
        cls, group, num_permuted_tokens=3, non_blocking=True
    )
    assert rows.shape == (3, 3)  # the budget's rows, whatever the routing asked
    assert torch.equal(rows, torch.stack([HIDDEN[0], HIDDEN[2], HIDDEN[0]]))  # token 1 dropped
    assert tokens_per_expert.tolist() == [2, 1]  # what was kept (DeepEP clamps), not asked
    assert int(handle[-1]) == 1


def check_unused_rows_are_unwritten(cls, group) -> None:
    _, (rows, probs, _, tokens_per_expert, handle) = _dispatch(
        cls, group, num_permuted_tokens=6, non_blocking=True
    )
    assert tokens_per_expert.tolist() == [2, 2] and int(handle[-1]) == 0
    assert not rows[:4].isnan().any() and rows[4:].isnan().all()  # garbage, not zeros
    assert probs[4:].isnan().all()


def check_blocking_mode(cls, group) -> None:
    # Without a budget: sized from the routing, the padded demand; the flag is never written.
    _, (rows, _, _, tokens_per_expert, handle) = _dispatch(cls, group, pad_multiple=4)
    assert rows.shape[0] == int(tokens_per_expert.sum()) == 8
    assert int(handle[-1]) not in (0, 1)  # garbage: a caller must not read it
    # A budget below the demand: DeepEP writes past the buffer; the stand-in refuses.
    with pytest.raises(RuntimeError, match="writes past the buffer"):
        _dispatch(cls, group, num_permuted_tokens=3, non_blocking=False)


def check_refusals(cls, group) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        _dispatch(cls, group, pad_multiple=4, num_permuted_tokens=6, non_blocking=True)
    buffer = cls(group, 3, 4, 2)
    call = {"hidden": HIDDEN, "probs": PROBS, "num_of_experts_per_rank": 2}
    with pytest.raises(TypeError, match=r"must be torch\.bool"):
        buffer.dispatch_with_permute(routing_map=ROUTING.long(), **call)
    with pytest.raises(TypeError, match="probs must be float32"):
        buffer.dispatch_with_permute(routing_map=ROUTING, **{**call, "probs": PROBS.double()})
    with pytest.raises(NotImplementedError, match="fused permute"):
        buffer.dispatch_with_permute(routing_map=ROUTING, fuse_permute_dispatch=True, **call)
    with pytest.raises(NotImplementedError, match="routing_map"):
        buffer.dispatch_with_permute(topk_idx=torch.zeros(4, 1, dtype=torch.long), **call)
    with pytest.raises(TypeError):  # anything else unknown: not swallowed
        buffer.dispatch_with_permute(routing_map=ROUTING, use_fp8_dispatch=True, **call)


CHECKS = [check_layout_and_combine, check_tail_dropped_and_flagged,
          check_unused_rows_are_unwritten, check_blocking_mode, check_refusals]  # fmt: skip


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_the_stand_in_keeps_its_contract(group, check) -> None:
    check(deep_ep.HybridEPBuffer, group)


def test_indices_to_map_scatters_as_deepep_and_refuses_what_it_cannot() -> None:
    idx = torch.tensor([[0, 1], [1, 1], [0, 0], [1, 0]])
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 1.0], [0.125, 0.875]])
    routing, probs = deep_ep.indices_to_map(idx, weights, 4, 2)
    assert routing.dtype == torch.bool
    assert routing.tolist() == [[True, True], [False, True], [True, False], [True, True]]
    assert probs.tolist() == [[0.25, 0.75], [0.0, 0.5], [1.0, 0.0], [0.875, 0.125]]
    with pytest.raises(IndexError, match="DeepEP scatters it as is"):
        deep_ep.indices_to_map(torch.tensor([[0, -1]]), torch.ones(1, 2), 1, 2)


# ---------------------------------------------------------------- planted wrong stand-ins


class _GradProbsInForwardOrder(deep_ep.HybridEPBuffer):
    """Hands dispatch's backward the probability gradients in row order, not placed."""

    def combine_with_unpermute(self, *, hidden, probs=None, handle, **kw):
        combined, dense = super().combine_with_unpermute(hidden=hidden, probs=probs,
                                                         handle=handle, **kw)  # fmt: skip
        if dense is not None:
            dense = probs[: dense.numel()].reshape(dense.shape)
        return combined, dense


class _CountsAskedNotKept(deep_ep.HybridEPBuffer):
    """Reports the routing's demand where DeepEP reports the rows kept."""

    def dispatch_with_permute(self, **kw):
        rows, probs, scale, _, handle = super().dispatch_with_permute(**kw)
        return rows, probs, scale, kw["routing_map"].sum(0), handle


class _TruncatesInBlockingMode(deep_ep.HybridEPBuffer):
    """Drops and flags past a budget in blocking mode too (kinder than DeepEP)."""

    def _layout(self, routing_map, local, pad, budget, non_blocking):
        return super()._layout(routing_map, local, pad, budget, budget is not None)


class _SwallowsOptions(deep_ep.HybridEPBuffer):
    """Accepts any keyword and any routing dtype, as the stand-in once did."""

    def dispatch_with_permute(self, *, routing_map=None, probs=None, **kw):
        known = {k: v for k, v in kw.items() if k in ("hidden", "num_of_experts_per_rank",
                                                      "pad_multiple", "num_permuted_tokens",
                                                      "non_blocking", "handle")}  # fmt: skip
        probs = None if probs is None else probs.float()
        routing_map = None if routing_map is None else routing_map.bool()
        return super().dispatch_with_permute(routing_map=routing_map, probs=probs, **known)


class _ZeroPaddingPastTheUsedRows(deep_ep.HybridEPBuffer):
    """Zero-fills the rows past the used ones (DeepEP leaves them unwritten)."""

    def dispatch_with_permute(self, **kw):
        rows, probs, scale, counts, handle = super().dispatch_with_permute(**kw)
        return rows.nan_to_num(0.0), probs, scale, counts, handle


PLANTED = [
    (_GradProbsInForwardOrder, check_layout_and_combine),
    (_CountsAskedNotKept, check_tail_dropped_and_flagged),
    (_ZeroPaddingPastTheUsedRows, check_unused_rows_are_unwritten),
    (_TruncatesInBlockingMode, check_blocking_mode),
    (_SwallowsOptions, check_refusals),
]


@pytest.mark.parametrize(("wrong", "check"), PLANTED, ids=[w.__name__ for w, _ in PLANTED])
def test_each_check_fails_on_its_planted_wrong_stand_in(group, wrong, check) -> None:
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check(wrong, group)


# --------------------------------------------------------- two ranks, padded, bf16 combine

WORLD, LOCAL, TOKENS, PAD, WIDTH = 2, 2, 3, 4, 8


def _routing(rank: int) -> torch.Tensor:
    """Each rank's [TOKENS, WORLD·LOCAL] map: token t of rank r to experts (t + r) % 4 and
    (t + r + 1) % 4, except rank 1's token 2, which only goes to expert 3."""
    m = torch.zeros(TOKENS, WORLD * LOCAL, dtype=torch.bool)
    for t in range(TOKENS):
        m[t, (t + rank) % 4] = m[t, (t + rank + 1) % 4] = True
    if rank == 1:
        m[2] = torch.tensor([False, False, False, True])
    return m


def _hidden(rank: int) -> torch.Tensor:
    base = torch.arange(TOKENS * WIDTH, dtype=torch.float32).reshape(TOKENS, WIDTH)
    return (base + 100 * rank).bfloat16()


def _two_ranks(rank: int, out: str) -> None:
    store = (Path(out) / "store").as_uri()
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        buffer = deep_ep.HybridEPBuffer(dist.group.WORLD, WIDTH, TOKENS, LOCAL)
        probs = torch.full((TOKENS, WORLD * LOCAL), 0.5)
        rows, got_probs, _, counts, handle = buffer.dispatch_with_permute(
            hidden=_hidden(rank), routing_map=_routing(rank), probs=probs,
            num_of_experts_per_rank=LOCAL, pad_multiple=PAD, num_permuted_tokens=16,
            non_blocking=True,
        )  # fmt: skip
        combined, _ = buffer.combine_with_unpermute(hidden=rows, handle=handle,
                                                    pad_multiple=PAD)  # fmt: skip
        # Dispatch's backward where one rank has no probabilities to send back (torchtitan
        # passes probs=None on a rank whose buffer is empty): every rank still makes the same
        # collectives, as HybridEP's one-kernel combine does.
        grad_probs = torch.ones(rows.shape[0]) if rank == 0 else None
        _, mixed = buffer.combine_with_unpermute(hidden=rows, probs=grad_probs, handle=handle,
                                                 pad_multiple=PAD)  # fmt: skip
        dist.barrier()
        torch.save({"rows": rows, "counts": counts, "flag": int(handle[-1]),
                    "combined": combined, "probs": got_probs, "mixed": mixed},
                   f"{out}/rank{rank}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_two_ranks_padded_dispatch_and_bf16_combine(tmp_path: Path) -> None:
    results = run_ranks(__name__, _two_ranks, tmp_path, WORLD)
    routing = [_routing(r) for r in range(WORLD)]
    hidden = [_hidden(r) for r in range(WORLD)]
    for rank in range(WORLD):
        got = results[rank]
        assert got["rows"].dtype == got["combined"].dtype == torch.bfloat16
        want_rows, want_counts = [], []
        for e in range(LOCAL):  # by local expert, then (source rank, token), padded to 4
            col = rank * LOCAL + e
            mine = [hidden[s][t] for s in range(WORLD) for t in range(TOKENS)
                    if routing[s][t, col]]  # fmt: skip
            padded = len(mine) + (-len(mine) % PAD)
            want_rows += mine + [torch.zeros(WIDTH, dtype=torch.bfloat16)] * (padded - len(mine))
            want_counts.append(padded)
        assert got["counts"].tolist() == want_counts and got["flag"] == 0
        used = sum(want_counts)
        assert torch.equal(got["rows"][:used], torch.stack(want_rows))
        assert got["rows"][used:].isnan().all()  # the budget's unused rows: unwritten
        assert (got["probs"][:used] == torch.where(torch.stack(want_rows).any(1), 0.5, 0.0)).all()
        # Identity experts: each token comes back as the sum of its copies, in bf16.
        copies = routing[rank].sum(1, keepdim=True).bfloat16()
        assert torch.equal(got["combined"], hidden[rank] * copies)
    # Rank 0 gets back the ones it sent for its own experts' rows, zeros from rank 1 (none).
    assert results[1]["mixed"] is None
    want = routing[0].float()
    want[:, LOCAL:] = 0
    assert torch.equal(results[0]["mixed"], want)
