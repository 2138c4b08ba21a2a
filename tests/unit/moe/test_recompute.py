"""CheckpointWithoutOutput: frees its output, refills the same storage, and owns it alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from te_paged import PagedStashManager, is_checkpoint_without_output_tensor, mark_grouped_tensor
from te_paged.grouped import GroupedLinear
from te_paged.moe import CheckpointWithoutOutput


def act(h, p):
    return F.silu(h[:, :16]) * h[:, 16:] * p[:, None]


def _run(recompute: bool, manager: PagedStashManager | None = None):
    torch.manual_seed(0)
    fc2 = GroupedLinear(2, 16, 8, bias=False)
    h = torch.randn(12, 32, requires_grad=True)
    p = torch.rand(12, requires_grad=True)
    splits = torch.tensor([5, 4])
    scope = manager.scope(12, splits.sum().reshape(1), 6) if manager else None
    if scope:
        scope.__enter__()
    if recompute:
        ckpt = CheckpointWithoutOutput()
        a = ckpt.checkpoint(act, h, p)
        y = fc2(a, splits)  # GroupedLinear saves a reshaped alias of `a`
        ckpt.discard_output_and_register_recompute(y)
        assert a.untyped_storage().nbytes() == 0  # freed right away
    else:
        y = fc2(act(h, p), splits)
    if scope:
        scope.__exit__(None, None, None)
    y.square().sum().backward()
    return [y.detach(), h.grad, p.grad, fc2.weight0.grad, fc2.weight1.grad]


def test_recompute_gives_the_same_gradients() -> None:
    assert all(torch.equal(a, b) for a, b in zip(_run(True), _run(False)))


def test_stash_leaves_the_recomputed_output_to_recompute() -> None:
    # The review finding: GroupedLinear saves a reshape/split of the checkpoint output, a new
    # object without attributes; the storage-level marker must still keep it out of the stash.
    manager = PagedStashManager(page_size=4)
    for step in range(2):
        manager.reset()
        on = _run(True, manager)
        assert all(torch.equal(a, b) for a, b in zip(on, _run(False))), step
        assert manager.stats().stashes == 0  # FC2's input belongs to recompute


def test_outputs_are_storage_marked_through_views() -> None:
    ckpt = CheckpointWithoutOutput()
    a = ckpt.checkpoint(act, torch.randn(4, 32), torch.rand(4))
    assert is_checkpoint_without_output_tensor(a.reshape(-1))
    assert is_checkpoint_without_output_tensor(torch.split(a.view(-1), 16)[1])
    mark_grouped_tensor(a)  # even marked by a producer, the storage marker wins in the stash


def test_lifecycle_errors() -> None:
    ckpt = CheckpointWithoutOutput()
    with pytest.raises(RuntimeError, match="before discard"):
        ckpt.discard_output_and_register_recompute(torch.ones(1, requires_grad=True) * 2)
    ckpt.checkpoint(act, torch.randn(4, 32, requires_grad=True), torch.rand(4))
    with pytest.raises(RuntimeError, match="one call"):
        ckpt.checkpoint(act, torch.randn(4, 32), torch.rand(4))
    with pytest.raises(ValueError, match="no grad_fn"):
        ckpt.discard_output_and_register_recompute(torch.ones(2))


def test_backward_releases_the_outputs_and_a_second_backward_says_why() -> None:
    # The recomputed output lives only until its backward: the graph, which the caller's loss
    # keeps, must not hold it (it did, through the checkpoint, one static buffer per layer).
    fc2 = GroupedLinear(2, 16, 8, bias=False)
    h, p = torch.randn(12, 32, requires_grad=True), torch.rand(12, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    a = ckpt.checkpoint(act, h, p)
    y = fc2(a, torch.tensor([5, 4]))
    ckpt.discard_output_and_register_recompute(y)
    loss = y.square().sum()
    loss.backward(retain_graph=True)
    assert ckpt._outputs == () and ckpt._ctx is None
    with pytest.raises(RuntimeError, match="recomputes once"):
        loss.backward()
