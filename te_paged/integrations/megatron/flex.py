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
the CUDA-graph attributes) is Megatron's. With ``moe_hybridep_pad_uneven_dispatch_inputs``
Megatron pads every rank's tokens to the group's largest count (an ``all_reduce`` and a host
read per layer, its choice) and sizes the budget from it; the budget here counts the same
padded tokens, so the factors it fits are Megatron's.

**NCCL EP** (``"ncclep"``, Transformer Engine's ``transformer_engine.pytorch.ep``) is kept
where that module imports and can drop (``ep_bootstrap(..., drop_on_overflow=...)``,
Transformer Engine 2.19 and later). megatron-core 0.19.2 bootstraps it so that an overrun traps
the device (``fused_a2a.py:638``) and with a call Transformer Engine 2.19 refuses (no
``num_topk``), so te_paged bootstraps it first, once per process and before any dispatch, with
``drop_on_overflow=True`` (0.19.2 then skips its own: it reads ``te_ep._BOOTSTRAPPED``), and
gives Megatron's ``_NCCLEPManager`` the capacity (:class:`NcclEpBootstrap`). Then (the contract
as read in Transformer Engine and NCCL EP: ``docs/dev/ncclep-contract.md``):

* the budget is Megatron's rule, ``recv_capacity = int(ceil64(N) · K · factor)`` rounded up to
  the alignment (:func:`nccl_ep_rank_budget`); the experts get the static receive buffer
  (``static_shape``: no host read of the counts) and ``tokens_per_expert``, the rows kept;
* over budget is ``EpBuffer.total_recv_tokens`` (the rows demanded, before any drop) above the
  capacity, compared on the device; ``peak_tokens`` is that demand, so the runner sees what a
  step needed even when rows were dropped;
* the capacity is fixed at the bootstrap, so a new one is a new bootstrap (``ep_finalize``,
  then ``ep_bootstrap``: collective, at the first dispatch of a step, never inside one): the
  dropless rerun bootstraps at the demand the failed attempt measured (the runner's reduced
  ``peak_tokens``, :attr:`~te_paged.moe.ReceiveBudget.rerun_rows`: the rerun routes the same
  tokens), the runner's growth after it at the grown factor; a rerun that still went over
  budget raises (the runner checks it) instead of keeping dropped rows;
* Megatron's zero-copy path (``moe_ncclep_zero_copy``) is refused: its symmetric buffers are
  sized once, for the first capacity.

Where NCCL EP cannot drop (Transformer Engine 2.18) or does not import, and for DeepEP
(``"deepep"``), the layer gets te_paged's own dispatcher instead.

Importing this module does not import Megatron.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from te_paged.config import MoEConfig
from te_paged.integrations.megatron.dispatcher import MegatronRunnerSeams, hybrid_ep_rank_budget
from te_paged.moe import ReceiveBudget, kept_per_expert

if TYPE_CHECKING:
    from collections.abc import Callable

    from te_paged.integrations.megatron.loop import MegatronLoopAdapter

__all__ = [
    "FlexBudget",
    "FlexTokenDispatcher",
    "NcclEpBootstrap",
    "keeps_flex_dispatcher",
    "nccl_ep_rank_budget",
    "nccl_ep_unavailable",
]

logger = logging.getLogger(__name__)

#: The flex backends te_paged keeps (the others get te_paged's own dispatcher).
KEPT_BACKENDS = ("hybridep", "ncclep")
#: NCCL EP's HT mode takes a multiple of this many tokens per rank (megatron-core 0.19.2,
#: ``token_dispatcher.py:1597``).
NCCL_EP_TOKEN_CHUNK = 64


