"""te_paged.torch_compat: the one place where torch releases differ."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from te_paged import torch_compat


def test_the_clamp_rule_is_the_running_torchs() -> None:
    x = torch.tensor([2.0, -2.0], requires_grad=True)
    x.clamp(-2.0, 2.0).sum().backward()
    assert torch_compat.CLAMP_GRAD_AT_LIMIT == bool(x.grad.all())
    assert bool(x.grad.all()) or not bool(x.grad.any())  # both limits alike


def test_the_release_is_the_running_torchs() -> None:
    major, minor = torch.__version__.split(".")[:2]
    assert torch_compat.TORCH_RELEASE == (int(major), int(minor))


def test_a_feature_that_needs_a_newer_torch_names_the_release(monkeypatch) -> None:
    """torchtitan 0.3.0 needs torch 2.12: on an older torch the integration says so at import,
    before torchtitan's own import fails on a missing name."""
    monkeypatch.setattr(torch_compat, "TORCH_RELEASE", (2, 10))
    monkeypatch.delitem(sys.modules, "te_paged.integrations.torchtitan", raising=False)
    with pytest.raises(ImportError, match=r"torchtitan 0\.3\.0\) needs torch >= 2\.12; this is"):
        importlib.import_module("te_paged.integrations.torchtitan")
