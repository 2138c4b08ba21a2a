"""Producer markers (object-level, TE-compatible) and storage-level recompute markers."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from te_paged.markers import (
    GROUPED_TENSOR_ATTR,
    MarkerKind,
    grouped_tensor_marker,
    is_checkpoint_without_output_tensor,
    is_grouped_tensor_marked,
    mark_grouped_tensor,
    mark_recompute_managed,
    propagate_paged_stash_marker,
)


def test_mark_skips_none_and_marks_each_tensor() -> None:
    a, b = torch.zeros(4, 2), torch.zeros(1, 2)
    mark_grouped_tensor(a, None, b)
    assert is_grouped_tensor_marked(a) and is_grouped_tensor_marked(b)
    assert grouped_tensor_marker(a) is MarkerKind.TOKEN_ROWS
    assert not is_grouped_tensor_marked(None)


def test_scale_inv_marker_kind() -> None:
    s = torch.zeros(2, 8)
    mark_grouped_tensor(s, scale_inv=True)
    assert grouped_tensor_marker(s) is MarkerKind.SCALE_INV_ROWS
    assert MarkerKind.SCALE_INV_ROWS.tokens_per_row == 32


def test_mark_rejects_non_tensors() -> None:
    with pytest.raises(TypeError, match="expects tensors or None"):
        mark_grouped_tensor([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "op",
    [
        lambda t: t.view(-1),
        lambda t: t.reshape(2, -1),
        lambda t: t.detach(),
        lambda t: t.to(torch.bfloat16),
        lambda t: t[:2],
    ],
    ids=["view", "reshape", "detach", "cast", "slice"],
)
def test_producer_marker_does_not_survive_new_objects(op) -> None:
    t = torch.zeros(4, 4)
    mark_grouped_tensor(t)
    derived = op(t)
    assert not is_grouped_tensor_marked(derived)
    propagate_paged_stash_marker(t, derived)
    assert is_grouped_tensor_marked(derived)


def test_propagate_keeps_the_kind_and_ignores_unmarked_or_none() -> None:
    s = torch.zeros(2, 4)
    mark_grouped_tensor(s, scale_inv=True)
    v = s.view(-1)
    propagate_paged_stash_marker(s, v)
    assert grouped_tensor_marker(v) is MarkerKind.SCALE_INV_ROWS
    plain, target = torch.zeros(2), torch.zeros(2)
    propagate_paged_stash_marker(plain, target)
    propagate_paged_stash_marker(None, target)
    propagate_paged_stash_marker(s, None)
    assert not is_grouped_tensor_marked(target)


def test_tensor_marked_by_transformer_engine_is_recognised() -> None:
    t, s = torch.zeros(8, 4), torch.zeros(1, 4)
    setattr(t, GROUPED_TENSOR_ATTR, False)  # what TE's own utility sets
    setattr(s, GROUPED_TENSOR_ATTR, True)
    assert grouped_tensor_marker(t) is MarkerKind.TOKEN_ROWS
    assert grouped_tensor_marker(s) is MarkerKind.SCALE_INV_ROWS


def test_marking_delegates_to_transformer_engine_when_importable(monkeypatch) -> None:
    calls: list[torch.Tensor] = []

    def te_mark(t: torch.Tensor) -> None:
        calls.append(t)
        setattr(t, GROUPED_TENSOR_ATTR, False)

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_utils = types.ModuleType("transformer_engine.pytorch.utils")
    te_utils.mark_grouped_tensor = te_mark
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.utils", te_utils)

    t, s = torch.zeros(4, 2), torch.zeros(1, 2)
    mark_grouped_tensor(t)
    mark_grouped_tensor(s, scale_inv=True)  # our scale-inverses are marked by te_paged itself
    assert calls == [t]
    assert grouped_tensor_marker(t) is MarkerKind.TOKEN_ROWS
    assert grouped_tensor_marker(s) is MarkerKind.SCALE_INV_ROWS


def test_without_transformer_engine_marking_is_builtin(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # import would fail
    t = torch.zeros(2, 2)
    mark_grouped_tensor(t)
    assert getattr(t, GROUPED_TENSOR_ATTR) is False


@pytest.mark.parametrize(
    "alias",
    [
        lambda t: t,
        lambda t: t.view(-1),
        lambda t: t.reshape(4, 6),
        lambda t: torch.split(t.reshape(-1), 5)[2],
        lambda t: t.detach(),
        lambda t: t[1:, 2:],
        lambda t: t.t(),
        lambda t: t.view(torch.int32),
    ],
    ids=["same", "view", "reshape", "split", "detach", "slice", "transpose", "dtype-view"],
)
def test_recompute_marker_is_seen_through_every_alias(alias) -> None:
    t = torch.randn(6, 4)
    mark_recompute_managed(t)
    assert is_checkpoint_without_output_tensor(alias(t))


def test_recompute_marker_survives_storage_free_and_refill() -> None:
    # CheckpointWithoutOutput frees the output's storage after forward and refills it in
    # backward; views taken before the free must still be recognised after the refill.
    t = torch.randn(4, 4)
    saved_view = t.reshape(2, 8)
    mark_recompute_managed(t)
    nbytes = t.untyped_storage().nbytes()
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(nbytes)
    assert is_checkpoint_without_output_tensor(saved_view)


def test_recompute_marker_does_not_leak_to_copies_or_other_tensors() -> None:
    t = torch.randn(3, 3)
    mark_recompute_managed(t)
    assert not is_checkpoint_without_output_tensor(t.clone())
    assert not is_checkpoint_without_output_tensor(t.contiguous().t().contiguous())
    assert not is_checkpoint_without_output_tensor(torch.randn(3, 3))
    with pytest.raises(TypeError, match="expects a tensor"):
        mark_recompute_managed("x")  # type: ignore[arg-type]