def keeps_flex_dispatcher(config: object) -> bool:
    """Whether :class:`PagedStashMoELayer` keeps Megatron's flex dispatcher for ``config``:
    ``moe_token_dispatcher_type="flex"`` with a kept backend whose library imports in this
    process: HybridEP (Megatron's ``fused_a2a.HAVE_HYBRIDEP``) or NCCL EP that can drop
    (:func:`nccl_ep_unavailable`)."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return False
    backend = getattr(config, "moe_flex_dispatcher_backend", None)
    if backend not in KEPT_BACKENDS:
        return False
    if backend == "ncclep":
        why = nccl_ep_unavailable()
    elif importlib.util.find_spec("deep_ep") is None:  # without importing Megatron's fused_a2a
        why = "deep_ep (HybridEP) does not import"
    else:
        from megatron.core.transformer.moe import fused_a2a

        ok = bool(getattr(fused_a2a, "HAVE_HYBRIDEP", False))
        why = None if ok else "megatron-core's fused_a2a found no HybridEP (HAVE_HYBRIDEP False)"
    if why is not None:
        _lost_fast_path(backend, why)
    return why is None


@functools.cache
def _lost_fast_path(backend: str, why: str) -> None:
    """Said once per process and reason, when the layers are built: the config asked for a
    flex backend te_paged would keep, and gets te_paged's own dispatcher instead."""
    logger.warning(
        "te_paged: moe_flex_dispatcher_backend=%r asked for, but %s: the MoE layers use "
        "te_paged's own static-budget dispatcher instead (every rank pair padded to its wire "
        "budget, where %s sends only the real rows)", backend, why, backend,
    )  # fmt: skip


def nccl_ep_unavailable() -> str | None:
    """Why te_paged cannot keep Megatron's NCCL EP dispatcher in this process, or ``None``: the
    module Megatron imports (``fused_a2a.te_ep``) must be there and drop on overflow."""
    from megatron.core.transformer.moe import fused_a2a

    if not getattr(fused_a2a, "HAVE_TE_EP", False):
        return "transformer_engine.pytorch.ep does not import"
    params = inspect.signature(fused_a2a.te_ep.ep_bootstrap).parameters
    if "drop_on_overflow" not in params:
        return (
            "this Transformer Engine's ep_bootstrap has no drop_on_overflow (before 2.19): a "
            "receive overrun would trap the process instead of being rerun"
        )
    return None


