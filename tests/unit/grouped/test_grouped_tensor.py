"""GroupedTensor: device-side offsets, masks and validation."""

from __future__ import annotations

import pytest
import torch

from te_paged.grouped import GroupedTensor
from tests.host_reads import NoHostReads


def test_from_splits_offsets_mask_and_group_ids():
    data = torch.arange(16.0).view(8, 2)
    gt = GroupedTensor.from_splits(data, torch.tensor([2, 0, 3], dtype=torch.int32))
    assert gt.split_sizes.dtype == torch.int64 and gt.offsets.dtype == torch.int32
    assert gt.offsets.tolist() == [2, 2, 5]
    assert (gt.num_groups, gt.max_rows, gt.hidden) == (3, 8, 2)
    assert gt.num_rows.item() == 5
    assert gt.row_mask().tolist() == [True] * 5 + [False] * 3
    assert gt.group_ids().tolist() == [0, 0, 2, 2, 2, 3, 3, 3]
    assert gt.data is data and gt.fp8 is None


def test_from_splits_reads_nothing_on_host():
    data = torch.randn(8, 4)
    with NoHostReads():
        gt = GroupedTensor.from_splits(data, torch.tensor([3, 1, 0, 2]))
        mask, groups, n = gt.row_mask(), gt.group_ids(), gt.num_rows
    assert mask.sum().item() == 6 and groups.tolist() == [0, 0, 0, 1, 3, 3, 4, 4]
    assert n.item() == 6


def test_mode_catches_a_host_read():  # the test above could not fail without this
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        torch.tensor([1]).item()


def test_offsets_clamped_to_buffer():
    # Over-budget routing must never let a grouped GEMM read past the buffer.
    gt = GroupedTensor.from_splits(torch.zeros(4, 4), torch.tensor([3, 3]))
    assert gt.offsets.tolist() == [3, 4] and gt.row_mask().all()


def test_zero_rows_and_single_group():
    gt = GroupedTensor.from_splits(torch.zeros(0, 4), torch.tensor([0]))
    assert gt.num_rows.item() == 0 and gt.row_mask().shape == (0,)
    gt = GroupedTensor.from_splits(torch.zeros(5, 4), torch.tensor([5]))
    assert gt.row_mask().all() and gt.group_ids().tolist() == [0] * 5


@pytest.mark.parametrize(
    ("splits", "error", "match"),
    [
        ([1, 2], TypeError, "integer tensor"),
        (torch.tensor([1.0, 2.0]), TypeError, "float32"),
        (torch.tensor([True, False]), TypeError, "bool"),
        (torch.tensor(3), ValueError, "1-D"),
        (torch.zeros(0, dtype=torch.int64), ValueError, "1-D"),
        (torch.tensor([1, 2], device="meta"), ValueError, "meta"),
    ],
)
def test_from_splits_rejects_bad_splits(splits, error, match):
    with pytest.raises(error, match=match):
        GroupedTensor.from_splits(torch.zeros(4, 4), splits)


def test_rejects_bad_data_and_offsets():
    with pytest.raises(ValueError, match=r"2-D.*\(4,\)"):
        GroupedTensor.from_splits(torch.zeros(4), torch.tensor([4]))
    with pytest.raises(TypeError, match="int32"):
        GroupedTensor(torch.zeros(4, 2), torch.tensor([4]), torch.tensor([4]))
    with pytest.raises(TypeError, match="int64"):
        GroupedTensor(torch.zeros(4, 2), torch.tensor([4], dtype=torch.int32),
                      torch.tensor([4], dtype=torch.int32))  # fmt: skip
    with pytest.raises(ValueError, match="must match"):
        GroupedTensor(torch.zeros(4, 2), torch.tensor([4]), torch.tensor([2, 4], dtype=torch.int32))
