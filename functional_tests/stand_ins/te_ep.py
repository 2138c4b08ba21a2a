"""A CPU stand-in for Transformer Engine's NCCL EP (``transformer_engine.pytorch.ep``) over gloo,
for tests only.

NCCL EP needs CUDA, NCCL >= 2.30.4 and a Transformer Engine built with it; this module
reproduces, with plain collectives, the contract megatron-core 0.19.2's ``"ncclep"`` flex
backend (``_NCCLEPManager``) and te_paged rely on, in Transformer Engine's drop-on-overflow
release (2.19 and later). A test installs it into megatron-core's ``fused_a2a``
(``functional_tests/stand_ins/nccl_ep_installed.py``); nothing in te_paged imports it.

The contract, as read in ``docs/dev/ncclep-contract.md`` (TE = ``NVIDIA/TransformerEngine``
main at ``d0067d0da``, ``transformer_engine/pytorch/ep.py``; NE = ``NVIDIA/nccl-extensions`` at
``9f47d6eb``, ``nccl_ep/``; MC = megatron-core 0.19.2, ``megatron/core/transformer/moe/``):

* ``ep_bootstrap(ep_group, num_experts, max_tokens_per_rank, hidden_dim, num_topk,
  recv_capacity_per_rank=None, max_num_sms=0, zero_copy=False, drop_on_overflow=False,
  max_token_dtype=bf16)`` once per process (TE:101-183: a second call raises, a group of one
  rank, ``num_topk < 1`` and drop without a capacity are refused); ``ep_finalize()`` tears it
  down and a later ``ep_bootstrap`` starts again (TE:191-211; TE's own JAX test re-bootstraps
  with a smaller capacity, ``tests/jax/test_multi_process_ep.py``:17, 859-875).
  ``_BOOTSTRAPPED`` is the flag megatron-core reads (MC ``fused_a2a.py``:648).
* ``EpBuffer(top_k, max_tokens_per_rank, hidden_dim, num_local_experts,
  recv_capacity_per_rank=None, alignment=0, ...)`` (TE:237-322): needs the bootstrap, an
  alignment of 0, 1 or a power of two; ``tokens_per_expert`` int64 ``[local experts]`` and
  ``total_recv_tokens`` int64 ``[1]``, both on the device, written by each dispatch.
* ``ep_dispatch(buffer, tokens, topk_idx, topk_weights, *, recv_tokens=None,
  recv_topk_weights=None)`` (TE:830-904) returns ``(recv_tokens [capacity, H], recv_topk_weights
  [capacity] float32, tokens_per_expert)``; ``topk_weights`` must be float32 (TypeError).
  The layout is expert-major: local expert ``k``'s zone starts at ``expert_base[k]``, the
  prefix sum of the per-expert counts padded to ``alignment``; inside it the real rows in
  global token order (source rank, then token), then zero padding rows with zero weights
  (NE ``device/scan_kernel.cuh``:339, 720-741; ``ht_ep.cuh``:5196-5215).
* Past the capacity (drop mode): a hit whose slot ``expert_base[k] + j`` is at or past the
  capacity is dropped (NE ``ht_ep.cuh``:229-236; ``scan_kernel.cuh``:345-349): whole lower
  experts are kept, the boundary expert loses its tail (highest source ranks and tokens), the
  experts after it everything. If even the tokens this rank receives (each once) exceed the
  capacity, the last of them in global order lose every hit first ("deep FLAT overflow",
  ``scan_kernel.cuh``:449, 463-464), their slots staying in the counts as zero rows.
  ``tokens_per_expert[k] = min(padded_k, max(0, capacity - expert_base[k]))``: kept padded rows
  (``scan_kernel.cuh``:725-741). ``total_recv_tokens`` is the demand before any drop, padded
  (:744-760): over the capacity exactly when something was dropped; no flag is returned.
  NCCL EP zeroes the receive buffers before a drop-mode dispatch (``nccl_ep.cc``:4123-4148), so
  every row not kept reads back zero. Without drop, demand past the capacity traps the device
  (MC ``fused_a2a.py``:638-639): here a ``RuntimeError`` on every rank.
* ``ep_combine(buffer, expert_out, *, num_local_tokens=None, grad_out=None)`` (TE:907-950):
  ``[num_local_tokens, H]``, each token's kept rows summed back unweighted; a dropped hit adds
  zero, a token dropped everywhere comes back zero (NE ``ht_ep.cuh``:5330-5420, 3720-3794).
  Backward: a dispatched row's gradient goes back to its token (summed over its kept hits), a
  kept hit's weight gradient to its ``topk_weights`` entry, zero for dropped hits (:5375).

The stand-in's own choices: float32 tokens are accepted beside bfloat16 (TE refuses anything
but bfloat16, TE:705-710; the CPU tests' models are float32, as for the HybridEP stand-in); an
``EpBuffer`` must ask for the bootstrap's capacity (NCCL EP sizes its drops by the group's,
``ep_backend.cpp``:246, so a smaller buffer would be written past its end); each token's rows
are summed in ascending expert order, like the HybridEP stand-in's; rows move by
``all_gather`` (gloo's) and counts are read on the host: slow and not sync-free, which only
matters on a GPU, where the real library runs. ``ALLOW_ONE_RANK`` lets a one-rank unit test
bootstrap (TE refuses a group of one rank). Eager mode, zero-copy and MXFP8 payloads are not
reproduced (``NotImplementedError``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from functional_tests.stand_ins._common import gather, sum_in_expert_order

__all__ = ["EpBuffer", "ep_bootstrap", "ep_combine", "ep_dispatch", "ep_finalize"]

_BOOTSTRAPPED = False
#: Tests only: let a one-rank group bootstrap (TE requires two ranks or more).
ALLOW_ONE_RANK = False


@dataclasses.dataclass(frozen=True)
class _Group:
    group: dist.ProcessGroup
    num_experts: int
    max_tokens_per_rank: int
    capacity: int
    hidden_dim: int
    num_topk: int
    drop: bool


_GROUP: _Group | None = None
#: Every bootstrap of this process, for tests: (capacity, drop_on_overflow).
bootstraps: list[tuple[int, bool]] = []


def ep_bootstrap(
    ep_group: dist.ProcessGroup,
    num_experts: int,
    max_tokens_per_rank: int,
    hidden_dim: int,
    num_topk: int,
    recv_capacity_per_rank: int | None = None,
    max_num_sms: int = 0,
    zero_copy: bool = False,
    drop_on_overflow: bool = False,
    max_token_dtype: torch.dtype = torch.bfloat16,
) -> None:
    global _BOOTSTRAPPED, _GROUP
    if _BOOTSTRAPPED:
        raise RuntimeError("ep_bootstrap was already called in this process")
    if ep_group.size() < 2 and not ALLOW_ONE_RANK:
        raise ValueError(f"ep_bootstrap requires ep_group.size() >= 2 (got {ep_group.size()}).")
    if num_topk < 1:
        raise ValueError(f"ep_bootstrap requires num_topk >= 1 (got {num_topk}).")
    if recv_capacity_per_rank is None:
        if drop_on_overflow:
            raise ValueError("ep_bootstrap: drop_on_overflow requires recv_capacity_per_rank")
        raise NotImplementedError("the NCCL EP stand-in has no eager mode")
    if zero_copy:
        raise NotImplementedError("the NCCL EP stand-in has no zero-copy path")
    if num_experts % ep_group.size():
        raise ValueError(f"{num_experts} experts do not divide over {ep_group.size()} ranks")
    if recv_capacity_per_rank < max_tokens_per_rank:  # NCCL EP's HT mode (TE's JAX test: 853)
        raise ValueError(
            f"recv_capacity_per_rank {recv_capacity_per_rank} < max_tokens_per_rank "
            f"{max_tokens_per_rank}"
        )
    dist.barrier(group=ep_group)
    _GROUP = _Group(ep_group, int(num_experts), int(max_tokens_per_rank),
                    int(recv_capacity_per_rank), int(hidden_dim), int(num_topk),
                    bool(drop_on_overflow))  # fmt: skip
    _BOOTSTRAPPED = True
    bootstraps.append((int(recv_capacity_per_rank), bool(drop_on_overflow)))


def is_ep_bootstrapped() -> bool:
    return _BOOTSTRAPPED


def ep_finalize() -> None:
    global _BOOTSTRAPPED, _GROUP
    _BOOTSTRAPPED, _GROUP = False, None


class EpBuffer:
    """Per-dispatch state: the counts the dispatch writes, and (the stand-in's ``handle_mem``)
    the routing table combine and the backwards read."""

    def __init__(
        self,
        top_k: int,
        max_tokens_per_rank: int,
        hidden_dim: int,
        num_local_experts: int,
        recv_capacity_per_rank: int | None = None,
        alignment: int = 0,
        payload_dtype: torch.dtype = torch.bfloat16,
        device: Any = None,
        **quant_recipes: Any,
    ) -> None:
        if not _BOOTSTRAPPED or _GROUP is None:
            raise RuntimeError("EpBuffer requires ep_bootstrap() to be called first.")
        alignment = int(alignment)
        if alignment > 1 and alignment & (alignment - 1):
            raise ValueError(f"alignment must be 0, 1, or a power of two (got {alignment}).")
        if recv_capacity_per_rank is None:
            raise ValueError(
                "EpBuffer requires recv_capacity_per_rank unless the EP group was "
                "bootstrapped in eager mode (recv_capacity_per_rank omitted)."
            )
        if int(recv_capacity_per_rank) != _GROUP.capacity:
            raise ValueError(
                f"EpBuffer asks for {recv_capacity_per_rank} receive rows; the bootstrap's "
                f"capacity is {_GROUP.capacity} (the stand-in's check: NCCL EP drops by the "
                "group's capacity)"
            )
        if any(v is not None for v in quant_recipes.values()):
            raise NotImplementedError("the NCCL EP stand-in has no MXFP8 payloads")
        self.group = _GROUP
        self.top_k = int(top_k)
        self.alignment = alignment
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.recv_capacity_per_rank = int(recv_capacity_per_rank)
        self.hidden_dim = int(hidden_dim)
        self.num_local_experts = int(num_local_experts)
        self.payload_dtype = payload_dtype
        dev = torch.device("cpu") if device is None else torch.device(device)
        self.tokens_per_expert = torch.empty(self.num_local_experts, dtype=torch.int64, device=dev)
        self.total_recv_tokens = torch.empty(1, dtype=torch.int64, device=dev)
        self.handle_mem: _Layout | None = None


@dataclasses.dataclass
class _Layout:
    """One dispatch's routing over the group: per (source rank, token, k) the destination rank
    and slot (-1: dropped or not routed), per receive slot of this rank its (source rank,
    token, k) (-1: padding or unused), the tokens' expert map."""

    world: int
    rank: int
    group: dist.ProcessGroup
    num_tokens: list[int]  # per source rank
    dest_PTK: torch.Tensor  # destination rank
    slot_PTK: torch.Tensor  # slot there, -1 where dropped
    idx_PTK: torch.Tensor  # global expert ids (-1: none)
    src_S3: torch.Tensor  # [capacity, 3] (p, t, k) of each receive slot of this rank
    num_experts: int


def _layout(buffer: EpBuffer, topk_idx: torch.Tensor) -> tuple[_Layout, torch.Tensor, int]:
    """Every rank's receive layout (each rank computes all of them from the gathered routing,
    as NCCL EP does in ``ep_prepare``); this rank's kept counts and demand."""
    g = buffer.group
    world, rank = g.group.size(), dist.get_rank(g.group)
    t_local, k = topk_idx.shape
    if k != buffer.top_k:
        raise ValueError(f"topk_idx has {k} columns, the buffer's top_k is {buffer.top_k}")
    if t_local > buffer.max_tokens_per_rank:
        raise ValueError(f"{t_local} tokens > max_tokens_per_rank {buffer.max_tokens_per_rank}")
    counts = gather(torch.tensor([t_local]), g.group, world).reshape(-1).tolist()
    padded = torch.full((buffer.max_tokens_per_rank, k), -1, dtype=torch.int64)
    padded[:t_local] = topk_idx.to("cpu", torch.int64)
    idx_PTK = gather(padded, g.group, world)
    local, cap, align = g.num_experts // world, buffer.recv_capacity_per_rank, buffer.alignment
    dest_PTK = torch.where(idx_PTK >= 0, idx_PTK // local, -1)
    slot_PTK = torch.full_like(idx_PTK, -1)
    src_S3 = torch.full((cap, 3), -1, dtype=torch.int64)
    kept_here = demand_here = None
    for d in range(world):
        # Tokens this rank receives, once each, in global order: past the capacity they lose
        # every hit here (deep FLAT overflow); their slots still count below.
        hit_PT = (dest_PTK == d).any(-1)
        flat_dropped = torch.zeros_like(hit_PT)
        received = torch.nonzero(hit_PT)
        flat_dropped[received[cap:, 0], received[cap:, 1]] = True
        base, tokens_per_expert = 0, []
        for e in range(local):
            p_i, t_i, k_i = torch.nonzero(idx_PTK == d * local + e, as_tuple=True)
            n = p_i.numel()  # nonzero's row-major order: source rank, then token
            slots = base + torch.arange(n)
            keep = (slots < cap) & ~flat_dropped[p_i, t_i]
            slot_PTK[p_i[keep], t_i[keep], k_i[keep]] = slots[keep]
            if d == rank:
                src_S3[slots[keep]] = torch.stack([p_i[keep], t_i[keep], k_i[keep]], 1)
            pad = n + (-n % align if align > 1 else 0)
            tokens_per_expert.append(min(pad, max(0, cap - base)))
            base += pad
        if base > cap and not g.drop:
            raise RuntimeError(
                f"NCCL EP trap: rank {d} was sent {base} rows, recv_capacity_per_rank is {cap} "
                "(bootstrapped without drop_on_overflow)"
            )
        if d == rank:
            kept_here, demand_here = torch.tensor(tokens_per_expert), base
    layout = _Layout(world, rank, g.group, counts, dest_PTK, slot_PTK, idx_PTK, src_S3,
                     g.num_experts)  # fmt: skip
    return layout, kept_here, demand_here


def _scatter_to_slots(lay: _Layout, rows_PTH: torch.Tensor) -> torch.Tensor:
    """``[capacity, H]``: at each of this rank's kept slots, its token's row; zero elsewhere."""
    out = rows_PTH.new_zeros(lay.src_S3.shape[0], rows_PTH.shape[-1])
    real = lay.src_S3[:, 0] >= 0
    p, t = lay.src_S3[real, 0], lay.src_S3[real, 1]
    out[real] = rows_PTH[p, t]
    return out


def _gather_from_slots(lay: _Layout, slots_PSH: torch.Tensor) -> torch.Tensor:
    """``[T, E, H]``: for each of this rank's tokens, the row of each expert it kept a hit
    at (zero where not routed or dropped)."""
    t = lay.num_tokens[lay.rank]
    dest, slot, idx = (x[lay.rank, :t] for x in (lay.dest_PTK, lay.slot_PTK, lay.idx_PTK))
    out = slots_PSH.new_zeros(t, lay.num_experts, slots_PSH.shape[-1])
    kept = slot >= 0
    tok = torch.arange(t).unsqueeze(1).expand_as(slot)
    out[tok[kept], idx[kept]] = slots_PSH[dest[kept], slot[kept]]
    return out


def _routed(lay: _Layout) -> torch.Tensor:
    """``[T, E]`` bool: the experts each of this rank's tokens was routed to."""
    t = lay.num_tokens[lay.rank]
    idx = lay.idx_PTK[lay.rank, :t]
    routed = torch.zeros(t, lay.num_experts, dtype=torch.bool)
    tok = torch.arange(t).unsqueeze(1).expand_as(idx)
    routed[tok[idx >= 0], idx[idx >= 0]] = True
    return routed


def _padded_tokens(lay: _Layout, t: torch.Tensor, max_tokens: int) -> torch.Tensor:
    out = t.new_zeros(max_tokens, *t.shape[1:])
    out[: t.shape[0]] = t
    return gather(out, lay.group, lay.world)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, topk_weights, lay: _Layout, max_tokens: int, unwritten: int | None):
        ctx.lay, ctx.max_tokens, ctx.t = lay, max_tokens, tokens.shape[0]
        recv = _scatter_to_slots(lay, _padded_tokens(lay, tokens, max_tokens))
        if unwritten is not None:  # without drop, rows past the counts are never written
            recv[unwritten:] = float("nan")
        w_PTK = _padded_tokens(lay, topk_weights, max_tokens)
        weights = torch.zeros(lay.src_S3.shape[0], dtype=torch.float32)
        real = lay.src_S3[:, 0] >= 0
        s = lay.src_S3[real]
        weights[real] = w_PTK[s[:, 0], s[:, 1], s[:, 2]]
        return recv, weights

    @staticmethod
    def backward(ctx, g_recv, g_weights):
        lay = ctx.lay
        g_rows = gather(g_recv, lay.group, lay.world)  # [P, capacity, H]
        g_tokens = sum_in_expert_order(_gather_from_slots(lay, g_rows), _routed(lay))
        g_w_PS = gather(g_weights.float().reshape(-1, 1), lay.group, lay.world)
        t = ctx.t
        dest, slot = lay.dest_PTK[lay.rank, :t], lay.slot_PTK[lay.rank, :t]
        g_topk = torch.zeros(slot.shape, dtype=torch.float32)
        kept = slot >= 0
        g_topk[kept] = g_w_PS[dest[kept], slot[kept], 0]
        return g_tokens, g_topk, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, lay: _Layout, num_local_tokens: int, max_tokens: int):
        ctx.lay, ctx.max_tokens = lay, max_tokens
        rows = gather(expert_out, lay.group, lay.world)  # [P, capacity, H]
        out = sum_in_expert_order(_gather_from_slots(lay, rows), _routed(lay))
        if num_local_tokens > out.shape[0]:
            out = torch.cat([out, out.new_zeros(num_local_tokens - out.shape[0], out.shape[1])])
        return out[:num_local_tokens]

    @staticmethod
    def backward(ctx, g_out):
        lay = ctx.lay
        t = lay.num_tokens[lay.rank]
        g_rows = _scatter_to_slots(lay, _padded_tokens(lay, g_out[:t], ctx.max_tokens))
        return g_rows, None, None, None


