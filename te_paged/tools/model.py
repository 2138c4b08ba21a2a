"""The embedded default model of ``te-paged ab``: a residual stack of MoE layers.

    h_0 = x;   h_{l+1} = h_l + MoELayer_l(h_l);   loss = mean((h_L − target)²) + Σ aux_l

All MoE layers share one :class:`PagedStashManager` (one pool per (dtype, hidden)). Weights are
seeded per global expert, so any expert-parallel size holds the same model; the data of step
``s`` on rank ``r`` is drawn from a generator seeded by ``(seed, s, r)``, so paged stash ON and
OFF see the same batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from te_paged.moe import MoELayer
from te_paged.stash import PagedStashManager
from te_paged.tools.engine_configs import ModelConfig

__all__ = ["ModelConfig", "ToyMoEModel", "make_batch"]


class ToyMoEModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        paged: bool,
        group: dist.ProcessGroup | None,
        device: torch.device | str = "cpu",
        record_timeline: bool = False,
    ) -> None:
        super().__init__()
        ep = 1 if group is None else dist.get_world_size(group)
        moe = cfg.moe_config(ep, paged)
        self.manager = None
        if paged:
            self.manager = PagedStashManager.from_config(moe, device)
            if record_timeline:
                self.manager.timeline = []
        self.layers = nn.ModuleList(
            MoELayer(
                moe,
                group,
                self.manager,
                device=device,
                seed=cfg.seed * 1000 + i,
                layer_number=i + 1,  # Megatron's 1-based numbering, for the NVTX range names
            )
            for i in range(cfg.layers)
        )

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h, aux = x, x.new_zeros(())
        for layer in self.layers:
            y, a = layer(h)
            h, aux = h + y, aux + a
        return torch.nn.functional.mse_loss(h, target) + aux


def make_batch(
    cfg: ModelConfig,
    step: int,
    rank: int,
    device: torch.device | str = "cpu",
    *,
    tokens: int | None = None,
    microbatch: int = 0,
):
    """Microbatch ``microbatch`` of ``step`` on ``rank``: ``tokens`` rows (default
    ``cfg.tokens``) of inputs and targets."""
    seed = (cfg.seed * 1_000_003 + step) * 65_537 + rank + microbatch * 1_000_000_007
    g = torch.Generator().manual_seed(seed)
    tokens = cfg.tokens if tokens is None else tokens
    x = torch.randn(tokens, cfg.hidden, generator=g)
    target = torch.randn(tokens, cfg.hidden, generator=g)
    return x.to(device), target.to(device)
