"""``AllToAll``: the static-budget dispatcher's equal-split exchange as an autograd function
(gloo has no autograd for collectives), its bytes counted on the dispatcher in forward and
backward."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["AllToAll", "all_to_all"]


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x``'s equal blocks exchanged over ``group`` (no autograd: metadata)."""
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


class AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` along dim 0: block ``s`` of the output on rank ``r`` is
    block ``r`` of the input on rank ``s``. ``[S, ...] → [S, ...]``.

    Backward is the same exchange applied to the gradient (it is its own inverse pattern), and
    is counted on ``traffic`` like the forward. Saves nothing for backward but a 0-dim count.
    gloo has no autograd for collectives, hence this.
    """

    @staticmethod
    def forward(
        ctx, x_S: torch.Tensor, group: dist.ProcessGroup, traffic: object,
        routed: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        ctx.group, ctx.traffic, ctx.routed = group, traffic, routed
        traffic._count(x_S, routed)
        return all_to_all(x_S, group)

    @staticmethod
    def backward(ctx, grad_S: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.traffic._count(grad_S, ctx.routed)
        return all_to_all(grad_S, ctx.group), None, None, None
