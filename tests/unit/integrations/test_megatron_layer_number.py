"""Megatron's layer number reaches te_paged's experts (and so their NVTX range names).

``TransformerLayer`` calls ``mlp.set_layer_number(layer_number)`` after building the MoE layer;
building a real ``PagedStashMoELayer`` needs Megatron's process groups, so the layer here is a
bare instance with the two parts ``set_layer_number`` touches (the router and the experts).
"""

from __future__ import annotations

import types

from torch import nn

from te_paged import MoEConfig, TEGroupedMLP
from te_paged.integrations.megatron.moe_layer import PagedStashMoELayer


def test_set_layer_number_numbers_the_router_and_te_paged_experts() -> None:
    cfg = MoEConfig(
        hidden_size=16,
        moe_ffn_hidden_size=32,
        num_moe_experts=4,
        moe_expert_rank_capacity_factor=2.0,
        moe_paged_stash=True,
    )
    routed = []
    layer = PagedStashMoELayer.__new__(PagedStashMoELayer)
    nn.Module.__init__(layer)
    layer.router = types.SimpleNamespace(set_layer_number=routed.append)
    layer.experts = TEGroupedMLP(4, cfg, device="cpu")
    assert layer.experts.layer_number is None
    layer.set_layer_number(7)
    assert (layer.layer_number, routed, layer.experts.layer_number) == (7, [7], 7)
    # Megatron's own experts have no such hook: nothing to number, nothing fails
    layer.experts = nn.Linear(2, 2)
    layer.set_layer_number(8)
    assert routed == [7, 8]
