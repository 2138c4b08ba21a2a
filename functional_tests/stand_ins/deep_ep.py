"""A CPU stand-in for DeepEP's HybridEP (``deep_ep.HybridEPBuffer``) over gloo, for tests only.

HybridEP needs CUDA and NVLink/RDMA; this module reproduces, with plain collectives, the
contract its callers rely on, so that Megatron's ``MoEFlexTokenDispatcher`` (``"hybridep"``)
and torchtitan's HybridEP token dispatcher run on CPU ranks. A test installs it as the
``deep_ep`` module before the caller imports it (``functional_tests/stand_ins/
hybrid_ep_installed.py``); nothing in te_paged imports it.

The contract, from DeepEP's source (``deepseek-ai/DeepEP``, branch ``hybrid-ep`` at
``94a9f8f``: ``deep_ep/hybrid_ep_buffer.py`` = PY, ``csrc/hybrid_ep/hybrid_ep.cu`` = CU,
``csrc/hybrid_ep/executor/executor.cu`` = EX, ``csrc/hybrid_ep/extension/permute.cu`` = PERM,
``csrc/hybrid_ep/backend/hybrid_ep_backend.cuh`` = BK) and its callers (megatron-core 0.19.2
``megatron/core/transformer/moe/fused_a2a.py`` = MEG; torchtitan 0.3.0
``torchtitan/distributed/deepep/hybridep.py`` = TT):

* ``HybridEPBuffer(group, hidden_dim, max_num_of_tokens_per_rank, num_local_experts,
  use_fp8=False, **tuning)`` (PY:35-56; MEG:339-346); ``configurer.buffer_config`` holds the
  sizes torchtitan reads (TT:433-451).
* ``dispatch_with_permute(*, hidden, routing_map, probs, scaling_factor, num_of_experts_per_rank,
  pad_multiple, num_permuted_tokens, non_blocking, handle)`` (PY:289-432) returns ``(hidden,
  probs, scaling_factor, tokens_per_expert, handle)`` (PY:414-432): the rows this rank's local
  experts receive, grouped by local expert in ascending order, within an expert by source rank
  then source token (BK:4908-4915, 5160-5190), each expert's block padded with zero rows to
  ``pad_multiple`` (PERM:191-233); probabilities ``[rows]`` float32 (CU:315-317). With
  ``handle=`` (combine's backward) the same routing and drops are replayed (PY:380-397).
* ``num_permuted_tokens`` given: exactly that many rows (CU:313-314), and with ``pad_multiple``
  it must be a multiple of it (PY:351-356); the rows past the used ones are not written
  (uninitialised: CU:313-317). ``None``: sized to the routing after a host wait (EX:165-176).
* Past the budget: a row whose position in that padded layout is at or past
  ``num_permuted_tokens`` is dropped (BK:5430-5432), a cut at the tail of the last experts;
  the overflow flag, ``handle[-1]``, int32 ``[1]`` (EX:117-118), is 1 when the padded demand
  exceeds the budget (BK:5212-5220), and is written only with ``non_blocking`` (otherwise it
  holds garbage: JIT:304, EX:135-146). ``tokens_per_expert`` (int64 ``[local experts]``) counts
  the rows *kept*, padded (BK:5191-5211; PERM:46-61): not the routing's demand.
* ``combine_with_unpermute(*, hidden, probs=None, handle, pad_multiple=None)`` returns
  ``(combined [tokens, H], combined_probs)`` (PY:434-479): each token's rows summed back on its
  source rank, unweighted (callers apply the probabilities: Megatron in the experts, TT before
  combine); with ``probs`` (dispatch's backward) also their gradient per (token, expert),
  ``[tokens, experts]``, zero where not routed or dropped (PERM:340-353).
* ``deep_ep.hybrid_ep_buffer.indices_to_map(topk_idx, topk_weights, num_tokens,
  num_experts)`` turns top-k indices into the boolean map and dense probabilities (TT:145-149).

What the real library would misbehave on, the stand-in refuses: a blocking dispatch with a
budget smaller than the padded rows (DeepEP writes past the buffer), a non-bool routing map or
non-float32 probabilities, a negative top-k index, unequal token counts across ranks, a replay
of another size, and the options it does not implement (FP8, the fused permute kernels, the
top-k form, ``use_host_meta``). It takes any 2-byte or 4-byte hidden dtype (DeepEP's combine
takes bf16 or fp16 only: the CPU tests run fp32 models too).

The stand-in's own choices: uninitialised rows are NaN (so a reader of them is seen), the
blocking mode's flag is -7 (garbage), each token's rows are summed in ascending expert order
(DeepEP accumulates in fp32; the tests compare runs that share this stand-in), and it moves
rows with ``all_gather`` and ``all_to_all_single`` of equal splits (gloo's) and reads counts
on the host: slow and not sync-free, which only matters on a GPU, where the real library runs.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

from functional_tests.stand_ins._common import gather, sum_in_expert_order

__all__ = ["HybridEPBuffer", "hybrid_ep_buffer"]


def indices_to_map(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map [N, E] bool, probs [N, E] float32)`` from top-k indices and weights, as
    DeepEP scatters them (PY:9-31). DeepEP has no "no expert" index: a negative one is an
    out-of-bounds scatter there, refused here."""
    if (topk_idx < 0).any() or (topk_idx >= num_experts).any():
        raise IndexError(f"topk_idx must lie in [0, {num_experts}): DeepEP scatters it as is")
    idx = topk_idx.long()
    routing = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=topk_idx.device)
    routing.scatter_(1, idx, True)
    probs = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=topk_idx.device)
    probs.scatter_(1, idx, topk_weights.float())
    return routing, probs


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
        return gather(t, self.group, self.world)

    def _layout(
        self,
        routing_map: torch.Tensor,
        num_local_experts: int,
        pad_multiple: int | None,
        num_permuted_tokens: int | None,
        non_blocking: bool,
    ) -> _Handle:
        """The receive layout of one routing: per output row its (source rank, token, local
        expert) or -1 (padding or dropped), the kept rows, per-expert counts, the flag."""
        n, experts = routing_map.shape
        local = num_local_experts
        if experts != local * self.world:
            raise ValueError(
                f"routing_map has {experts} experts, not {local} local x {self.world} ranks"
            )
        if routing_map.dtype != torch.bool:  # PY:340
            raise TypeError(f"routing_map must be torch.bool, got {routing_map.dtype}")
        counts = self._gather(torch.tensor([n]))
        if not (counts == n).all():  # HybridEP's buffers are sized for equal counts
            raise ValueError(f"every rank must dispatch the same number of tokens, got "
                             f"{counts.tolist()}")  # fmt: skip
        routing_PNE = self._gather(routing_map)
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
        if non_blocking and num_permuted_tokens is None:
            raise ValueError("non_blocking dispatch needs num_permuted_tokens")
        out_rows = total if num_permuted_tokens is None else int(num_permuted_tokens)
        if num_permuted_tokens is not None and non_blocking and out_rows % pad:
            raise ValueError(f"num_permuted_tokens={out_rows} is not a multiple of {pad}")
        if total > out_rows and not non_blocking:
            # DeepEP's blocking mode takes the caller's num_permuted_tokens as the allocation
            # and permutes at unbounded offsets (EX:168, CU:313-319, PERM:144-154): past it.
            raise RuntimeError(
                f"blocking dispatch of {total} padded rows into num_permuted_tokens={out_rows}: "
                "DeepEP writes past the buffer here (only non_blocking mode drops and flags)"
            )
        flag = int(total > out_rows) if non_blocking else -7  # blocking: never written
        overflow = torch.tensor([flag], dtype=torch.int32)
        used = min(total, out_rows)  # the tail past the budget is dropped
        starts = torch.tensor([0, *counts]).cumsum(0)[:-1]
        kept = (used - starts).clamp(min=0).minimum(torch.tensor(counts))
        unused = torch.full((out_rows - used,), -2, dtype=torch.int64)  # never written
        src_R = torch.cat([src_R[:used], unused])
        tok_R = torch.cat([tok_R[:used], unused])
        exp_R = torch.cat([exp_R[:used], unused])
        return _Handle((n, experts, routing_PNE, src_R, tok_R, exp_R, kept.to(torch.int64),
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
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        num_of_experts: int | None = None,
        use_host_meta: bool | None = None,
        fuse_permute_dispatch: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None, torch.Tensor, _Handle]:
        # DeepEP's options the stand-in does not implement are refused, not swallowed.
        if scaling_factor is not None:
            raise NotImplementedError("the HybridEP stand-in has no FP8 dispatch")
        if fuse_permute_dispatch:
            raise NotImplementedError("the HybridEP stand-in has no fused permute-dispatch")
        if topk_idx is not None or topk_weights is not None or num_of_experts is not None:
            raise NotImplementedError("the HybridEP stand-in takes routing_map (indices_to_map "
                                      "makes it from top-k indices)")  # fmt: skip
        if use_host_meta is not None:
            raise NotImplementedError("use_host_meta (deprecated in DeepEP: it flips "
                                      "non_blocking): pass non_blocking")  # fmt: skip
        if probs is not None and probs.dtype != torch.float32:  # CU:285
            raise TypeError(f"probs must be float32, got {probs.dtype}")
        if handle is not None and num_permuted_tokens is not None:
            if int(num_permuted_tokens) != handle[3].numel():  # DeepEP allocates what is asked
                raise ValueError(f"a replay of {handle[3].numel()} rows asked for "
                                 f"num_permuted_tokens={int(num_permuted_tokens)}")  # fmt: skip
        if handle is None:
            if routing_map is None:
                raise ValueError("dispatch_with_permute needs routing_map or a handle")
            local = num_of_experts_per_rank or self.num_local_experts
            handle = self._layout(
                routing_map, local, pad_multiple, num_permuted_tokens, non_blocking
            )
        self.calls.append(("dispatch", None if num_permuted_tokens is None else
                           int(num_permuted_tokens)))  # fmt: skip
        _, experts, _, src_R, tok_R, exp_R, tokens_per_expert, _ = handle
        hidden_PNH = self._gather(hidden)
        real, unwritten = src_R >= 0, src_R == -2
        out_RH = hidden.new_zeros(src_R.numel(), hidden.shape[-1])
        out_RH[real] = hidden_PNH[src_R[real], tok_R[real]]
        out_RH[unwritten] = float("nan")
        out_probs = None
        if probs is not None:
            local = experts // self.world
            probs_PNE = self._gather(probs)
            out_probs = torch.zeros(src_R.numel(), dtype=torch.float32)
            cols = self.rank * local + exp_R[real]
            out_probs[real] = probs_PNE[src_R[real], tok_R[real], cols]
            out_probs[unwritten] = float("nan")
        return out_RH, out_probs, None, tokens_per_expert.clone(), handle

    # ------------------------------------------------------------------------------ combine

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: torch.Tensor | None = None,
        handle: _Handle,
        pad_multiple: int | None = None,
        fuse_unpermute_combine: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if fuse_unpermute_combine:
            raise NotImplementedError("the HybridEP stand-in has no fused unpermute-combine")
        n, experts, routing_PNE, src_R, tok_R, exp_R, _, _ = handle
        self.calls.append(("combine", None))
        local = experts // self.world
        real = src_R >= 0
        if hidden.shape[0] != src_R.numel():
            raise ValueError(
                f"combine got {hidden.shape[0]} rows for a dispatch of {src_R.numel()}"
            )
        combined = self._unpermute(hidden, real, src_R, tok_R, exp_R, n, local, routing_PNE)
        # HybridEP's combine is one kernel on every rank, whatever each passes (``with_probs``
        # is each rank's own: PY:434-479). Here the probabilities are a second all_to_all,
        # which every rank must make: a rank that received no rows has no gradient to send back
        # (torchtitan passes ``probs=None`` there: TT:303) and sends zeros, or the ranks'
        # collectives fall out of step (a full torchtitan step hung).
        sent = probs.float().reshape(-1, 1) if probs is not None else hidden.new_zeros(
            hidden.shape[0], 1, dtype=torch.float32)  # fmt: skip
        p = self._unpermute(sent, real, src_R, tok_R, exp_R, n, local, routing_PNE, summed=False)
        return combined, None if probs is None else p.reshape(n, experts)

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
        return sum_in_expert_order(per_expert_NEH, routing_PNE[self.rank])


hybrid_ep_buffer = types.ModuleType("deep_ep.hybrid_ep_buffer")
hybrid_ep_buffer.HybridEPBuffer = HybridEPBuffer
hybrid_ep_buffer.indices_to_map = indices_to_map
