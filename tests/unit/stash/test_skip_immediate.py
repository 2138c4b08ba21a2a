"""``skip_immediate_backward``: the scope whose backward follows its forward at once keeps its
saved tensors unpaged; the pools are sized without them; gradients do not change."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch

from te_paged import PagedStashManager

from .test_manager import MarkedLinear, run_model


def _manager(**kw) -> PagedStashManager:
    return PagedStashManager(page_size=8, buffer_size_factor_cuda=1.5, **kw)


def test_last_layer_kept_gradients_bitwise_and_pool_smaller() -> None:
    on, off = _manager(), _manager(skip_immediate_backward=False)  # on: the default
    for step in range(3):
        on.reset()
        off.reset()
        got, paged, plain = run_model(on, step), run_model(off, step), run_model(None, step)
        assert all(torch.equal(a, b) for a, b in zip(got, plain)), f"step {step}"
        assert all(torch.equal(a, b) for a, b in zip(paged, plain)), f"step {step}"
        s_on, s_off = on.stats(), off.stats()
        if step == 0:  # the capture step copies every tensor: it learns which it may keep
            assert (s_on.stashes, s_on.pops, s_on.stashes_skipped) == (3, 3, 0)
            # two layers live at once in the pools, three counted in S
            assert s_on.capture_peak_rows == {"float32x16": 2 * 17}
            assert s_on.capture_peak_balanced_rows == {"float32x16": 3 * 20}
            assert s_off.capture_peak_rows == {"float32x16": 3 * 17}
        else:  # the last layer's tensor is kept; the two before it are paged
            assert (s_on.stashes, s_on.pops, s_on.stashes_skipped) == (2, 2, 1)
            assert (s_off.stashes, s_off.pops, s_off.stashes_skipped) == (3, 3, 0)
            assert s_on.pool_pages == {"float32x16": math.ceil(1.5 * 2 * 3)}
            assert s_off.pool_pages == {"float32x16": math.ceil(1.5 * 3 * 3)}


def _two_microbatches(manager, step, interleave):
    """Forward of two microbatches; with ``interleave`` the second's forward comes before the
    first's backward (another order than the plain step the manager may have captured)."""
    torch.manual_seed(step)
    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(3)]
    num_tokens = torch.tensor(17)
    mask = (torch.arange(40) < 17)[:, None]  # rows past the count are padding, as in the layers
    outs = []
    for _ in range(2):
        h = torch.randn(40, 16)
        for w in ws:
            cm = manager.scope(40, num_tokens, 20) if manager else contextlib.nullcontext()
            with cm:
                h = torch.where(mask, torch.tanh(MarkedLinear.apply(h, w)), 0.0)
        if not interleave:
            h.sum().backward()
        outs.append(h)
    if interleave:
        for h in reversed(outs):
            h.sum().backward()
    return [w.grad for w in ws]


def test_a_changed_schedule_warns_once_and_keeps_the_gradients() -> None:
    # Room for the interleaved order's four paged layers (the capture step's order has two
    # live at once: a smaller pool would overflow, flagged, and a runner would rerun the step).
    manager = PagedStashManager(page_size=8, buffer_size_factor_cuda=4.0,
                                skip_immediate_backward=True)  # fmt: skip
    _two_microbatches(manager, 0, interleave=False)  # capture: each microbatch's last layer
    manager.reset()
    assert manager._immediate == {2, 5}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _two_microbatches(manager, 1, interleave=False)
    assert manager.stats().stashes_skipped == 2
    manager.reset()
    # The first microbatch's last layer is kept, but the second forward comes before its
    # backward: the kept tensors outlive the schedule they were chosen for.
    with pytest.warns(RuntimeWarning, match="the schedule changed since the capture step"):
        got = _two_microbatches(manager, 2, interleave=True)
    assert not manager.stats().overflow
    want = _two_microbatches(None, 2, interleave=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    manager.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per manager
        _two_microbatches(manager, 3, interleave=True)


def test_full_recompute_keeps_every_recomputed_layer() -> None:
    # A reentrant checkpoint saves nothing in its first forward (no grad) and recomputes each
    # layer right before its backward: every recomputed scope is immediate, nothing is paged.
    manager = _manager(skip_immediate_backward=True)

    def run(step):
        torch.manual_seed(step)
        ws = [torch.randn(16, 16, requires_grad=True) for _ in range(3)]
        h = torch.randn(40, 16, requires_grad=True)

        def layer(x, w):
            with manager.scope(40, torch.tensor(17), 20):
                return torch.tanh(MarkedLinear.apply(x, w))

        for w in ws:
            h = torch.utils.checkpoint.checkpoint(layer, h, w, use_reentrant=True)
        h.sum().backward()
        return [w.grad for w in ws]

    for step in range(3):
        manager.reset()
        grads = run(step)
        stats = manager.stats()
        if step:
            assert (stats.stashes, stats.stashes_skipped) == (0, 3)
    with manager.disabled():
        assert all(torch.equal(a, b) for a, b in zip(grads, run(2)))


def test_an_evaluation_forward_does_not_shift_the_order() -> None:
    manager = _manager(skip_immediate_backward=True)
    for step in range(3):
        manager.reset()
        if step:  # scopes that cannot save are not counted
            with torch.no_grad(), manager.scope(40, torch.tensor(17), 20):
                MarkedLinear.apply(torch.randn(40, 16), torch.randn(16, 16))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = run_model(manager, step)
        assert all(torch.equal(a, b) for a, b in zip(got, run_model(None, step)))
        assert manager.stats().stashes_skipped == (1 if step else 0)


def test_the_runner_records_the_skipped_stashes() -> None:
    from te_paged.runtime import PagedStashRunner
    from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

    cfg = ModelConfig(layers=2, experts=4, topk=2, hidden=16, ffn=32, tokens=24, page_size=4,
                      skip_immediate_backward=True)  # fmt: skip
    model = ToyMoEModel(cfg, paged=True, group=None)
    runner = PagedStashRunner(model, model.manager)
    x, target = make_batch(cfg, 0, 0)
    records = [runner.step(lambda: model(x, target).backward())[1] for _ in range(2)]
    # the capture step copies all; then the last layer's four saved tensors stay unpaged
    assert [r.stashes_skipped for r in records] == [0, 4]
    assert '"stashes_skipped": 4' in records[1].to_json()
