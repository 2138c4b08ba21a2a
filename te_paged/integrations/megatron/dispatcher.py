"""A static-budget token dispatcher for Megatron-core's ``MoELayer``.

Shape suffixes: ``N`` local tokens (``S·B``), ``E`` experts, ``K`` top-k, ``H`` hidden, ``T``
rows handed to the local experts (``max_num_tokens`` in static mode).

Megatron's alltoall and allgather dispatchers hand the experts dynamic ``[kept rows, H]``
buffers with host counts, so paged stash has no padding to cut. This dispatcher implements the
same six-call interface ``MoELayer`` drives —

    dispatch_preprocess(x_SBH, routing_map_NE, probs_NE) -> x_NH, (probs_NK, indices_NK)
    token_dispatch(x_NH, (probs_NK, indices_NK))         -> permuted_TH, probs_T
    dispatch_postprocess(permuted_TH, probs_T)           -> permuted_TH, tokens_per_expert, probs_T
    combine_preprocess(out_TH)                           -> out_TH
    token_combine(out_TH)                                -> y_NH
    combine_postprocess(y_NH)                            -> y_SBH

— on top of te_paged's :class:`~te_paged.moe.StaticBudgetDispatcher`: one fixed-size
``all_to_all_single`` per tensor over Megatron's expert-parallel group (gloo on CPU, NCCL on
CUDA), a static per-rank budget, assignments over it dropped from this attempt and counted in a
device over-budget counter, and a dropless mode the runner switches on for a rerun. The experts
get ``[max_num_tokens, H]`` with device counts (real tokens a prefix), so the stash pages only
the real rows, and nothing reads a count on the host.

**Budget** — Megatron HybridEP's rule (``_HybridEPManager.setup_metadata`` in Megatron-LM with
``moe_expert_rank_capacity_factor``): ``int(N · K · factor)`` (float arithmetic, truncated),
rounded up to Megatron's quantisation alignment (``get_align_size_for_quantization``: 16 on
0.16.1 and 0 — none — on 0.19.2 without FP8, 32 with MXFP8, 256 with 0.19.2's op fuser).
te_paged then splits it into ``P`` equal (source, destination) pair budgets; when ``P`` does
not divide it (``P`` not a power of two), it is rounded up to a multiple of
``lcm(alignment, P)`` — the one place it differs from HybridEP, whose budget is per receiving
rank, not per pair. Example: 2,048 tokens, top-8, factor 1.1, alignment 16:
``int(18022.4) = 18022`` → 18,032 rows, 4,508 per pair at EP 4.

**Top-k from the routing map**: Megatron's router returns a dense ``[N, E]`` probability and a
boolean routing map. Each token's ``K`` routed experts are taken in ascending expert order; a
token routed to fewer than ``K`` (a padding token) fills the rest with zero-probability
assignments, which occupy budget but contribute nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from te_paged.config import MoEConfig
from te_paged.moe import DispatchHandle, StaticBudgetDispatcher

if TYPE_CHECKING:
    from te_paged.integrations.megatron.loop import MegatronLoopAdapter

__all__ = [
    "MegatronRunnerSeams",
    "StaticBudgetTokenDispatcher",
    "hybrid_ep_rank_budget",
    "topk_from_routing_map",
]


def hybrid_ep_rank_budget(topk: int, align: int, ep_size: int) -> Callable[[int, float], int]:
    """``rank_budget(num_tokens, factor)`` following Megatron HybridEP (see module docstring).

    >>> hybrid_ep_rank_budget(topk=8, align=16, ep_size=4)(2048, 1.1)
    18032
    >>> hybrid_ep_rank_budget(topk=2, align=16, ep_size=3)(100, 1.1)  # lcm(16, 3) = 48
    240
    >>> hybrid_ep_rank_budget(topk=2, align=0, ep_size=4)(100, 1.1)  # 0: no alignment (0.19.2)
    220
    """
    align = align or 1  # megatron-core 0.19.2 answers 0 when no quantisation needs padding
    whole = math.lcm(align, ep_size)

    def rank_budget(num_tokens: int, factor: float) -> int:
        rows = int(num_tokens * topk * factor)
        rows += -rows % align
        if rows % ep_size:
            rows += -rows % whole
        return rows

    return rank_budget


def topk_from_routing_map(
    routing_map_NE: torch.Tensor, probs_NE: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs_NK, indices_NK)``: each token's routed experts in ascending order, and their
    probabilities (differentiable). Where a token has fewer than ``topk`` routes the rest are
    index ``-1``, probability 0: the dispatcher sends nothing for them (``routed_NK``).

    Example: ``routing_map = [[F, T, F, T]]``, K = 2 → indices ``[[1, 3]]``; ``[[F, T, F, F]]``
    → ``[[1, -1]]``.
    """
    # A stable sort of "not routed" puts the routed experts first, in expert order.
    order_NE = torch.sort((~routing_map_NE).to(torch.uint8), dim=1, stable=True).indices
    indices_NK = order_NE[:, :topk]
    routed_NK = routing_map_NE.gather(1, indices_NK)
    probs_NK = probs_NE.gather(1, indices_NK) * routed_NK.to(probs_NE.dtype)
    return probs_NK, indices_NK.masked_fill(~routed_NK, -1)


