"""An autograd function that saves its input, for tests of what happens to saved tensors."""

from __future__ import annotations

import torch


class Keep(torch.autograd.Function):
    """Saves its input as is (the stash's pack hook sees it); backward reads it back."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g + 0 * ctx.saved_tensors[0]
