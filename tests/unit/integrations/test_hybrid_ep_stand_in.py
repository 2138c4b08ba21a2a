"""The HybridEP stand-in's contract on one gloo rank, and te_paged's count clipping for it.

The multi-rank behaviour (Megatron's dispatcher over it, reruns) is
functional_tests/megatron/test_megatron_flex.py; here: the layout the stand-in's docstring
states, so a change to it is seen where it is written.
"""

from __future__ import annotations

import pytest
import torch

from functional_tests.stand_ins import deep_ep
from te_paged.moe import kept_per_expert


@pytest.fixture
def group(one_rank_group):
    return one_rank_group


# Four tokens, two experts (one rank): token 0 -> e0, e1; token 1 -> e1; token 2 -> e0;
# token 3 -> none.
ROUTING = torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0]], dtype=torch.bool)
PROBS = torch.tensor([[0.25, 0.75], [0.0, 0.5], [1.0, 0.0], [0.0, 0.0]])


def _dispatch(group, **kw):
    buffer = deep_ep.HybridEPBuffer(group, 3, 4, 2)
    hidden = torch.arange(12.0).reshape(4, 3)
    out = buffer.dispatch_with_permute(
        hidden=hidden, routing_map=ROUTING, probs=PROBS, num_of_experts_per_rank=2, **kw
    )
    return buffer, hidden, out


def test_rows_are_grouped_by_expert_padded_and_combined_back(group) -> None:
    buffer, hidden, (rows, probs, scale, tokens_per_expert, handle) = _dispatch(
        group, pad_multiple=4, num_permuted_tokens=8, non_blocking=True
    )
    assert scale is None
    assert tokens_per_expert.tolist() == [4, 4]  # 2 and 2 rows, each padded to 4
    # Expert 0: tokens 0, 2, then padding; expert 1: tokens 0, 1, then padding.
    want = torch.stack([hidden[0], hidden[2], *[torch.zeros(3)] * 2,
                        hidden[0], hidden[1], *[torch.zeros(3)] * 2])  # fmt: skip
    assert torch.equal(rows, want)
    assert probs.tolist() == [0.25, 1.0, 0.0, 0.0, 0.75, 0.5, 0.0, 0.0]
    assert int(handle[-1]) == 0  # no overflow
    combined, none = buffer.combine_with_unpermute(hidden=rows, handle=handle)
    assert none is None
    assert torch.equal(combined, torch.stack([2 * hidden[0], hidden[1], hidden[2],
                                              torch.zeros(3)]))  # fmt: skip
    # The backward of dispatch: per (token, expert) probability gradients, dense.
    _, grad_probs = buffer.combine_with_unpermute(hidden=rows, probs=probs, handle=handle)
    assert torch.equal(grad_probs, PROBS)


def test_rows_past_the_budget_are_the_tail_and_set_the_flag(group) -> None:
    _, hidden, (rows, _, _, tokens_per_expert, handle) = _dispatch(
        group, num_permuted_tokens=3, non_blocking=True
    )
    assert rows.shape == (3, 3)  # the budget's rows, whatever the routing asked
    assert torch.equal(rows, torch.stack([hidden[0], hidden[2], hidden[0]]))  # token 1 dropped
    assert tokens_per_expert.tolist() == [2, 1]  # what was kept (DeepEP clamps), not asked
    assert int(handle[-1]) == 1
    assert kept_per_expert(tokens_per_expert, rows.shape[0]).tolist() == [2, 1]  # unchanged


def test_rows_past_the_used_ones_are_unwritten(group) -> None:
    _, _, (rows, probs, _, tokens_per_expert, handle) = _dispatch(
        group, num_permuted_tokens=6, non_blocking=True
    )
    assert tokens_per_expert.tolist() == [2, 2] and int(handle[-1]) == 0
    assert not rows[:4].isnan().any() and rows[4:].isnan().all()  # garbage, not zeros
    assert probs[4:].isnan().all()


def test_without_a_budget_the_rows_are_sized_from_the_routing(group) -> None:
    _, _, (rows, _, _, tokens_per_expert, _) = _dispatch(group)
    assert rows.shape[0] == int(tokens_per_expert.sum()) == 4  # the flag is not written


def test_a_budget_must_be_whole_padded_blocks(group) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        _dispatch(group, pad_multiple=4, num_permuted_tokens=6, non_blocking=True)


def test_indices_to_map_matches_the_dense_routing() -> None:
    idx = torch.tensor([[0, 1], [1, -1], [0, -1], [-1, -1]])
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.0], [1.0, 0.0], [0.0, 0.0]])
    routing, probs = deep_ep.indices_to_map(idx, weights, 4, 2)
    assert torch.equal(routing, ROUTING) and torch.equal(probs, PROBS)


def test_kept_per_expert_is_unchanged_within_the_buffer() -> None:
    counts = torch.tensor([3, 0, 5])
    assert kept_per_expert(counts, 8).tolist() == [3, 0, 5]
    assert kept_per_expert(counts, 4).tolist() == [3, 0, 1]
    assert kept_per_expert(counts, 0).tolist() == [0, 0, 0]
