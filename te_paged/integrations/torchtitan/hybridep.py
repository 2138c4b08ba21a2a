"""torchtitan's HybridEP token dispatcher, made safe: a step that dropped tokens is rerun.

torchtitan 0.3.0's ``HybridEPTokenDispatcher`` with ``non_blocking_capacity_factor`` (its
static, sync-free mode) sizes the receive buffer as ``T · EP · min(local experts, K) · factor``
(``torchtitan/distributed/deepep/hybridep.py``, ``_num_permuted_tokens_for_non_blocking``) and
drops the rows past it without reading HybridEP's overflow flag: "tokens whose permuted offset
exceeds that limit are silently dropped" (the same file, in ``_dispatch_impl``). So a step
whose routing overran the budget trains on fewer tokens, and nothing says so.

:class:`PagedHybridEPTokenDispatcher` is that dispatcher, unchanged in what it sends, plus
te_paged's :class:`~te_paged.moe.ReceiveBudget`: after each dispatch it adds the handle's
overflow flag (its last entry, read on the device) to the budget's over-budget counter, which
:class:`~te_paged.integrations.torchtitan.PagedStashTrainer`'s per-step reduction reads, so the
step reruns dropless instead of being kept; the runner then raises the factor to the step's
peak x ``capacity_headroom`` (at most 1.0, the worst case).

The rerun does not use HybridEP's blocking mode (a buffer of the rows this rank receives, sized
after a host wait). There, a rank that receives no rows gets an empty buffer; torchtitan's
dispatch backward then passes combine no probabilities (``_combine_bwd_impl``: ``probs=None``
when ``grad_scores`` is empty), so that rank's tokens' routing weights get no gradient, its
router's ``grad`` stays ``None``, and FSDP's reduce-scatter of the layer has another size on that
rank than on the others: a hang or an abort (found with every rank's routing skewed to one
expert). The rerun keeps the non-blocking mode with the smallest factor whose buffer holds the
most rows any rank receives in that dispatch (:meth:`PagedHybridEPTokenDispatcher.rerun_factor`:
one all_reduce of the per-expert counts and a host read per dispatch, in the rerun only):
every rank gets the same non-empty buffer, nothing is dropped, and every routing weight its
gradient. The rerun reads HybridEP's overflow flag as well: should it drop rows after all (its
factor too small), every rank raises, naming the rows kept and needed, and the step is not
kept. The experts get the counts clipped to the buffer
(:func:`~te_paged.moe.kept_per_expert`). :func:`~te_paged.integrations.torchtitan.convert_moe`
keeps a ``HybridEPTokenDispatcher.Config`` as this one's config.

With ``pad_multiple`` (torchtitan's MXFP8 converter sets it) HybridEP pads every local expert's
block, so factor 1.0 is not the worst case any more (:func:`padded_worst_case_rows`: up to
``local·(P − 1)`` rows more): the budget's ceiling is then the factor that holds the padded
worst case, and the runner grows the factor past 1.0 when a step needs it, instead of rerunning
every step.

torchtitan's MinimalAsyncEP cannot overflow: its receive buffer is the worst case,
``EP · T · min(K, local experts)`` rows (``torchtitan/models/common/token_dispatcher.py``,
``MinimalAsyncEPTokenDispatcher.dispatch``; ``distributed/minimal_async_ep/api.py``, the
buffer's ``max_routed_tokens``), so there is no drop to rerun, and te_paged does not convert
it (its experts keep torchtitan's).

Importing this module imports torchtitan (and registers its HybridEP custom ops); HybridEP
itself (``deep_ep``) is imported when the buffer is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.models.common.token_dispatcher import HybridEPTokenDispatcher

from te_paged.config import MoEConfig
from te_paged.moe import ReceiveBudget, kept_per_expert

__all__ = ["PagedHybridEPTokenDispatcher", "padded_worst_case_rows"]


def padded_worst_case_rows(num_tokens: int, ep: int, local: int, topk: int, pad: int) -> int:
    """The most rows HybridEP's permute can hand one rank for ``num_tokens`` tokens on each of
    ``ep`` ranks, ``local`` experts a rank, top-``topk``, each local expert's block rounded up
    to ``pad`` rows (DeepEP ``hybrid_ep_backend.cuh``:5170-5187: expert ``i`` starts at
    ``Σ_{j<i} ⌈c_j/P⌉·P``). With ``N = ep·num_tokens`` tokens that can reach the rank and
    ``S = N·min(local, topk)`` routed rows at most (``c_i ≤ N``, ``Σ c_i ≤ S``), the blocks
    are fewest-rows-first ``⌈c_i/P⌉``: at most ``min(local·⌈N/P⌉, local + ⌊(S − local)/P⌋)``
    of ``P`` rows. Without padding (``P = 1``) that is ``S``, torchtitan's buffer at factor
    1.0; with it up to ``local·(P − 1)`` rows more, so factor 1.0 can drop.

    >>> padded_worst_case_rows(4, 2, 4, 2, 1), padded_worst_case_rows(4, 2, 4, 2, 4)
    (16, 28)
    """
    n = ep * num_tokens
    s = n * min(local, topk)
    if s <= local:
        return s * pad
    blocks = min(local * -(-n // pad), local + (s - local) // pad)
    return blocks * pad


class PagedHybridEPTokenDispatcher(HybridEPTokenDispatcher):
    """See the module docstring. Config: torchtitan's ``HybridEPTokenDispatcher.Config``;
    ``non_blocking_capacity_factor`` must be set (the static budget; ``None``, torchtitan's
    blocking mode, drops nothing and leaves nothing for a stash to cut)."""

    @dataclass(kw_only=True, slots=True)
    class Config(HybridEPTokenDispatcher.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        factor = config.non_blocking_capacity_factor
        padded = (config.pad_multiple or 1) > 1
        if factor is None or not 0 < factor <= (math.inf if padded else 1):
            raise ValueError(
                "te_paged keeps torchtitan's HybridEP dispatcher in its non-blocking mode only: "
                f"set non_blocking_capacity_factor in (0, 1] (got {factor!r}; above 1 only "
                "with pad_multiple); the blocking mode waits on the host every layer and its "
                "buffers hold only real rows, so there is nothing for paged stash to cut"
            )
        self.capacity_factor = factor
        self._budget: ReceiveBudget | None = None

    def max_factor(self, num_tokens: int) -> float:
        """The factor whose buffer holds the worst case for ``num_tokens`` tokens a rank: 1.0,
        or more with ``pad_multiple`` (:func:`padded_worst_case_rows`), the most the runner
        grows the budget to: a step that needs more cannot happen."""
        ep = self.ep_mesh.size()
        local, pad = self.num_experts // ep, self.pad_multiple or 1
        worst = padded_worst_case_rows(num_tokens, ep, local, self.top_k, pad)
        return self._budget.smallest_factor(num_tokens, worst)

    def rerun_factor(self, num_tokens: int, topk_expert_ids_TK: torch.Tensor) -> float:
        """The factor of a dropless rerun's dispatch (see the module docstring): the smallest
        whose buffer holds the rows the most loaded rank of the group receives, each local
        expert's block padded to ``pad_multiple``: this rank's routing counted per expert
        (from the expert ids HybridEP routes by), summed over the group (one ``all_reduce``
        and a host read; every rank gets the same)."""
        rows = max(1, int(self._padded_demand(topk_expert_ids_TK).max()))
        return self._budget.smallest_factor(num_tokens, rows)

    def _padded_demand(self, topk_expert_ids_TK: torch.Tensor) -> torch.Tensor:
        """Rows each rank of the group receives in this dispatch, each local expert's block
        padded to ``pad_multiple``: this rank's routing counted per expert, summed over the
        group (one ``all_reduce``; a device tensor ``[ep]``)."""
        ep = self.ep_mesh.size()
        ids = topk_expert_ids_TK.reshape(-1).to(torch.int64)
        counts = torch.bincount(ids, minlength=self.num_experts)
        dist.all_reduce(counts, group=self.ep_mesh.get_group())
        pad = self.pad_multiple or 1
        per_rank = (torch.div(counts + pad - 1, pad, rounding_mode="floor") * pad).view(ep, -1)
        return per_rank.sum(1)

    def budget(self, device: torch.device | str) -> ReceiveBudget:
        """The runner-facing counters, built on first use with the wired EP group."""
        if self._budget is None:
            if self.ep_mesh is None:
                raise RuntimeError("HybridEP dispatches over an EP mesh: wire_meshes first")
            from torchtitan.distributed.deepep.hybridep import (
                _num_permuted_tokens_for_non_blocking,
            )

            group, ep = self.ep_mesh.get_group(), self.ep_mesh.size()
            local = self.num_experts // ep

            def rule(num_tokens: int, factor: float) -> int:
                return _num_permuted_tokens_for_non_blocking(
                    num_tokens, ep, local, self.top_k, factor, pad_multiple=self.pad_multiple
                )

            config = MoEConfig(
                hidden_size=self.hidden_dim,
                num_moe_experts=self.num_experts,
                moe_router_topk=self.top_k,
                moe_expert_rank_capacity_factor=self.capacity_factor,
                expert_model_parallel_size=ep,
            )
            # The worst case without padding; with it, set from the tokens at each dispatch.
            self._budget = ReceiveBudget(
                config, group, rank_budget=rule, max_factor=None if self.pad_multiple else 1.0,
                factor_name="non_blocking_capacity_factor", device=device,
            )  # fmt: skip
        return self._budget

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        budget = self.budget(x_TD.device)
        if self.pad_multiple:
            budget.max_factor = self.max_factor(x_TD.shape[0])
        # The static budget, or for the runner's dropless rerun one that holds this dispatch.
        static = not budget.dropless
        self.non_blocking_capacity_factor = (
            budget.capacity_factor
            if static
            else self.rerun_factor(x_TD.shape[0], topk_expert_ids_TK)
        )
        routed_RD, counts_e, metadata = super().dispatch(
            x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
        )
        handle = metadata.state.handle.value
        budget.note_dispatch(
            x_TD.shape[0],
            routed_RD.shape[0] if static else 0,
            counts_e,
            handle[-1] if static else None,
            routed_RD.shape[-1] * routed_RD.element_size(),
        )
        if not static:
            self._check_rerun(handle[-1], topk_expert_ids_TK, routed_RD.shape[0])
        return routed_RD, kept_per_expert(counts_e, routed_RD.shape[0]), metadata

    def _check_rerun(self, overflow: torch.Tensor, topk_expert_ids_TK: torch.Tensor,
                     rows: int) -> None:  # fmt: skip
        """A dropless rerun reads its own overflow flag: a rerun that dropped rows is no
        dropless reference, and its step must not be kept. Every rank of the group learns it,
        with the most rows a rank needed (counted from the routing, apart from the factor the
        rerun was given; two ``all_reduce`` and a host read, in the rerun only, as
        :meth:`rerun_factor`'s), so all raise together, naming the rows kept and needed."""
        dropped = (overflow.reshape(-1) != 0).any().to(torch.int64).reshape(1)
        dist.all_reduce(dropped, op=dist.ReduceOp.MAX, group=self.ep_mesh.get_group())
        if int(dropped):
            most = int(self._padded_demand(topk_expert_ids_TK).max())
            raise RuntimeError(
                f"the dropless rerun's HybridEP dispatch dropped rows: its buffer kept {rows} "
                f"rows a rank, and a rank needed {most} (each local expert's block padded to "
                f"{self.pad_multiple or 1}); its step is not kept (the rerun's factor did not "
                "hold that demand)"
            )
