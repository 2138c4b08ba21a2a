"""The manager's device: its default, and the check of what a scope hands it.

What CPU can test: the default's resolution (``torch.cuda`` patched to report a device, never
allocating on it), and the check itself, with a ``meta`` tensor standing for a tensor on
another device. A real GPU run of the README's snippet with the default device is in
the GPU check's territory (benchmarks/gpu_check), not here.
"""

from __future__ import annotations

import pytest
import torch

from te_paged import MoEConfig, PagedStashManager, TEGroupedMLP, mark_grouped_tensor
from te_paged.stash import manager as manager_module
from tests.saving import Keep


def _config() -> MoEConfig:
    return MoEConfig(
        hidden_size=16,
        moe_ffn_hidden_size=32,
        num_moe_experts=4,
        moe_expert_rank_capacity_factor=2.0,
        moe_paged_stash=True,
        moe_paged_stash_page_size=8,
    )


def test_default_device_is_cuda_current_device_when_cuda_is_available(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert manager_module._current_device() == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert manager_module._current_device() == torch.device("cpu")


def test_manager_and_from_config_default_to_the_current_device(monkeypatch) -> None:
    here = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert PagedStashManager(page_size=4, skip_immediate_backward=False).device == here
    assert PagedStashManager.from_config(_config()).device == here
    # The default is resolved by _current_device, not a hard-coded "cpu": patched, it is used.
    seen = []

    def current() -> torch.device:
        seen.append(True)
        return torch.device("cpu")

    monkeypatch.setattr(manager_module, "_current_device", current)
    PagedStashManager.from_config(_config())
    assert seen == [True]


def test_num_tokens_on_another_device_is_a_value_error_naming_both() -> None:
    manager = PagedStashManager(page_size=4, device="cpu", skip_immediate_backward=False)
    with pytest.raises(ValueError) as caught:
        with manager.scope(8, torch.tensor([5], device="meta"), 4):
            pass
    message = str(caught.value)
    assert "num_tokens is on meta but this PagedStashManager is on cpu" in message
    assert "PagedStashManager(..., device='meta')" in message  # the fix
    assert manager._scope is None  # nothing was left open


def test_saved_tensor_on_another_device_is_a_value_error() -> None:
    manager = PagedStashManager(page_size=4, device="cpu", skip_immediate_backward=False)
    t = torch.empty(8, 3, device="meta", requires_grad=True)
    mark_grouped_tensor(t)
    with pytest.raises(ValueError, match="a marked saved tensor is on meta but this "
                       "PagedStashManager is on cpu"):  # fmt: skip
        with manager.scope(8, torch.tensor([5]), 4):
            Keep.apply(t)


def test_tensors_on_the_managers_device_pass_the_check() -> None:
    manager = PagedStashManager(page_size=4, device="cpu", skip_immediate_backward=False)
    t = torch.randn(8, 3, requires_grad=True)
    mark_grouped_tensor(t)
    for _ in range(2):  # capture, then paged
        manager.reset()
        with manager.scope(8, torch.tensor([5]), 4):
            out = Keep.apply(t)
        out.sum().backward()
    assert manager.stats().stashes == 1 and manager.buffers


def test_experts_own_manager_goes_where_their_parameters_are() -> None:
    experts = TEGroupedMLP(4, _config(), device="cpu")
    assert experts.manager.device == torch.device("cpu")
    # A meta-device init (deferred initialisation) cannot put a manager on meta: it keeps the
    # manager's default instead of failing.
    with torch.device("meta"):
        deferred = TEGroupedMLP(4, _config())
    assert next(deferred.parameters()).device.type == "meta"
    assert deferred.manager.device == manager_module._current_device()
