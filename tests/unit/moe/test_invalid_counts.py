"""Token counts and expert ids that cannot be right are flagged on the device and refuse the step.

Before: the device-initiated GroupedLinear clamped negative or oversized ``m_splits`` silently
where the legacy path raised; with paged stash off, tokens past the buffer were dropped without
a flag; an expert id out of range in the dispatcher was an index error naming no argument.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from te_paged import GroupedLinear, MoELayer, PagedStashRunner
from te_paged.runtime import InvalidCountsError

from .harness import EXPERTS, ROWS, build, config

BAD_SPLITS = [[10, -3, 7, 13], [40, 20, 5, 3]]  # a negative count; 68 rows for a 64-row buffer


@pytest.mark.parametrize("splits", BAD_SPLITS)
def test_both_grouped_linear_paths_refuse_the_same_counts(splits) -> None:
    x = torch.randn(ROWS, 16)
    legacy = GroupedLinear(EXPERTS, 16, 16, use_grouped_tensor=False)
    with pytest.raises(ValueError, match="m_splits"):
        legacy(x, torch.tensor(splits))
    device = GroupedLinear(EXPERTS, 16, 16)
    out = device(x, torch.tensor(splits))  # in bounds, and counted instead of raising
    assert out.shape == (ROWS, 16) and int(device.invalid_splits) == 1
    device(x, torch.tensor([10, 0, 7, 13]))
    assert int(device.invalid_splits) == 1  # valid counts add nothing


@pytest.mark.parametrize("splits", [*BAD_SPLITS, [40, 40, 0, 0]])
def test_a_grouped_tensor_input_has_its_own_splits_counted_like_m_splits(splits) -> None:
    # Before: a GroupedTensor whose split_sizes overran its rows (or held a negative count)
    # was computed on clamped offsets, invalid_splits 0: a group got fewer rows, silently.
    from te_paged.grouped import GroupedTensor

    x = torch.randn(ROWS, 16)
    layer = GroupedLinear(EXPERTS, 16, 16)
    layer(GroupedTensor.from_splits(x, torch.tensor(splits)))
    assert int(layer.invalid_splits) == 1
    layer(GroupedTensor.from_splits(x, torch.tensor([10, 0, 7, 13])))
    assert int(layer.invalid_splits) == 1


def test_a_grouped_tensor_of_another_group_count_is_refused_naming_both() -> None:
    # Before: torch's "matrix batch sizes have to match", deep in the grouped GEMM.
    from te_paged.grouped import GroupedTensor

    layer = GroupedLinear(2, 16, 16)
    three = GroupedTensor.from_splits(torch.randn(ROWS, 16), torch.tensor([4, 4, 4]))
    with pytest.raises(ValueError, match="split_sizes has 3 entries, expected num_gemms=2"):
        layer(three)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", BAD_SPLITS)
def test_experts_report_invalid_counts_and_the_runner_refuses_the_step(paged, splits) -> None:
    cfg = config(moe_paged_stash=paged)
    manager, layers = build(cfg, layers=1)
    model = nn.ModuleList(layers)
    runner = PagedStashRunner(model, manager)

    def step_fn(counts):
        def fn():
            x = torch.randn(ROWS, cfg.hidden_size, requires_grad=True)
            out, _ = layers[0](x, torch.tensor(counts), torch.rand(ROWS))
            out.sum().backward()

        return fn

    runner.step(step_fn([10, 0, 7, 13]))  # fine
    with pytest.raises(InvalidCountsError, match=r"rank\(s\) \[0\] saw token counts"):
        runner.step(step_fn(splits))
    if paged:
        assert manager.stats().invalid  # the manager's own statistics say so too
    runner.step(step_fn([1, 20, 5, 3]))  # the counters start at zero again


def test_an_expert_id_out_of_range_is_counted_and_dropped_not_an_index_error() -> None:
    cfg = config(moe_paged_stash=False)
    layer = MoELayer(cfg, seed=0)
    x = torch.randn(8, cfg.hidden_size)
    probs = torch.full((8, 2), 0.5)
    good = torch.tensor([[0, 1]] * 8)
    bad = good.clone()
    bad[3, 1] = EXPERTS  # one past the last expert
    bad[5, 0] = -1
    rows, counts, _, handle = layer.dispatcher.dispatch(x, probs, bad)
    assert int(layer.dispatcher.invalid_indices) == 1
    assert int(counts.sum()) == 16 - 2  # the two invalid assignments are dropped...
    assert int(layer.dispatcher.dropped_tokens) == 0  # ...and not counted as over budget
    y = layer.dispatcher.combine(rows, handle)
    ref_rows, _, _, ref_handle = layer.dispatcher.dispatch(x, probs, good)
    y_ref = layer.dispatcher.combine(ref_rows, ref_handle)
    untouched = [i for i in range(8) if i not in (3, 5)]
    assert torch.equal(y[untouched], y_ref[untouched])


@pytest.mark.parametrize("counts", [[40, 20, 5, 3], [30, 30, 10, -8]])
def test_a_stash_count_past_its_buffer_names_the_rank_and_layer_and_never_reruns(counts) -> None:
    # 68 tokens for a 64-row buffer; a sum of 62 with a negative count (the stash sees 62, the
    # grouped GEMM the -8): invalid input, which a rerun would see again — not an overflow.
    cfg = config(moe_paged_stash=True)
    manager, layers = build(cfg, layers=1)
    layers[0].set_layer_number(3)
    runner = PagedStashRunner(nn.ModuleList(layers), manager)
    calls = []

    def step_fn(c):
        def fn():
            calls.append(c)
            x = torch.randn(ROWS, cfg.hidden_size, requires_grad=True)
            out, _ = layers[0](x, torch.tensor(c), torch.rand(ROWS))
            out.sum().backward()

        return fn

    runner.step(step_fn([10, 0, 7, 13]))  # the capture step
    runner.step(step_fn([1, 20, 5, 3]))  # paged
    calls.clear()
    expected = (
        "on this rank: layer 3: num_tokens 68 for a buffer of 64 tokens"
        if sum(counts) > ROWS
        else "on this rank: 2 invalid count(s) reported by the layers' grouped GEMMs"  # FC1, FC2
    )
    with pytest.raises(InvalidCountsError, match=r"rank\(s\) \[0\] saw .*" + re.escape(expected)):
        runner.step(step_fn(counts))
    assert len(calls) == 1  # no rerun
    stats = manager.stats()
    assert stats.invalid  # the experts count a negative split into the manager's flags too
    if sum(counts) > ROWS:  # nothing was stored for the bad count: not an overflow of the pool
        assert not stats.overflow