def _payload(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.bfloat16, torch.float32):  # TE: bfloat16 only (module docstring)
        raise NotImplementedError(
            "NCCL EP currently supports only bfloat16 or MXFP8 payloads; got "
            f"{name}.dtype={t.dtype}."
        )


def ep_dispatch(
    buffer: EpBuffer,
    tokens: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    recv_tokens: torch.Tensor | None = None,
    recv_topk_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if topk_weights.dtype is not torch.float32:
        raise TypeError(
            f"topk_weights must be float32; got dtype={topk_weights.dtype}. "
            "Cast with topk_weights.float() before calling."
        )
    if recv_tokens is not None or recv_topk_weights is not None:
        raise NotImplementedError("the NCCL EP stand-in allocates its receive buffers")
    _payload("tokens", tokens)
    tokens = tokens.reshape(-1, tokens.shape[-1])
    lay, kept, demand = _layout(buffer, topk_idx.reshape(tokens.shape[0], -1))
    buffer.handle_mem = lay
    buffer.tokens_per_expert.copy_(kept)
    buffer.total_recv_tokens.fill_(demand)
    unwritten = None if buffer.group.drop else int(kept.sum())
    recv, weights = _Dispatch.apply(tokens, topk_weights.reshape(tokens.shape[0], -1), lay,
                                    buffer.max_tokens_per_rank, unwritten)  # fmt: skip
    return recv, weights, buffer.tokens_per_expert


def ep_combine(
    buffer: EpBuffer,
    expert_out: torch.Tensor,
    *,
    num_local_tokens: int | None = None,
    grad_out: torch.Tensor | None = None,
) -> torch.Tensor:
    _payload("expert_out", expert_out)
    if grad_out is not None:
        raise NotImplementedError("the NCCL EP stand-in allocates its gradient buffers")
    lay = buffer.handle_mem
    if lay is None:
        raise RuntimeError("ep_combine before ep_dispatch on this buffer")
    if expert_out.shape[0] != buffer.recv_capacity_per_rank:
        raise ValueError(
            f"combine got {expert_out.shape[0]} rows for a capacity of "
            f"{buffer.recv_capacity_per_rank}"
        )
    n = buffer.max_tokens_per_rank if num_local_tokens is None else int(num_local_tokens)
    return _Combine.apply(expert_out, lay, n, buffer.max_tokens_per_rank)