class _CapacityFactorSeam:
    """``token_dispatcher._comm_manager`` for Megatron's runner: the capacity factor it clears
    before a rerun (``None``) and sets back to the config's after a kept attempt."""

    def __init__(self, loop: MegatronLoopAdapter, dispatcher: MegatronRunnerSeams):
        self._loop, self._dispatcher = loop, dispatcher

    @property
    def moe_expert_rank_capacity_factor(self) -> float | None:
        """``None`` while the dispatcher is dropless (the rerun), else the static budget's."""
        d = self._dispatcher
        return None if d.dropless else d.config.moe_expert_rank_capacity_factor

    @moe_expert_rank_capacity_factor.setter
    def moe_expert_rank_capacity_factor(self, value: float | None) -> None:
        self._loop.set_capacity_factor(value)


class MegatronRunnerSeams:
    """The calls Megatron's own ``PagedStashRunner`` makes on a layer's token dispatcher,
    answered by te_paged's :class:`MegatronLoopAdapter` (``self.loop``) for a dispatcher whose
    runner-facing counters are ``self.budget`` (a :class:`StaticBudgetDispatcher`)."""

    loop: MegatronLoopAdapter | None
    budget: StaticBudgetDispatcher
    config: MoEConfig

    def _megatron_loop(self) -> MegatronLoopAdapter:
        if self.loop is None:
            raise TypeError(
                f"this {type(self).__name__} was built without a MegatronLoopAdapter, so "
                "Megatron's PagedStashRunner would not see te_paged's over-budget and "
                "stash-overflow flags: build the layers with get_te_paged_moe_spec(config) "
                "(PagedStashMoELayer gives its dispatcher one), or drive the step with "
                "te_paged.integrations.megatron.MegatronPagedStashRunner(model, optimizer)"
            )
        return self.loop

    @property
    def check_over_budget(self) -> Callable[[], torch.Tensor]:
        """Megatron's ``PagedStashRunner`` (megatron-core 0.19.2) finds the layers it reruns by
        ``hasattr(token_dispatcher, "check_over_budget")`` and calls it after each attempt:
        here every te_paged flag of the rank (over budget, stash overflow, invalid counts) as
        one device bool, reported through the layers' :class:`MegatronLoopAdapter`. A
        ``TypeError`` (which ``hasattr`` passes on) refuses that runner where it could not
        see them: no adapter, or te_paged's own runner already driving the layers."""
        loop = self._megatron_loop()
        loop.probe()
        return loop.check

    def reset_over_budget(self) -> None:
        """Megatron's runner before its dropless rerun: te_paged's adapter prepares it
        (restores the step's state, frees the pools, turns its stash off)."""
        self._megatron_loop().prepare_rerun()

    @property
    def _comm_manager(self) -> _CapacityFactorSeam:
        """What Megatron's runner reaches as ``token_dispatcher._comm_manager`` (HybridEP's
        and NCCL EP's managers there): its ``moe_expert_rank_capacity_factor``, cleared for the
        rerun and set back after a kept attempt, is the adapter's dropless switch."""
        return _CapacityFactorSeam(self._megatron_loop(), self)

    @property
    def dropless(self) -> bool:
        """Whether the last/next dispatch is dropless (the runner's rerun)."""
        return self.budget.dropless


