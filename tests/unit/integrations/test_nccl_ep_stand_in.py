"""The NCCL EP stand-in's contract on one gloo rank (the layout, drops, counts and gradients its
docstring states, so a change to it is seen where it is written).

The multi-rank behaviour (Megatron's ``"ncclep"`` dispatcher over it, te_paged's drop and
rerun) is functional_tests/megatron/test_megatron_flex.py.
"""

from __future__ import annotations

import pytest
import torch

from functional_tests.stand_ins import te_ep


@pytest.fixture
def group(one_rank_group, monkeypatch):
    monkeypatch.setattr(te_ep, "ALLOW_ONE_RANK", True)
    try:
        yield one_rank_group
    finally:
        te_ep.ep_finalize()


# Four tokens, three experts (one rank), top-2: expert 0 gets tokens 0, 2, 3; expert 1 tokens
# 0, 1; expert 2 tokens 1, 2, 3. With alignment 4 every zone is 4 rows: 12 rows demanded.
IDX = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 0]])
W = torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])


def _dispatch(group, capacity, drop=True, alignment=4):
    te_ep.ep_bootstrap(group, num_experts=3, max_tokens_per_rank=4, hidden_dim=2, num_topk=2,
                       recv_capacity_per_rank=capacity, drop_on_overflow=drop)  # fmt: skip
    buffer = te_ep.EpBuffer(top_k=2, max_tokens_per_rank=4, hidden_dim=2, num_local_experts=3,
                            recv_capacity_per_rank=capacity, alignment=alignment)  # fmt: skip
    x = (torch.arange(8.0).reshape(4, 2) + 1).requires_grad_()
    w = W.clone().requires_grad_()
    recv, weights, counts = te_ep.ep_dispatch(buffer, x, IDX, w)
    return buffer, x, w, recv, weights, counts


def test_the_layout_is_expert_major_padded_in_token_order(group) -> None:
    buffer, x, _w, recv, weights, counts = _dispatch(group, 12)
    assert counts.tolist() == [4, 4, 4] and int(buffer.total_recv_tokens) == 12
    order = [0, 2, 3, None, 0, 1, None, None, 1, 2, 3, None]
    for row, t in zip(recv, order):
        assert torch.equal(row, torch.zeros(2) if t is None else x[t])
    assert weights.tolist() == [0.5, 3.0, 6.0, 0, 0.25, 1.0, 0, 0, 2.0, 4.0, 5.0, 0]


@pytest.mark.parametrize(
    ("capacity", "kept"),
    [(8, [4, 4, 0]), (6, [4, 2, 0]), (5, [4, 1, 0])],  # the boundary expert loses its tail
)
def test_past_the_capacity_the_tail_slots_drop_and_the_demand_is_kept(group, capacity, kept):
    buffer, x, _w, recv, _weights, counts = _dispatch(group, capacity)
    assert counts.tolist() == kept and int(buffer.total_recv_tokens) == 12  # over: 12 > cap
    assert recv.shape == (capacity, 2)
    # Combine: each token's kept rows, unweighted; a dropped hit adds zero.
    out = te_ep.ep_combine(buffer, recv, num_local_tokens=4)
    # Token 0 keeps experts 0 and 1, tokens 2 and 3 expert 0; token 1 keeps expert 1 while
    # that zone keeps its second row (capacity 6 and up).
    kept_hits = {0: 2, 1: 1 if capacity >= 6 else 0, 2: 1, 3: 1}
    want = torch.stack([x[t] * kept_hits[t] for t in range(4)])
    assert torch.equal(out, want.detach())


def test_gradients_go_back_to_the_kept_hits(group) -> None:
    buffer, x, w, recv, weights, _counts = _dispatch(group, 8)
    out = te_ep.ep_combine(buffer, recv * weights.unsqueeze(1), num_local_tokens=4)
    out.sum().backward()
    # Token t's kept hits (expert 2 dropped): gradient sum of their weights; a kept hit's
    # weight gradient is its row's sum, a dropped one's zero.
    kept = torch.tensor([[1, 1], [1, 0], [1, 0], [0, 1]], dtype=torch.bool)
    assert torch.equal(x.grad, (W * kept).sum(1, keepdim=True).expand(4, 2))
    assert torch.equal(w.grad, torch.where(kept, x.detach().sum(1, keepdim=True), 0.0))


def test_without_drop_an_overrun_traps_and_unused_rows_are_unwritten(group) -> None:
    with pytest.raises(RuntimeError, match="trap"):
        _dispatch(group, 8, drop=False)
    te_ep.ep_finalize()
    _buffer, _x, _w, recv, _weights, counts = _dispatch(group, 14, drop=False)
    assert counts.tolist() == [4, 4, 4]
    assert recv[12:].isnan().all() and not recv[:12].isnan().any()


def test_bootstrap_once_until_finalized_and_buffers_at_its_capacity(group) -> None:
    _dispatch(group, 12)
    with pytest.raises(RuntimeError, match="already"):
        te_ep.ep_bootstrap(group, 3, 4, 2, 2, recv_capacity_per_rank=12)
    with pytest.raises(ValueError, match="capacity is 12"):
        te_ep.EpBuffer(2, 4, 2, 3, recv_capacity_per_rank=16)
    te_ep.ep_finalize()
    assert not te_ep.is_ep_bootstrapped()
    with pytest.raises(RuntimeError, match="ep_bootstrap"):
        te_ep.EpBuffer(2, 4, 2, 3, recv_capacity_per_rank=12)
    te_ep.ep_bootstrap(group, 3, 4, 2, 2, recv_capacity_per_rank=16, drop_on_overflow=True)
    buffer = te_ep.EpBuffer(2, 4, 2, 3, recv_capacity_per_rank=16)
    with pytest.raises(TypeError, match="float32"):
        te_ep.ep_dispatch(buffer, torch.ones(4, 2), IDX, W.double())
    with pytest.raises(ValueError, match="drop_on_overflow requires"):
        te_ep.ep_finalize() or te_ep.ep_bootstrap(group, 3, 4, 2, 2, drop_on_overflow=True)