def nccl_ep_max_tokens(num_tokens: int) -> int:
    """``max_tokens_per_rank`` for ``num_tokens`` local tokens: rounded up to NCCL EP's chunk."""
    return -(-max(1, num_tokens) // NCCL_EP_TOKEN_CHUNK) * NCCL_EP_TOKEN_CHUNK


def nccl_ep_rank_budget(topk: int, align: int) -> Callable[[int, float], int]:
    """``rank_budget(num_tokens, factor)`` of Megatron's NCCL EP manager
    (``_NCCLEPManager._ensure_bootstrap``): ``int(ceil64(N) · K · factor)`` rounded up to the
    alignment, and at least ``ceil64(N)`` (NCCL EP takes no capacity below the tokens a rank
    sends).

    >>> nccl_ep_rank_budget(topk=8, align=0)(2000, 1.1)
    18022
    >>> nccl_ep_rank_budget(topk=2, align=256)(128, 1.0)
    256
    """

    def rank_budget(num_tokens: int, factor: float) -> int:
        tokens = nccl_ep_max_tokens(num_tokens)
        rows = max(int(tokens * topk * factor), tokens)
        return rows + (-rows % align if align > 1 else 0)

    return rank_budget


@dataclasses.dataclass(frozen=True)
class _Boot:
    group: str
    num_experts: int
    max_tokens: int
    capacity: int
    hidden: int
    topk: int


class NcclEpBootstrap:
    """The process's one NCCL EP bootstrap, as te_paged made it: every layer's dispatcher asks
    for its capacity before each dispatch, and a capacity or token count other than the
    current one re-bootstraps (a collective on the expert-parallel group, taken by every rank
    at the same dispatch: their factors and token counts agree). Host only."""

    current: _Boot | None = None

    @classmethod
    def ensure(cls, manager: Any, capacity: int, max_tokens: int, why: str) -> None:
        from megatron.core.transformer.moe import fused_a2a

        te_ep = fused_a2a.te_ep
        want = _Boot(str(manager.group.group_name), int(manager.num_experts), max_tokens,
                     capacity, int(manager.hidden_dim), int(manager.router_topk))  # fmt: skip
        if cls.current != want or not te_ep._BOOTSTRAPPED:
            before = cls.current
            if te_ep._BOOTSTRAPPED:  # ours at another capacity, or Megatron's (it traps)
                te_ep.ep_finalize()
            cls.current = None
            te_ep.ep_bootstrap(
                manager.group,
                num_experts=want.num_experts,
                max_tokens_per_rank=max_tokens,
                hidden_dim=want.hidden,
                num_topk=want.topk,
                recv_capacity_per_rank=capacity,
                max_num_sms=manager.config.moe_flex_dispatcher_num_sms or 0,
                zero_copy=False,
                drop_on_overflow=True,
            )
            cls.current = want
            was = "" if before is None else f" (was {before.capacity})"
            logger.info(
                "te_paged: NCCL EP bootstrapped with drop_on_overflow, %d receive rows per rank%s "
                "for %d tokens per rank: %s", capacity, was, max_tokens, why,
            )  # fmt: skip
        # What Megatron's manager would have set in its own _ensure_bootstrap.
        manager._max_tokens_per_rank = max_tokens
        manager._recv_capacity = capacity
        manager._bootstrapped = True


class FlexBudget(ReceiveBudget):
    """The :class:`~te_paged.moe.ReceiveBudget` of Megatron's flex dispatcher: the budget rule
    of its ``backend``, HybridEP's (``setup_metadata``: ``int(N·K·factor)`` rounded up to the
    alignment) or NCCL EP's (:func:`nccl_ep_rank_budget`). NCCL EP's budget stays static in
    the rerun (``static_rerun``), sized from :attr:`rerun_rows`."""

    def __init__(
        self,
        config: MoEConfig,
        ep_group: dist.ProcessGroup | None,
        *,
        align: int,
        backend: str = "hybridep",
        device: Any = None,
    ) -> None:
        if backend not in KEPT_BACKENDS:  # before: any other spelling was taken for HybridEP
            raise ValueError(f"FlexBudget backend={backend!r} is not one of {KEPT_BACKENDS}")
        if backend == "ncclep":
            rule = nccl_ep_rank_budget(config.moe_router_topk, align)
        else:
            rule = hybrid_ep_rank_budget(config.moe_router_topk, align, 1)
        super().__init__(config, ep_group, rank_budget=rule, device=device)
        self.static_rerun = backend == "ncclep"


class FlexTokenDispatcher(MegatronRunnerSeams):
    """Megatron's ``MoEFlexTokenDispatcher`` (``inner``), unchanged, plus te_paged's runner
    seams: :attr:`budget` (a :class:`FlexBudget`), the budget or the dropless switch applied
    to Megatron's manager before each dispatch (HybridEP: its capacity factor; NCCL EP: the
    bootstrap's capacity), and Megatron's own ``PagedStashRunner`` seams answered by ``loop``
    (:class:`MegatronRunnerSeams`). Attributes it does not define are ``inner``'s."""

    def __init__(
        self,
        inner: Any,
        config: MoEConfig,
        ep_group: dist.ProcessGroup | None,
        *,
        align: int,
        backend: str = "hybridep",
        device: Any = None,
        loop: MegatronLoopAdapter | None = None,
    ) -> None:
        if config.moe_expert_rank_capacity_factor is None:
            raise ValueError(
                "FlexTokenDispatcher needs moe_expert_rank_capacity_factor (the static "
                "budget); without one Megatron's dispatcher is dropless and needs no runner"
            )
        if backend not in KEPT_BACKENDS:
            raise ValueError(f"backend must be one of {KEPT_BACKENDS}, got {backend!r}")
        ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.inner = inner
        self.config = config
        self.loop = loop
        self.backend = backend
        self.align = align
        self.budget = FlexBudget(
            config, ep_group if ep_size > 1 else None, align=align, backend=backend, device=device
        )
        self._num_tokens = 0
        if backend == "ncclep":
            manager = inner._comm_manager
            if manager.zero_copy:
                raise ValueError(
                    "te_paged keeps Megatron's NCCL EP dispatcher without moe_ncclep_zero_copy: "
                    "its symmetric buffers are sized once, and te_paged re-bootstraps NCCL EP "
                    "at a new capacity after an over-budget rerun; set moe_ncclep_zero_copy=False"
                )
            # te_paged's experts take the static buffer and the device counts on every path
            # (0.19.2 asks for the op fuser before it allows this; te_paged's experts need not).
            manager.static_shape = True

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
        if self.backend == "hybridep":
            # The static budget unless the runner reruns dropless: setup_metadata reads it.
            factor = None if self.budget.dropless else self.budget.capacity_factor
            self.manager.moe_expert_rank_capacity_factor = factor
        self._num_tokens = hidden_states.numel() // hidden_states.shape[-1]
        out = self.inner.dispatch_preprocess(hidden_states, routing_map, probs)
        if self.backend == "hybridep" and getattr(
            self.inner.config, "moe_hybridep_pad_uneven_dispatch_inputs", False
        ):
            # Megatron pads every rank's tokens to the group's largest count (setup_metadata:
            # an all_reduce and a host read) and sizes the budget from that: so does this one.
            self._num_tokens = int(self.manager._padded_num_tokens)
        return out

    def token_dispatch(self, hidden_states: torch.Tensor, probs: Any = None, *args: Any,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if self.backend == "ncclep":
            return self._nccl_ep_dispatch(hidden_states, probs, *args, **kwargs)
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

    def nccl_ep_capacity(self) -> tuple[int, int, str]:
        """``(capacity, max_tokens_per_rank, why)`` of the next NCCL EP dispatch: the budget at
        the factor, or in the runner's dropless rerun the rows its failed attempt demanded
        (:attr:`~te_paged.moe.ReceiveBudget.rerun_rows`; without them, the worst case: every
        token of every rank routed here ``min(K, local experts)`` times). Host only."""
        manager, budget = self.manager, self.budget
        n = self._num_tokens
        max_tokens = nccl_ep_max_tokens(n)
        capacity = budget.rank_budget(n, budget.capacity_factor)
        if not budget.dropless:
            return capacity, max_tokens, f"{budget.factor_name}={budget.capacity_factor:g}"
        local = int(manager.num_local_experts)
        if budget.rerun_rows is not None:
            need, why = budget.rerun_rows, f"the dropless rerun ({budget.rerun_rows} rows demanded)"
        else:
            world = max(1, budget.ep_size)
            need = world * max_tokens * min(int(manager.router_topk), local)
            need += local * max(0, self.align - 1)
            why = "dropless, the worst case"
        need += -need % self.align if self.align > 1 else 0
        return max(capacity, need, max_tokens), max_tokens, why

    def _nccl_ep_dispatch(self, hidden_states: torch.Tensor, probs: Any, *args: Any,
                          **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        manager = self.manager
        capacity, max_tokens, why = self.nccl_ep_capacity()
        NcclEpBootstrap.ensure(manager, capacity, max_tokens, why)
        out, dispatched_probs = self.inner.token_dispatch(hidden_states, probs, *args, **kwargs)
        demanded = manager._buffer.total_recv_tokens.reshape(-1)[:1]
        self.budget.note_dispatch(
            self._num_tokens,
            capacity,
            manager.tokens_per_expert,
            demanded > capacity,  # NCCL EP returns no flag: the demand past the capacity
            out.shape[-1] * out.element_size(),
            demanded=demanded,
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
