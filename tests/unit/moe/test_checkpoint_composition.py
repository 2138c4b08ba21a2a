"""Paged stash inside torch's activation checkpoints: the outer owner of the saved tensors wins.

A non-reentrant ``torch.utils.checkpoint`` installs saved-tensor hooks of its own (in its first
forward, and again in its recomputation); a stash scope opened inside them must leave the saved
tensors to the checkpoint. Otherwise the inner hooks win, both forwards are paged, and the
recomputed copies are never popped: pages held to the step's end, the pool sized double. A
reentrant checkpoint runs its first forward without grad (nothing saved) and its
recomputation with no outer hooks, so that forward is paged and popped.
"""

from __future__ import annotations

import pytest
import torch

from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

CFG = ModelConfig(layers=3, experts=4, topk=2, hidden=16, ffn=32, tokens=24, page_size=4)


def _steps(mode: str, paged: bool = True):
    torch.manual_seed(0)
    model = ToyMoEModel(CFG, paged=paged, group=None)
    out = []
    for step in range(3):
        if model.manager is not None:
            model.manager.reset()
        x, target = make_batch(CFG, step, 0)
        x.requires_grad_()
        if mode == "plain":
            loss = model(x, target)
        else:
            loss = torch.utils.checkpoint.checkpoint(
                model, x, target, use_reentrant=mode == "reentrant"
            )
        loss.backward()
        out.append([x.grad, *(p.grad.clone() for p in model.parameters())])
        model.zero_grad()
    return model, out


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_checkpointed_model_is_bitwise_and_pages_are_never_held(mode) -> None:
    plain, reference = _steps("plain")
    model, grads = _steps(mode)
    _, unpaged = _steps("plain", paged=False)
    for a, b, c in zip(grads, reference, unpaged):
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))
    stats, plain_stats = model.manager.stats(), plain.manager.stats()
    assert stats.stashes == stats.pops
    if mode == "reentrant":  # the recomputation is paged: one set of pages, not two
        assert stats.stashes == plain_stats.stashes > 0
        assert stats.capture_peak_balanced_pages == plain_stats.capture_peak_balanced_pages
    else:  # the checkpoint owns every saved tensor
        assert stats.stashes == 0 and stats.capture_peak_balanced_pages == {}
