"""Storage-level marker for tensors whose memory is owned by selective recompute.

``CheckpointWithoutOutput`` frees its output's storage after forward and rematerialises the
values *into the same storage* in backward. If the paged stash also took ownership of a view of
that output (e.g. the input GroupedLinear reshapes/splits and saves), backward would read the
stash's copy of values that recompute is responsible for: double ownership. A Python attribute on
the output tensor is not enough, because ``reshape``/``split``/``view``/``detach`` produce new
tensor objects without attributes (the critical finding in the review of the prior art). The
marker therefore lives on the *untyped storage*, whose Python object torch preserves and shares
between every alias.
"""

from __future__ import annotations

import torch

__all__ = ["is_checkpoint_without_output_tensor", "mark_recompute_managed"]

_STORAGE_ATTR = "_te_paged_recompute_managed"


def mark_recompute_managed(t: torch.Tensor) -> None:
    """Mark ``t``'s storage (and so every alias of it) as owned by recompute."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"mark_recompute_managed expects a tensor, got {type(t).__name__}")
    setattr(t.untyped_storage(), _STORAGE_ATTR, True)


def is_checkpoint_without_output_tensor(t: torch.Tensor) -> bool:
    """True when ``t`` shares storage with a recompute-managed tensor."""
    return bool(getattr(t.untyped_storage(), _STORAGE_ATTR, False))
