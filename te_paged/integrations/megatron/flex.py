"""te_paged's experts behind Megatron's own flex dispatcher (HybridEP).

Megatron's ``MoEFlexTokenDispatcher`` with ``moe_flex_dispatcher_backend="hybridep"`` hands the
experts what te_paged's stash wants: a static receive buffer of ``num_permuted_tokens`` rows
(``int(N · K · moe_expert_rank_capacity_factor)`` rounded up to the quantisation alignment,
``_HybridEPManager.setup_metadata``), grouped by local expert with the real rows a prefix, and
``tokens_per_expert`` on the device. Only the real rows cross the wire (1x the bytes of a
dropless exchange, where te_paged's own dispatcher pads every pair to its wire budget). So
where HybridEP imports (``deep_ep.HybridEPBuffer``), :class:`PagedStashMoELayer` keeps
Megatron's dispatcher and wraps it in :class:`FlexTokenDispatcher`, which adds what te_paged's
runners need and changes nothing it sends:

* :class:`FlexBudget`, the runner-facing counters (a :class:`~te_paged.moe.ReceiveBudget`: no
  wire of its own): ``over_budget`` from HybridEP's overflow flag (the handle's last entry,
  read on the device, never on the host), ``peak_tokens`` from ``tokens_per_expert``,
  ``budget_tokens`` from ``num_permuted_tokens``; ``dropless`` (the runner's rerun) clears the
  manager's ``moe_expert_rank_capacity_factor`` before the dispatch, so HybridEP sizes the
  buffer from the routing (its one host read) and drops nothing; otherwise the manager gets
  the budget's factor, which the runner raises after a step over it (``grow_capacity``: the
  step's peak x ``capacity_headroom``, like Megatron-LM main's NCCL EP capacity growth);
* the experts get ``tokens_per_expert`` clipped to the buffer
  (:func:`~te_paged.moe.kept_per_expert`), so a step over budget is flagged and rerun, never
  taken for invalid counts;
* Megatron's own ``PagedStashRunner`` reaches te_paged's :class:`MegatronLoopAdapter` through
  the same seams as with te_paged's dispatcher (:class:`MegatronRunnerSeams`).

Everything else (``dispatch_preprocess`` … ``combine_postprocess``, the shared-expert hooks,
the CUDA-graph attributes) is Megatron's. NCCL EP (``"ncclep"``) and DeepEP (``"deepep"``)
are not kept; those configs get te_paged's own dispatcher. NCCL EP, as megatron-core 0.19.2
bootstraps it, traps on a receive overrun instead of flagging it (``fused_a2a.py:639``), so no
budget below the worst case can be rerun (docs/megatron.md, "Megatron's flex dispatcher").

Importing this module does not import Megatron.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from te_paged.config import MoEConfig
from te_paged.integrations.megatron.dispatcher import MegatronRunnerSeams, hybrid_ep_rank_budget
from te_paged.moe import ReceiveBudget, kept_per_expert

if TYPE_CHECKING:
    from te_paged.integrations.megatron.loop import MegatronLoopAdapter

__all__ = ["FlexBudget", "FlexTokenDispatcher", "keeps_flex_dispatcher"]

#: The flex backends te_paged keeps (the others get te_paged's own dispatcher).
KEPT_BACKENDS = ("hybridep",)


def keeps_flex_dispatcher(config: object) -> bool:
    """Whether :class:`PagedStashMoELayer` keeps Megatron's flex dispatcher for ``config``:
    ``moe_token_dispatcher_type="flex"`` with a kept backend (HybridEP) whose library imports
    in this process (Megatron's ``fused_a2a.HAVE_HYBRIDEP``)."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return False
    if getattr(config, "moe_flex_dispatcher_backend", None) not in KEPT_BACKENDS:
        return False
    if importlib.util.find_spec("deep_ep") is None:
        return False  # without importing Megatron's fused_a2a at all
    from megatron.core.transformer.moe import fused_a2a

    return bool(getattr(fused_a2a, "HAVE_HYBRIDEP", False))


class FlexBudget(ReceiveBudget):
    """The :class:`~te_paged.moe.ReceiveBudget` of Megatron's HybridEP dispatcher: its budget
    rule (``setup_metadata``: ``int(N·K·factor)`` rounded up to the alignment)."""

    def __init__(
        self,
        config: MoEConfig,
        ep_group: dist.ProcessGroup | None,
        *,
        align: int,
        device: Any = None,
    ) -> None:
        rule = hybrid_ep_rank_budget(config.moe_router_topk, align, 1)
        super().__init__(config, ep_group, rank_budget=rule, device=device)


class FlexTokenDispatcher(MegatronRunnerSeams):
    """Megatron's ``MoEFlexTokenDispatcher`` (``inner``), unchanged, plus te_paged's runner
    seams: :attr:`budget` (a :class:`FlexBudget`), the dropless switch applied to the HybridEP
    manager before each dispatch, and Megatron's own ``PagedStashRunner`` seams answered by
    ``loop`` (:class:`MegatronRunnerSeams`). Attributes it does not define are ``inner``'s."""

    def __init__(
        self,
        inner: Any,
        config: MoEConfig,
        ep_group: dist.ProcessGroup | None,
        *,
        align: int,
        device: Any = None,
        loop: MegatronLoopAdapter | None = None,
    ) -> None:
        if config.moe_expert_rank_capacity_factor is None:
            raise ValueError(
                "FlexTokenDispatcher needs moe_expert_rank_capacity_factor (HybridEP's static "
                "budget); without one Megatron's dispatcher is dropless and needs no runner"
            )
        ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.inner = inner
        self.config = config
        self.loop = loop
        self.budget = FlexBudget(
            config, ep_group if ep_size > 1 else None, align=align, device=device
        )
        self._num_tokens = 0

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this wrapper lacks: Megatron's attributes of its dispatcher.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def manager(self) -> Any:
        """Megatron's ``_HybridEPManager`` (what Megatron calls ``_comm_manager``; that name
        answers Megatron's ``PagedStashRunner`` here, :class:`MegatronRunnerSeams`)."""
        return self.inner._comm_manager

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The static budget unless the runner reruns dropless: setup_metadata reads the factor.
        factor = None if self.budget.dropless else self.budget.capacity_factor
        self.manager.moe_expert_rank_capacity_factor = factor
        self._num_tokens = hidden_states.numel() // hidden_states.shape[-1]
        return self.inner.dispatch_preprocess(hidden_states, routing_map, probs)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: Any = None, *args: Any,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        out, dispatched_probs = self.inner.token_dispatch(hidden_states, probs, *args, **kwargs)
        manager = self.manager
        static = manager.moe_expert_rank_capacity_factor is not None
        budget_rows = int(manager.num_permuted_tokens) if static else 0
        self.budget.note_dispatch(
            self._num_tokens,
            budget_rows,
            manager.tokens_per_expert,
            manager.handle[-1] if static else None,
            out.shape[-1] * out.element_size(),
        )
        return out, dispatched_probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor) -> Any:
        rows_TH, tokens_per_expert, probs_T = self.inner.dispatch_postprocess(hidden_states, probs)
        return rows_TH, kept_per_expert(tokens_per_expert, rows_TH.shape[0]), probs_T

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner.combine_preprocess(hidden_states)

    def token_combine(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.inner.token_combine(hidden_states, *args, **kwargs)

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.inner.combine_postprocess(hidden_states)

    def get_expert_zero_copy_buffers(self) -> Any:
        return self.inner.get_expert_zero_copy_buffers()
