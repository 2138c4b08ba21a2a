"""Several microbatches per runner step with te_paged's own loop: forward of every microbatch
then backward of every one, and an interleaved (1F1B-like) order. The capture step learns the
peak of concurrently live rows over the whole step; pops in any order return their pages; the
result is bitwise the unstashed run's, and a pool sized for one microbatch overflows and reruns
the whole step."""

from __future__ import annotations

import pytest
import torch

from te_paged.runtime import PagedStashRunner
from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

MICROBATCHES = 4
ORDERS = {
    # every forward, then every backward (in reverse: the last microbatch's first)
    "all_forward_then_backward": [("F", 0), ("F", 1), ("F", 2), ("F", 3),
                                  ("B", 3), ("B", 2), ("B", 1), ("B", 0)],
    # 1F1B-like: two microbatches in flight, backward in forward order
    "interleaved": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2),
                    ("B", 3)],
}  # fmt: skip
IN_FLIGHT = {"all_forward_then_backward": 4, "interleaved": 2}
# Layers skip_immediate_backward keeps out of the pool at the peak: the last microbatch's last
# layer when its backward comes first; under the interleaved order no forward is followed by
# its own backward.
KEPT = {"all_forward_then_backward": 1, "interleaved": 0}
LAYERS = 2


def _model(
    paged: bool, buffer_factor: float = 1.2, skip: bool = True
) -> tuple[ModelConfig, ToyMoEModel]:
    cfg = ModelConfig(
        layers=LAYERS, experts=4, topk=2, hidden=16, ffn=32, tokens=24, page_size=4,
        buffer_factor_cuda=buffer_factor, steps=3, skip_immediate_backward=skip,
    )  # fmt: skip
    torch.manual_seed(0)
    return cfg, ToyMoEModel(cfg, paged=paged, group=None)


def _step_fn(cfg, model, step: int, order):
    def fn():
        losses = {}
        for kind, mb in order:
            if kind == "F":
                x, target = make_batch(cfg, step, mb)
                losses[mb] = model(x, target) / MICROBATCHES
            else:
                losses[mb].backward()
                losses[mb] = losses[mb].detach()
        return torch.stack([losses[i] for i in sorted(losses)]).sum()

    return fn


def _train(
    paged: bool, order, buffer_factor: float = 1.2, steps: int = 3, grow_pool=True, skip=True
):
    cfg, model = _model(paged, buffer_factor, skip)
    runner = PagedStashRunner(
        model, model.manager, max_consecutive_fallbacks=steps, grow_pool=grow_pool
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        opt.zero_grad()
        loss, record = runner.step(_step_fn(cfg, model, step, order), step=step)
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        out.append((loss, grads, record))
    return out, model.manager


@pytest.mark.parametrize("skip", [True, False], ids=["kept", "all-paged"])
@pytest.mark.parametrize("order", list(ORDERS))
def test_accumulated_microbatches_are_bitwise_and_paged(order, skip) -> None:
    on, manager = _train(True, ORDERS[order], skip=skip)
    off, _ = _train(False, ORDERS[order])
    for (loss_on, grads_on, record), (loss_off, grads_off, _) in zip(on, off):
        assert record.attempt == 1 and record.enabled
        assert torch.equal(loss_on, loss_off)
        assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
    stats = manager.stats()
    assert stats.stashes == stats.pops > 0 and not stats.overflow
    kept = KEPT[order] if skip else 0
    assert stats.stashes_skipped == 4 * kept  # four tensors a layer
    # The capture step's peak holds exactly the microbatches in flight at once, less the
    # layer kept unpaged.
    _, single = _train(True, [("F", 0), ("B", 0)], steps=1, skip=False)
    per_layer = {k: v // LAYERS for k, v in single.stats().capture_peak_balanced_pages.items()}
    peak = stats.capture_peak_balanced_pages
    layers = IN_FLIGHT[order] * LAYERS - kept
    assert peak == {k: layers * v for k, v in per_layer.items()}, (peak, per_layer)


@pytest.mark.parametrize("grow_pool", [False, True])
def test_a_pool_for_fewer_microbatches_overflows_and_reruns_the_whole_step(grow_pool) -> None:
    order = ORDERS["all_forward_then_backward"]
    on, _ = _train(True, order, buffer_factor=0.5, grow_pool=grow_pool)
    off, _ = _train(False, order)
    # Kept at the factor's size, the pool overflows and reruns every step after the capture
    # step; grown to what the capture step held x headroom, it holds every microbatch in
    # flight from the start.
    assert [r.attempt for _, _, r in on] == ([1, 1, 1] if grow_pool else [1, 2, 2])
    if grow_pool:
        assert {g["why"] for g in on[0][2].pool_growth.values()} == {"capture"}
    for (loss_on, grads_on, _), (loss_off, grads_off, _) in zip(on, off):
        assert torch.equal(loss_on, loss_off)
        assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
