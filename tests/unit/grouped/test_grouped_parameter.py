"""Single grouped parameters read and written as Transformer Engine 2.19+ code reads them, the
deprecated switch of TE 2.20 honoured as TE honours it, and GroupedLinear's boolean switches
strict (docs/dev/te-2.20.2-grouped-storage.md)."""

from __future__ import annotations

import warnings

import pytest
import torch

from te_paged.grouped import GroupedLinear
from te_paged.grouped.grouped_linear import FUSED_GROUPED_GEMM_ENV

E, IN, OUT = 3, 8, 5
SPLITS = [4, 0, 6]


def _pair():
    torch.manual_seed(0)
    discrete = GroupedLinear(E, IN, OUT)
    single = GroupedLinear(E, IN, OUT, single_grouped_weight=True, single_grouped_bias=True)
    return discrete, single


def test_te_style_writes_through_rowwise_data_land_in_the_parameter() -> None:
    # TE's tests copy reference weights in with module.weight.rowwise_data.view_as(w).copy_(w);
    # before, te_paged's plain [E, O, I] parameter had no rowwise_data (AttributeError).
    discrete, single = _pair()
    w = torch.stack(discrete.weight_params()).detach()
    b = torch.stack(discrete.bias_params()).detach()
    with torch.no_grad():
        single.weight.rowwise_data.view_as(w).copy_(w)
        single.bias.rowwise_data.view_as(b).copy_(b)
    assert torch.equal(single.weight, w) and torch.equal(single.bias, b)
    x = torch.randn(sum(SPLITS), IN)
    y_ref = discrete(x, torch.tensor(SPLITS))
    y = single(x, torch.tensor(SPLITS))
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    grads = torch.stack([p.grad for p in discrete.weight_params()])
    assert torch.equal(single.weight.grad.view_as(grads), grads)  # TE: .grad.view_as(...)


def test_the_members_are_views_and_the_metadata_is_tes() -> None:
    _, single = _pair()
    w = single.weight
    members = w.split_into_quantized_tensors()
    assert [tuple(m.shape) for m in members] == [(OUT, IN)] * E
    with torch.no_grad():
        members[1].fill_(7.0)
    assert (w[1] == 7.0).all() and not (w[0] == 7.0).all()
    assert w.rowwise_data.shape == (E * OUT * IN,) and w.rowwise_data.data_ptr() == w.data_ptr()
    assert (w.num_tensors, w.tensor_shapes, w.logical_shape) == (E, [(OUT, IN)] * E, (E * OUT, IN))
    assert w.offsets == [0, OUT * IN, 2 * OUT * IN, 3 * OUT * IN]
    assert w.quantizer is None and w.columnwise_data is None  # unquantised, as in TE
    assert single.bias.logical_shape == (E * OUT, 1) and single.bias.rowwise_data.numel() == E * OUT
    assert isinstance(w, torch.nn.Parameter) and w.requires_grad


def test_rebinding_the_storage_is_refused_naming_the_way_to_write() -> None:
    _, single = _pair()
    with pytest.raises(AttributeError, match="write into it"):
        single.weight.rowwise_data = torch.zeros(E * OUT * IN)


def test_the_layout_survives_copies_casts_and_state_dicts() -> None:
    import copy

    _, single = _pair()
    assert hasattr(copy.deepcopy(single).weight, "rowwise_data")
    single.to(torch.bfloat16)
    assert single.weight.dtype == torch.bfloat16 and hasattr(single.weight, "rowwise_data")
    other = GroupedLinear(E, IN, OUT, single_grouped_weight=True, single_grouped_bias=True,
                          params_dtype=torch.bfloat16)  # fmt: skip
    other.load_state_dict(single.state_dict())
    assert torch.equal(other.weight, single.weight) and hasattr(other.weight, "offsets")


@pytest.mark.parametrize(("value", "device_path"), [("1", True), ("0", False)])
def test_the_deprecated_switch_decides_when_use_grouped_tensor_is_none(
    monkeypatch, value, device_path
) -> None:
    # TE 2.20 (module/grouped_linear.py:1661-1673): read only for use_grouped_tensor=None, a
    # FutureWarning, then bool(int(value)).
    monkeypatch.setenv(FUSED_GROUPED_GEMM_ENV, value)
    with pytest.warns(FutureWarning, match="use_grouped_tensor=True or use_grouped_tensor=False"):
        layer = GroupedLinear(E, IN, OUT)
    assert layer.use_grouped_tensor is device_path
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an explicit argument ignores the variable
        assert GroupedLinear(E, IN, OUT, use_grouped_tensor=not device_path).use_grouped_tensor \
            is (not device_path)  # fmt: skip


def test_the_deprecated_switch_must_be_an_integer(monkeypatch) -> None:
    monkeypatch.setenv(FUSED_GROUPED_GEMM_ENV, "yes")
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="is not an integer"):
        GroupedLinear(E, IN, OUT)


def test_unset_the_default_is_the_device_path_without_a_warning(monkeypatch) -> None:
    monkeypatch.delenv(FUSED_GROUPED_GEMM_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GroupedLinear(E, IN, OUT).use_grouped_tensor is True


SWITCHES = ["sequence_parallel", "fuse_wgrad_accumulation", "bias", "return_bias",
            "delay_wgrad_compute", "save_original_input", "single_grouped_weight",
            "single_grouped_bias"]  # fmt: skip


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("value", ["no", 1, None])
def test_every_boolean_switch_refuses_what_is_not_a_bool(name, value) -> None:
    # Before: single_grouped_weight='no' built the single layout (a non-empty string is true).
    with pytest.raises(TypeError, match=f"{name} must be True or False, got {value!r}"):
        GroupedLinear(E, IN, OUT, **{name: value})
