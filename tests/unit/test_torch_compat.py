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


def test_assume_constant_result_marks_as_torchs_own_does(monkeypatch) -> None:
    """te_paged marks its constant functions without importing Dynamo: the attribute it sets
    must be exactly what the running torch's ``torch.compiler.assume_constant_result`` sets."""

    def ours() -> int:
        return 1

    def torchs() -> int:
        return 1

    marked = torch.compiler.assume_constant_result(torchs)
    assert marked is torchs and vars(torchs), "torch's marking no longer sets an attribute"
    monkeypatch.delitem(sys.modules, "torch._dynamo")  # the path a process without Dynamo takes
    assert torch_compat.assume_constant_result(ours) is ours
    assert vars(ours) == vars(torchs)


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


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph_breaks"])
def test_compiling_on_a_torch_older_than_the_compiled_stash_needs_names_the_release(
    monkeypatch, fullgraph
) -> None:
    """torch 2.10's Dynamo cannot trace te_paged's opaque objects: a compiled layer raises,
    naming the release, instead of falling back to eager silently (fullgraph=False would)."""
    from te_paged import MoEConfig, PagedStashManager
    from te_paged.moe import TEGroupedMLP

    monkeypatch.setattr(torch_compat, "TORCH_RELEASE", (2, 10))
    # what te_paged's import builds on such a torch (only there: it imports Dynamo)
    monkeypatch.setattr(torch_compat, "_refuse_compile_now", torch_compat._compile_refusal())
    cfg = MoEConfig(
        hidden_size=16, moe_ffn_hidden_size=16, num_moe_experts=2,
        moe_expert_rank_capacity_factor=2.0, moe_paged_stash=True, moe_paged_stash_page_size=4,
        moe_use_grouped_tensor=True, params_dtype=torch.bfloat16,
    )  # fmt: skip
    mlp = TEGroupedMLP(2, cfg, manager=PagedStashManager.from_config(cfg, "cpu"))
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=fullgraph)
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    with pytest.raises(Exception, match=r"torch\.compile needs torch >= 2\.13") as raised:
        compiled(x, torch.tensor([5, 7]), torch.rand(32))
    assert fullgraph or isinstance(raised.value, RuntimeError)
    torch._dynamo.reset()
