"""``MoELayer``: router → static-budget dispatcher → ``TEGroupedMLP`` → combine.

Shape suffixes: ``N`` tokens (all leading dimensions of the input, flattened), ``H`` hidden,
``K`` top-k, ``T`` rows handed to the local experts.

    x_NH ─ TopKRouter ─ probs_NK, indices_NK
         ─ StaticBudgetDispatcher.dispatch ─ permuted_TH, tokens_per_expert, probs_T
         ─ TEGroupedMLP (probability-weighted, paged stash) ─ out_TH
         ─ StaticBudgetDispatcher.combine ─ y_NH

Initialisation is expert-parallel invariant when a ``seed`` is given
(:func:`init_expert_weights_`): the router weight comes from one generator seeded by ``seed``
and each expert's weights from a generator seeded by ``(seed, global expert id)``, always on
the CPU, so an EP=1 layer and the EP=4 layers built with the same seed hold the same weights.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch import nn

from te_paged.moe.config_adapter import as_moe_config
from te_paged.moe.dispatcher import FROM_CONFIG, StaticBudgetDispatcher
from te_paged.moe.experts import TEGroupedMLP
from te_paged.moe.participant import PagedStashParticipant
from te_paged.moe.router import ScoreFunction, TopKRouter
from te_paged.stash import PagedStashManager
from te_paged.telemetry import nvtx_range

__all__ = ["MoELayer", "init_expert_weights_"]

# Mixes (seed, stream, expert) into one generator seed; the constants are arbitrary odd primes.
_MIX_SEED, _MIX_STREAM = 1_000_003, 7_919


def _generator(seed: int, stream: int, expert: int = 0) -> torch.Generator:
    mixed = (seed * _MIX_SEED + stream * _MIX_STREAM + expert) % (2**63 - 1)
    return torch.Generator().manual_seed(mixed)


def init_expert_weights_(layer: MoELayer, seed: int) -> MoELayer:
    """Re-initialise ``layer``'s router and experts from ``seed``, EP-invariantly (in place).

    Router: ``N(0, 0.02²)`` from stream 0. Expert ``e`` (global id ``ep_rank · L + j`` for
    local expert ``j``): FC1 then FC2 weight, kaiming-uniform (``a = √5``, as ``nn.Linear``),
    from its own generator; biases zero. Returns the layer.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    layer.router.reset_parameters(_generator(seed, 0))
    first = layer.dispatcher.ep_rank * layer.dispatcher.num_local_experts
    with torch.no_grad():
        for stream, linear in ((1, layer.experts.linear_fc1), (2, layer.experts.linear_fc2)):
            weights = [w_OI for w in linear.weight_params() for w_OI in w.view(-1, *w.shape[-2:])]
            for j, w_OI in enumerate(weights):
                cpu = torch.empty(w_OI.shape, dtype=torch.float32)
                nn.init.kaiming_uniform_(cpu, a=math.sqrt(5), generator=_generator(
                    seed, stream, first + j))  # fmt: skip
                w_OI.copy_(cpu)
            for b in linear.bias_params():
                b.zero_()
    return layer


class MoELayer(nn.Module, PagedStashParticipant):
    """An expert-parallel MoE layer, usable inside any ``nn.Module``.

    ``MoELayer(config, ep_group=None, manager=None, *, device=None, seed=None,
    score_function="softmax", expert_bias=False, aux_loss_coeff=0.0, capacity_factor=<from
    config>, layer_number=None)``; ``forward(x [..., H]) -> (y [..., H], aux_loss)``.

    ``manager`` is the :class:`PagedStashManager` shared by the model's layers (with
    ``moe_paged_stash`` and none given, the experts own one). ``seed`` makes the weights
    EP-invariant (see :func:`init_expert_weights_`); without it they come from torch's default
    generator (the same on every rank after ``torch.manual_seed``, but not EP-invariant for
    the experts). ``layer_number`` (as Megatron numbers layers: 1-based) names the layer's
    NVTX ranges (``te_paged.dispatch.layer<N>``, ``te_paged.stash.layer<N>``, ...).
    """

    def __init__(
        self,
        config: object,
        ep_group: dist.ProcessGroup | None = None,
        manager: PagedStashManager | None = None,
        *,
        device: torch.device | str | None = None,
        seed: int | None = None,
        score_function: ScoreFunction | str = ScoreFunction.SOFTMAX,
        expert_bias: bool = False,
        aux_loss_coeff: float = 0.0,
        capacity_factor: float | object | None = FROM_CONFIG,
        layer_number: int | None = None,
    ) -> None:
        super().__init__()
        cfg = as_moe_config(config)
        self.config = cfg
        self.router = TopKRouter(
            cfg,
            device=device,
            score_function=score_function,
            expert_bias=expert_bias,
            aux_loss_coeff=aux_loss_coeff,
        )
        self.dispatcher = StaticBudgetDispatcher(
            cfg, ep_group, capacity_factor=capacity_factor, device=device
        )
        self.experts = TEGroupedMLP(
            self.dispatcher.num_local_experts,
            cfg,
            manager=manager,
            device=device,
            layer_number=layer_number,
        )
        if seed is not None:
            init_expert_weights_(self, seed)

    @property
    def manager(self) -> PagedStashManager | None:
        return self.experts.manager

    @property
    def layer_number(self) -> int | None:
        return self.experts.layer_number

    def set_layer_number(self, layer_number: int | None) -> None:
        """Megatron's hook: the number this layer's NVTX ranges carry."""
        self.experts.set_layer_number(layer_number)

    @property
    def dropless(self) -> bool:
        return self.dispatcher.dropless

    def set_dropless(self, dropless: bool) -> None:
        """The runner's fallback: ``True`` switches the dispatcher to dropless, ``False`` back.

        Stashing is the manager's business (:meth:`PagedStashManager.disabled`): a dropless
        forward never stashes whatever the manager's state, since its rows are dynamic.
        """
        self.dispatcher.set_dropless(dropless)

    def budget_dispatchers(self) -> tuple[StaticBudgetDispatcher, ...]:
        """The runner protocol (:class:`~te_paged.moe.participant.PagedStashParticipant`); the
        experts report the manager themselves."""
        return (self.dispatcher,)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.config.hidden_size
        if x.dim() < 1 or x.shape[-1] != hidden:
            raise ValueError(f"x must be [..., {hidden}], got {tuple(x.shape)}")
        x_NH = x.reshape(-1, hidden)
        routing = self.router(x_NH)
        # The ranges' layer number: not while torch.compile traces (no ranges there; reading
        # it would make it a guard, one graph per layer).
        layer = None if torch.compiler.is_compiling() else self.layer_number
        with nvtx_range("te_paged.dispatch", layer):
            permuted_TH, tokens_per_expert_L, probs_T, handle = self.dispatcher.dispatch(
                x_NH, routing.probs, routing.indices
            )
        manager = self.manager
        with nvtx_range("te_paged.experts", layer):
            # Dynamic-shaped rows have no static budget to page against: run unstashed.
            off = handle.dropless and manager is not None
            balanced = handle.num_tokens * handle.topk  # N·K: exact, no estimate
            with (
                manager.disabled() if off else contextlib.nullcontext(),
                self.experts.balanced_tokens(balanced),
            ):
                out_TH, _ = self.experts(permuted_TH, tokens_per_expert_L, probs_T)
        with nvtx_range("te_paged.combine", layer):
            y_NH = self.dispatcher.combine(out_TH, handle)
        return y_NH.view(x.shape), routing.aux_loss
