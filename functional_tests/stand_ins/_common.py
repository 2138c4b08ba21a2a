"""What the stand-ins share: an all-gather of equal shapes, and how a token's rows from its
experts are summed back (ascending expert order, the tests compare runs that share it)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather(t: torch.Tensor, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """``[P, *t.shape]``: ``t`` from every rank of ``group`` (equal shapes)."""
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t.contiguous(), group=group)
    return torch.stack(out)


def sum_in_expert_order(per_expert_NEH: torch.Tensor, routed_NE: torch.Tensor) -> torch.Tensor:
    """``[N, H]``: each token's rows of the experts it was routed to (``routed_NE``), summed in
    ascending expert order; a row that came back empty (dropped) adds zero."""
    n, _, width = per_expert_NEH.shape
    k = max(1, int(routed_NE.sum(1).max())) if n else 1  # the stand-ins' host read
    order_NE = torch.sort((~routed_NE).to(torch.uint8), dim=1, stable=True).indices
    idx_NK = order_NE[:, :k]
    picked_NKH = per_expert_NEH.gather(1, idx_NK.unsqueeze(-1).expand(n, k, width))
    picked_NKH = picked_NKH * routed_NE.gather(1, idx_NK).unsqueeze(-1).to(per_expert_NEH.dtype)
    return picked_NKH.sum(1)
