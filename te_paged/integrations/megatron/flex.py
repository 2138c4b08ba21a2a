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

* :class:`FlexBudget`, the runner-facing counters (a :class:`StaticBudgetDispatcher` with no
  wire of its own): ``over_budget`` from HybridEP's overflow flag (the handle's last entry,
  read on the device, never on the host), ``peak_tokens`` from ``tokens_per_expert``,
  ``budget_tokens`` from ``num_permuted_tokens``; ``dropless`` (the runner's rerun) clears the
  manager's ``moe_expert_rank_capacity_factor`` before the dispatch, so HybridEP sizes the
  buffer from the routing (its one host read) and drops nothing; otherwise the manager gets
  the budget's factor, which the runner raises after a step over it (``grow_capacity``: the
  step's peak x ``capacity_headroom``, like Megatron-LM main's NCCL EP capacity growth);
* the experts get ``tokens_per_expert`` clipped to the buffer (:func:`kept_per_expert`), so
  a step over budget is flagged and rerun, never taken for invalid counts;
* Megatron's own ``PagedStashRunner`` reaches te_paged's :class:`MegatronLoopAdapter` through
  the same seams as with te_paged's dispatcher (:class:`MegatronRunnerSeams`).

Everything else (``dispatch_preprocess`` … ``combine_postprocess``, the shared-expert hooks,
the CUDA-graph attributes) is Megatron's. NCCL EP (``"ncclep"``) and DeepEP (``"deepep"``)
are not kept: their contracts were not read here, so those configs get te_paged's own
dispatcher (docs/megatron.md, "Megatron's flex dispatcher").

Importing this module does not import Megatron.
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from te_paged.config import MoEConfig
from te_paged.config.checks import require_real
from te_paged.integrations.megatron.dispatcher import MegatronRunnerSeams, hybrid_ep_rank_budget
from te_paged.moe import StaticBudgetDispatcher

if TYPE_CHECKING:
    from te_paged.integrations.megatron.loop import MegatronLoopAdapter

__all__ = ["FlexBudget", "FlexTokenDispatcher", "keeps_flex_dispatcher", "kept_per_expert"]

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


def kept_per_expert(tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of each expert that fit a buffer of ``rows``, HybridEP's rows past the budget
    being the tail of the expert-grouped order: the counts clipped where their running sum
    passes ``rows`` (unchanged when nothing was dropped). Device arithmetic, no host read, so
    the experts and the stash never see counts past their buffer.

    >>> kept_per_expert(torch.tensor([3, 4, 2]), 5).tolist()
    [3, 2, 0]
    """
    ends = tokens_per_expert.cumsum(0).clamp(max=rows)
    return torch.diff(ends, prepend=ends.new_zeros(1))


class FlexBudget(StaticBudgetDispatcher):
    """What te_paged's runners read and switch on a layer whose tokens Megatron's flex
    dispatcher moves: the device counters of :class:`StaticBudgetDispatcher`
    (``over_budget``, ``peak_tokens``, ``invalid_indices``, ``dropless_bytes``) and its
    dropless switches, without a wire (``a2a_capacity_factor`` is ``None``: HybridEP sends
    only real rows, so the runner has no wire to size). Its own ``dispatch``/``combine`` are
    not used."""

    #: The budget is what one rank receives (HybridEP's ``num_permuted_tokens``), not a pair's:
    #: runners size it from ``peak_tokens``.
    receive_budget = True

    def __init__(
        self,
        config: MoEConfig,
        ep_group: dist.ProcessGroup | None,
        *,
        align: int,
        device: Any = None,
    ) -> None:
        # HybridEP's budget rule (setup_metadata): int(N·K·factor), rounded up to the alignment.
        rule = hybrid_ep_rank_budget(config.moe_router_topk, align, 1)
        super().__init__(config, ep_group, device=device, rank_budget=rule)
        self._a2a = None  # no wire: HybridEP writes only the real rows
        self.wire_auto = False

    def set_capacity_factor(self, factor: float) -> None:
        """The receive budget's factor from the next dispatch on (host only; every rank of the
        group sets the same): the runner's growth after a step over budget."""
        self._capacity_factor = require_real("capacity_factor", factor, strict=True)

    def fitting_capacity_factor(
        self, num_tokens: int, peak_tokens: int, *, expert_buffer: bool = True
    ) -> float:
        """Smallest factor, in steps of 0.01, whose receive budget for ``num_tokens`` local
        tokens (HybridEP's rule) holds ``peak_tokens`` rows arriving at one rank."""
        balanced = max(1, num_tokens * self.config.moe_router_topk)
        factor = max(0.01, math.ceil(100 * peak_tokens / balanced) / 100)
        while self.rank_budget(num_tokens, factor) < peak_tokens:
            factor = round(factor + 0.01, 2)
        return factor

    def dispatch(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("FlexBudget does not dispatch: Megatron's flex dispatcher does")

    def combine(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("FlexBudget does not combine: Megatron's flex dispatcher does")

    def note_dispatch(
        self,
        num_tokens: int,
        budget_rows: int,
        tokens_per_expert: torch.Tensor,
        overflow: torch.Tensor | None,
        row_bytes: int,
    ) -> None:
        """One HybridEP dispatch of ``num_tokens`` local tokens into ``budget_rows`` rows
        (0: dropless), with its device ``tokens_per_expert`` and overflow flag (``None``:
        dropless). Device arithmetic only."""
        self.last_num_tokens = num_tokens
        received = tokens_per_expert.sum().to(self.peak_tokens.device, torch.int64)
        torch.maximum(self.peak_tokens, received, out=self.peak_tokens)
        # Dispatch, combine and their two backwards move the real rows, and only those.
        self.dropless_bytes.add_(received * (4 * row_bytes))
        if overflow is not None:
            self.budget_tokens = budget_rows
            over = (overflow.reshape(-1) != 0).any().to(self.over_budget.device, torch.int64)
            self.over_budget.add_(over)


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
