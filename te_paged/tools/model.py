"""The embedded default model of ``te-paged ab``: a residual stack of MoE layers.

    h_0 = x;   h_{l+1} = h_l + MoELayer_l(h_l);   loss = mean((h_L − target)²) + Σ aux_l

All MoE layers share one :class:`PagedStashManager` (one pool per (dtype, hidden)). Weights are
seeded per global expert, so any expert-parallel size holds the same model; the data of step
``s`` on rank ``r`` is drawn from a generator seeded by ``(seed, s, r)``, so paged stash ON and
OFF see the same batches.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from te_paged.config import MoEConfig
from te_paged.moe import MoELayer
from te_paged.stash import PagedStashManager

__all__ = ["ModelConfig", "ToyMoEModel", "make_batch"]


@dataclasses.dataclass
class ModelConfig:
    """The ``ab`` model and run. Defaults finish in about a minute on 2 CPU cores, 4 ranks."""

    layers: int = 8
    experts: int = 8
    topk: int = 2
    hidden: int = 256
    ffn: int = 512
    tokens: int = 512  # per rank and step
    capacity_factor: float = 2.0
    a2a_capacity_factor: float | None = None  # None: auto (starts at capacity_factor)
    buffer_factor_cuda: float = 1.10
    buffer_factor_cpu: float = 0.0
    page_size: int = 64
    fp8: str | None = None
    recompute: bool = False
    op_fuser: bool = False
    activation: str = "swiglu"
    steps: int = 3
    seed: int = 0
    skew: float = 0.0  # logits added to expert 0 on rank 0 (0 = none): forces over-budget
    grow_pool: bool = True  # the runner's grow_pool (False: the pools as the factors size them)
    grow_capacity: bool = True  # the runner's grow_capacity (False: the wire stays put)
    kernel_backend: str = "auto"
    skip_immediate_backward: bool = True  # moe_paged_stash_skip_immediate_backward

    def moe_config(self, ep_size: int, paged: bool) -> MoEConfig:
        return MoEConfig(
            hidden_size=self.hidden,
            moe_ffn_hidden_size=self.ffn,
            num_moe_experts=self.experts,
            moe_router_topk=self.topk,
            activation=self.activation,
            moe_expert_rank_capacity_factor=self.capacity_factor,
            moe_a2a_capacity_factor=self.a2a_capacity_factor,
            moe_paged_stash=paged,
            moe_paged_stash_page_size=self.page_size,
            moe_paged_stash_buffer_size_factor_cuda=self.buffer_factor_cuda,
            moe_paged_stash_buffer_size_factor_cpu=self.buffer_factor_cpu,
            fp8=self.fp8,
            recompute_granularity="selective" if self.recompute else None,
            recompute_modules=["moe_act"] if self.recompute else [],
            use_transformer_engine_op_fuser=self.op_fuser,
            expert_model_parallel_size=ep_size,
            moe_paged_stash_kernel_backend=self.kernel_backend,
            moe_paged_stash_skip_immediate_backward=self.skip_immediate_backward,
        )


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


def make_batch(cfg: ModelConfig, step: int, rank: int, device: torch.device | str = "cpu"):
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 65_537 + rank)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=g)
    target = torch.randn(cfg.tokens, cfg.hidden, generator=g)
    return x.to(device), target.to(device)