class StaticBudgetTokenDispatcher(MegatronRunnerSeams):
    """Megatron's token-dispatcher interface over :class:`StaticBudgetDispatcher`.

    ``StaticBudgetTokenDispatcher(config, ep_group, *, align, device=None)``: ``config`` is
    te_paged's :class:`MoEConfig` read from the Megatron config (it carries
    ``moe_expert_rank_capacity_factor``), ``ep_group`` Megatron's expert-parallel group,
    ``align`` Megatron's quantisation alignment. :attr:`budget` is the underlying dispatcher
    (its counters, ``set_dropless`` and ``dropless_block``), which the runner drives.
    One dispatch is in flight at a time per layer, as with Megatron's own dispatchers.
    """

    def __init__(
        self,
        config: MoEConfig,
        ep_group: dist.ProcessGroup | None,
        *,
        align: int,
        device: torch.device | str | None = None,
        loop: MegatronLoopAdapter | None = None,
    ) -> None:
        if config.moe_expert_rank_capacity_factor is None:
            raise ValueError(
                "StaticBudgetTokenDispatcher needs moe_expert_rank_capacity_factor (the static "
                "budget); without one, use Megatron's own dispatchers"
            )
        ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        budget = hybrid_ep_rank_budget(config.moe_router_topk, align, ep_size)
        self.budget = StaticBudgetDispatcher(
            config, ep_group if ep_size > 1 else None, device=device, rank_budget=budget
        )
        self.config = config
        #: te_paged's side of Megatron's own PagedStashRunner (None: that runner is refused).
        self.loop = loop
        # Megatron's CUDA-graph bookkeeping reads these from every dispatcher.
        self.cudagraph_attrs: list[str] = []
        self.valid_cudagraph_attrs = None
        self._shape: torch.Size | None = None
        self._handle: DispatchHandle | None = None
        self._tokens_per_expert: torch.Tensor | None = None

    def get_expert_zero_copy_buffers(self) -> tuple[None, None]:
        """megatron-core 0.19.2's ``MoELayer`` asks every dispatcher for buffers its experts
        should write into (NCCL EP's zero-copy); this one exchanges through its own."""
        return None, None

    def set_shared_experts(self, shared_experts: object) -> None:
        raise ValueError(
            "moe_shared_expert_overlap is not supported with te_paged's static-budget "
            "dispatcher; set moe_shared_expert_overlap=False (shared experts still run)"
        )

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        self._shape = hidden_states.shape
        x_NH = hidden_states.reshape(-1, self._shape[-1])
        num_experts = self.config.num_moe_experts
        routing_NE = routing_map.reshape(-1, num_experts)
        probs_NE = probs.reshape(-1, num_experts)
        return x_NH, topk_from_routing_map(routing_NE, probs_NE, self.config.moe_router_topk)

    def token_dispatch(
        self, hidden_states: torch.Tensor, probs: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs_NK, indices_NK = probs
        permuted_TH, tokens_per_expert, probs_T, handle = self.budget.dispatch(
            hidden_states, probs_NK, indices_NK, routed_NK=indices_NK >= 0
        )
        self._handle, self._tokens_per_expert = handle, tokens_per_expert
        return permuted_TH, probs_T

    def dispatch_postprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hidden_states, self._tokens_per_expert, probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self._handle is None:
            raise RuntimeError("token_combine without a token_dispatch before it")
        handle, self._handle, self._tokens_per_expert = self._handle, None, None
        return self.budget.combine(hidden_states, handle)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self._shape)
