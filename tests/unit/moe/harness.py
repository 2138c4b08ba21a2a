"""A small multi-layer expert stack driven the way an MoE model drives its experts."""

from __future__ import annotations

import torch

from te_paged.config import MoEConfig
from te_paged.moe import TEGroupedMLP
from te_paged.stash import PagedStashManager

ROWS = 64  # static expert buffer (max_num_tokens); capacity factor 2 -> 32 balanced rows
EXPERTS = 4
# Skewed but within the budget and within a 1.1x pool: 30 and 29 real rows of 64.
ROUTING = [[10, 0, 7, 13], [1, 20, 5, 3]]


def config(**overrides) -> MoEConfig:
    kw = {
        "hidden_size": 32,
        "moe_ffn_hidden_size": 64,
        "num_moe_experts": EXPERTS,
        "moe_expert_rank_capacity_factor": 2.0,
        "moe_paged_stash_page_size": 8,
        # Every layer paged, the last included: these tests check the paging itself. The last
        # layer kept runs in tests/unit/stash/test_skip_immediate.py and the step-memory tests.
        "moe_paged_stash_skip_immediate_backward": False,
    }
    if overrides.get("recompute_modules"):
        kw["recompute_granularity"] = "selective"
    if overrides.get("activation") == "quick_geglu":
        kw.update(activation_func_clamp_value=7.0, glu_linear_offset=1.0)
    kw.update(overrides)
    return MoEConfig(**kw)


def build(cfg: MoEConfig, layers: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    manager = PagedStashManager.from_config(cfg) if cfg.moe_paged_stash else None
    return manager, [TEGroupedMLP(EXPERTS, cfg, manager=manager) for _ in range(layers)]


def step_inputs(cfg: MoEConfig, step: int):
    g = torch.Generator().manual_seed(100 + step)
    routing = ROUTING[step % len(ROUTING)]
    tokens_per_expert = torch.tensor(routing)
    x = torch.randn(ROWS, cfg.hidden_size, generator=g)
    x[sum(routing) :] = 7.0  # stale padding: nothing may depend on it
    probs = torch.rand(ROWS, generator=g)
    return x.requires_grad_(), tokens_per_expert, probs.requires_grad_()


def run_step(manager, layers, cfg: MoEConfig, step: int) -> list[torch.Tensor]:
    """One forward/backward; returns output, input grad, probs grad and every parameter grad."""
    if manager is not None:
        manager.reset()
    x, tokens_per_expert, probs = step_inputs(cfg, step)
    h = x
    for layer in layers:
        h, bias = layer(h, tokens_per_expert, probs)
        assert bias is None
    h.square().sum().backward()
    grads = [h.detach(), x.grad, probs.grad]
    for layer in layers:
        grads += [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad(set_to_none=True)
    return grads
