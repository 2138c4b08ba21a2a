"""A CPU stand-in for DeepEP's HybridEP (``deep_ep.HybridEPBuffer``) over gloo, for tests only.

HybridEP needs CUDA and NVLink/RDMA; this module reproduces, with plain collectives, the
contract its callers rely on, so that Megatron's ``MoEFlexTokenDispatcher`` (``"hybridep"``)
and torchtitan's HybridEP token dispatcher run on CPU ranks. A test installs it as the
``deep_ep`` module before the caller imports it (``functional_tests/stand_ins/
hybrid_ep_installed.py``); nothing in te_paged imports it.

The contract, as the public callers state it:

* ``HybridEPBuffer(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
  use_fp8=False, **tuning)``; ``buffer.configurer.buffer_config`` holds the sizes
  (megatron-core 0.19.2 ``megatron/core/transformer/moe/fused_a2a.py:328-335``; torchtitan
  0.3.0 ``torchtitan/distributed/deepep/hybridep.py:433-451``, which reads
  ``configurer.buffer_config.{hidden_dim, max_num_of_tokens_per_rank,
  num_of_experts_per_rank}``).
* ``dispatch_with_permute(hidden, routing_map, probs, scaling_factor, num_of_experts_per_rank,
  pad_multiple, num_permuted_tokens, non_blocking)`` returns ``(hidden, probs, scaling_factor,
  tokens_per_expert, handle)``: the rows this rank's local experts receive, grouped by local
  expert (the experts' grouped GEMM reads them by ``tokens_per_expert``), their routing
  probabilities (``[rows]`` float32), and a handle for combine (fused_a2a.py:418-434;
  hybridep.py:160-169). With ``handle=`` (the backward of combine) the same routing is
  replayed for ``hidden`` alone (fused_a2a.py:506-513; hybridep.py:281-287).
* ``num_permuted_tokens`` is the output's row count, given up front so that nothing waits on
  the device (``non_blocking``; fused_a2a.py:414-416); ``None`` sizes it from the routing
  (HybridEP's host wait). Rows "whose permuted offset exceeds that limit are silently dropped"
  (hybridep.py:176-181) and "dispatch then sets overflow_flag on the handle", read as
  ``handle[-1] != 0`` (token_dispatcher.py:1093-1094 and 1159-1161).
* ``pad_multiple`` pads each local expert's rows to a multiple (FP8/MXFP8 GEMM alignment;
  fused_a2a.py:594-596, hybridep.py:390-391: "Pad per-expert token groups to this multiple").
  Megatron's dropless path sizes combine's buffer as ``tokens_per_expert.sum()``
  (token_dispatcher.py:1166-1169), so ``tokens_per_expert`` counts the padded rows.
* ``combine_with_unpermute(hidden, probs=None, handle, pad_multiple)`` returns
  ``(combined [tokens, H], combined_probs)``: each token's rows summed back on its source rank
  (the probabilities were applied by the experts; Megatron applies none in combine,
  torchtitan multiplies before it: hybridep.py:501-509); with ``probs`` (the backward of
  dispatch) also their gradient per (token, expert), ``[tokens, experts]`` (fused_a2a.py:
  453-459; hybridep.py:325-331 gathers it at the top-k indices).
* ``deep_ep.hybrid_ep_buffer.indices_to_map(topk_idx, topk_weights, num_tokens, num_experts)``
  turns top-k indices into the boolean ``[tokens, experts]`` map and dense probabilities
  (hybridep.py:145-149).

Choices where those sources are silent (a test must not depend on them beyond what is stated):
rows within an expert are ordered by (source rank, token); the rows past the budget are the
last in that order (the tail of the last experts); padding rows are zero with probability 0;
``tokens_per_expert`` counts the rows the routing asked for, padded, before any drop (what a
caller needs to size the next attempt); the overflow flag is an int32 ``[1]`` tensor; each
token's contributions are summed in ascending expert order. It moves rows with
``all_gather`` and ``all_to_all_single`` of equal splits (gloo's) and reads counts on the host:
it is slow and not sync-free, which only matters on a GPU, where the real library runs.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["HybridEPBuffer", "hybrid_ep_buffer"]


def indices_to_map(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map [N, E] bool, probs [N, E] float32)`` from top-k indices and weights;
    negative indices (no expert) are skipped."""
    valid = topk_idx >= 0
    idx = topk_idx.clamp(min=0).long()
    # Adds, not writes: a skipped entry (clamped to expert 0) must not undo a routed one.
    hits = torch.zeros(num_tokens, num_experts, dtype=torch.int64, device=topk_idx.device)
    hits.scatter_add_(1, idx, valid.long())
    probs = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=topk_idx.device)
    probs.scatter_add_(1, idx, torch.where(valid, topk_weights.float(), 0.0))
    return hits > 0, probs


