"""NVTX ranges through the optional nvtx package, and the pool-occupancy timeline."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch

from te_paged import PagedStashManager, mark_grouped_tensor, telemetry
from tests.saving import Keep


def test_nvtx_range_is_a_noop_without_nvtx(monkeypatch) -> None:
    monkeypatch.setattr(telemetry.importlib.util, "find_spec", lambda name: None)
    telemetry._nvtx.cache_clear()
    try:
        with telemetry.nvtx_range("x"):
            pass
        assert telemetry.nvtx_available()[0] is False
    finally:
        telemetry._nvtx.cache_clear()


def test_nvtx_range_uses_the_nvtx_package(monkeypatch) -> None:
    seen = []

    @contextlib.contextmanager
    def annotate(name, domain):
        seen.append((name, domain))
        yield

    monkeypatch.setitem(sys.modules, "nvtx", types.SimpleNamespace(annotate=annotate))
    monkeypatch.setattr(telemetry.importlib.util, "find_spec", lambda name: object())
    telemetry._nvtx.cache_clear()
    try:
        with telemetry.nvtx_range("te_paged.stash"):
            pass
    finally:
        telemetry._nvtx.cache_clear()
    assert seen == [("te_paged.stash", "te_paged")]


def test_timeline_tracks_pages_rows_and_fragmentation() -> None:
    manager = PagedStashManager(page_size=4, record_timeline=True, skip_immediate_backward=False)
    for _ in range(2):
        manager.reset()
        outs = []
        for n in (5, 2):
            t = torch.randn(8, 3, requires_grad=True)
            mark_grouped_tensor(t)
            with manager.scope(8, torch.tensor(n), 4):
                outs.append(Keep.apply(t))
        sum(o.sum() for o in outs).backward()
    events = [(e.kind, e.pages_in_use, e.rows_in_use) for e in manager.timeline]
    assert events == [("stash", 2, 5), ("stash", 3, 7), ("pop", 2, 5), ("pop", 0, 0)]
    assert abs(manager.timeline[1].fragmentation - (1 - 7 / 12)) < 1e-12


def test_range_names_carry_the_layer_number() -> None:
    assert telemetry.range_name("te_paged.stash") == "te_paged.stash"
    assert telemetry.range_name("te_paged.stash", 3) == "te_paged.stash.layer3"
    assert telemetry.range_name("te_paged.pop", 0) == "te_paged.pop.layer0"


@pytest.mark.parametrize("layer_number", [None, 3])
def test_moe_layer_marks_dispatch_experts_combine_stash_and_pop(monkeypatch, layer_number) -> None:
    from te_paged.config import MoEConfig
    from te_paged.moe import MoELayer

    seen = []

    @contextlib.contextmanager
    def annotate(name, domain):
        seen.append(name)
        yield

    monkeypatch.setitem(sys.modules, "nvtx", types.SimpleNamespace(annotate=annotate))
    monkeypatch.setattr(telemetry.importlib.util, "find_spec", lambda name: object())
    telemetry._nvtx.cache_clear()
    try:
        cfg = MoEConfig(
            hidden_size=32,
            moe_ffn_hidden_size=64,
            num_moe_experts=4,
            moe_expert_rank_capacity_factor=2.0,
            moe_paged_stash=True,
            moe_paged_stash_skip_immediate_backward=False,  # one layer: it would be kept
        )
        manager = PagedStashManager.from_config(cfg)
        layer = MoELayer(cfg, None, manager, seed=0, layer_number=layer_number)
        for _ in range(2):  # capture step, then a paged step
            manager.reset()
            y, _ = layer(torch.randn(16, 32, requires_grad=True))
            y.sum().backward()
    finally:
        telemetry._nvtx.cache_clear()
    names = set(seen)
    suffix = "" if layer_number is None else f".layer{layer_number}"
    per_layer = {"dispatch", "experts", "combine", "stash", "pop"}
    # every per-layer range is named with the layer (and only with it), the rest without
    assert names == {f"te_paged.{n}{suffix}" for n in per_layer} | {"te_paged.allocate"}
    assert seen.count("te_paged.allocate") == 1  # once, at the reset after the capture step