class _Handle(tuple):
    """What combine needs; a tuple whose last entry is the overflow flag, as callers read it."""

    __slots__ = ()


class HybridEPBuffer:
    """See the module docstring."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        **tuning: Any,
    ) -> None:
        if use_fp8:
            raise NotImplementedError("the HybridEP stand-in has no FP8 dispatch")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local_experts = num_local_experts
        config = types.SimpleNamespace(
            hidden_dim=hidden_dim,
            max_num_of_tokens_per_rank=max_num_of_tokens_per_rank,
            num_of_experts_per_rank=num_local_experts,
        )
        self.configurer = types.SimpleNamespace(buffer_config=config)
        self.tuning = tuning
        #: Calls, for tests: ("dispatch" | "combine", num_permuted_tokens or None).
        self.calls: list[tuple[str, int | None]] = []

    # ------------------------------------------------------------------------------ helpers

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[P, *t.shape]``: ``t`` from every rank (equal shapes, as HybridEP requires)."""
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return torch.stack(out)

    def _layout(
        self,
        routing_map: torch.Tensor,
        num_local_experts: int,
        pad_multiple: int | None,
        num_permuted_tokens: int | None,
    ) -> _Handle:
        """The receive layout of one routing: per output row its (source rank, token, local
        expert) or -1 (padding or dropped), the kept rows, per-expert counts, the flag."""
        n, experts = routing_map.shape
        local = num_local_experts
        if experts != local * self.world:
            raise ValueError(
                f"routing_map has {experts} experts, not {local} local x {self.world} ranks"
            )
        routing_PNE = self._gather(routing_map.bool())
        mine_PNL = routing_PNE[:, :, self.rank * local : (self.rank + 1) * local]
        pad = pad_multiple or 1
        src, tok, exp, counts = [], [], [], []
        for e in range(local):  # grouped by local expert; (source rank, token) within
            s_idx, t_idx = torch.nonzero(mine_PNL[:, :, e], as_tuple=True)
            rows = s_idx.numel()
            padded = rows + (-rows % pad)
            fill = torch.full((padded - rows,), -1, dtype=torch.int64)
            src += [s_idx, fill]
            tok += [t_idx, fill]
            exp += [torch.full((rows,), e, dtype=torch.int64), fill]
            counts.append(padded)
        src_R, tok_R, exp_R = (torch.cat(x) for x in (src, tok, exp))
        total = src_R.numel()
        out_rows = total if num_permuted_tokens is None else int(num_permuted_tokens)
        overflow = torch.tensor([int(total > out_rows)], dtype=torch.int32)
        keep = slice(0, min(total, out_rows))  # the tail past the budget is dropped
        pad_rows = max(0, out_rows - total)
        empty = torch.full((pad_rows,), -1, dtype=torch.int64)
        src_R = torch.cat([src_R[keep], empty])
        tok_R = torch.cat([tok_R[keep], empty])
        exp_R = torch.cat([exp_R[keep], empty])
        tokens_per_expert = torch.tensor(counts, dtype=torch.int64)
        return _Handle((n, experts, routing_PNE, src_R, tok_R, exp_R, tokens_per_expert,
                        overflow))  # fmt: skip

    # ----------------------------------------------------------------------------- dispatch

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        scaling_factor: torch.Tensor | None = None,
        num_of_experts_per_rank: int | None = None,
        pad_multiple: int | None = None,
        num_permuted_tokens: int | None = None,
        non_blocking: bool = False,
        handle: _Handle | None = None,
        **fused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, torch.Tensor, _Handle]:
        if scaling_factor is not None:
            raise NotImplementedError("the HybridEP stand-in has no FP8 dispatch")
        if handle is None:
            if routing_map is None:
                raise ValueError("dispatch_with_permute needs routing_map or a handle")
            local = num_of_experts_per_rank or self.num_local_experts
            handle = self._layout(routing_map, local, pad_multiple, num_permuted_tokens)
        self.calls.append(("dispatch", None if num_permuted_tokens is None else
                           int(num_permuted_tokens)))  # fmt: skip
        _, experts, _, src_R, tok_R, exp_R, tokens_per_expert, _ = handle
        hidden_PNH = self._gather(hidden)
        real = src_R >= 0
        out_RH = hidden.new_zeros(src_R.numel(), hidden.shape[-1])
        out_RH[real] = hidden_PNH[src_R[real], tok_R[real]]
        out_probs = None
        if probs is not None:
            local = experts // self.world
            probs_PNE = self._gather(probs.float())
            out_probs = torch.zeros(src_R.numel(), dtype=torch.float32)
            cols = self.rank * local + exp_R[real]
            out_probs[real] = probs_PNE[src_R[real], tok_R[real], cols]
        return out_RH, out_probs, None, tokens_per_expert.clone(), handle

    # ------------------------------------------------------------------------------ combine

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: torch.Tensor | None = None,
        handle: _Handle,
        pad_multiple: int | None = None,
        **fused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, experts, routing_PNE, src_R, tok_R, exp_R, _, _ = handle
        self.calls.append(("combine", None))
        local = experts // self.world
        real = src_R >= 0
        if hidden.shape[0] != src_R.numel():
            raise ValueError(
                f"combine got {hidden.shape[0]} rows for a dispatch of {src_R.numel()}"
            )
        combined = self._unpermute(hidden, real, src_R, tok_R, exp_R, n, local, routing_PNE)
        combined_probs = None
        if probs is not None:
            p = self._unpermute(probs.float().reshape(-1, 1), real, src_R, tok_R, exp_R, n,
                                local, routing_PNE, summed=False)  # fmt: skip
            combined_probs = p.reshape(n, experts)
        return combined, combined_probs

    def _unpermute(self, rows_RH, real, src_R, tok_R, exp_R, n, local, routing_PNE, *,
                   summed=True):  # fmt: skip
        """Each received row back to its source rank and token, per expert; summed over the
        token's experts in ascending order (``summed``) or ``[N, E, H]``."""
        width = rows_RH.shape[-1]
        send_PNLH = rows_RH.new_zeros(self.world, n, local, width)
        send_PNLH[src_R[real], tok_R[real], exp_R[real]] = rows_RH[real]
        recv_PNLH = torch.empty_like(send_PNLH)  # from expert rank p, for my tokens
        dist.all_to_all_single(recv_PNLH, send_PNLH, group=self.group)
        per_expert_NEH = recv_PNLH.permute(1, 0, 2, 3).reshape(n, self.world * local, width)
        if not summed:
            return per_expert_NEH
        routed_NE = routing_PNE[self.rank]
        k = max(1, int(routed_NE.sum(1).max()))  # the stand-in's host read
        order_NE = torch.sort((~routed_NE).to(torch.uint8), dim=1, stable=True).indices
        idx_NK = order_NE[:, :k]
        picked_NKH = per_expert_NEH.gather(1, idx_NK.unsqueeze(-1).expand(n, k, width))
        picked_NKH = picked_NKH * routed_NE.gather(1, idx_NK).unsqueeze(-1).to(rows_RH.dtype)
        return picked_NKH.sum(1)


hybrid_ep_buffer = types.ModuleType("deep_ep.hybrid_ep_buffer")
hybrid_ep_buffer.HybridEPBuffer = HybridEPBuffer
hybrid_ep_buffer.indices_to_map = indices_to_map
