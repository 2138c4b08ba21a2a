"""Producer markers: which saved tensors are dynamic (token-major, actual rows a prefix).

A producer marks the *exact tensor object* it hands to ``save_for_backward``. The mark is a
Python attribute on that object, so it does not survive ``view``/``reshape``/``detach``/casts:
every producer re-marks after such an op (:func:`propagate_paged_stash_marker`).

The attribute is Transformer Engine's own, ``grouped_tensor_scale_inv``, so the two libraries
understand each other's tensors:

======================  =====================================================================
value                   meaning
======================  =====================================================================
``False``               one row per token: ``[max_num_tokens, ...]``, actual rows a prefix
``True``                an MXFP8 scale-inverse: one row per 32 tokens, ``[max_num_tokens/32, ...]``
absent                  static tensor: never paged
======================  =====================================================================

With Transformer Engine importable, marking is delegated to TE's utility (see
:mod:`te_paged.te`), so a TE build that keeps extra state alongside the attribute stays consistent.
"""

from __future__ import annotations

import enum

import torch

from te_paged.te import te_mark_grouped_tensor

__all__ = [
    "GROUPED_TENSOR_ATTR",
    "MarkerKind",
    "grouped_tensor_marker",
    "is_grouped_tensor_marked",
    "mark_grouped_tensor",
    "propagate_paged_stash_marker",
]

#: Attribute name shared with Transformer Engine.
GROUPED_TENSOR_ATTR = "grouped_tensor_scale_inv"

#: Rows of an MXFP8 scale-inverse: one per this many tokens.
MXFP8_SCALE_BLOCK = 32


class MarkerKind(enum.Enum):
    """How a marked tensor's rows relate to tokens."""

    TOKEN_ROWS = 1  # one row per token
    SCALE_INV_ROWS = 32  # one row per 32 tokens (MXFP8 scale-inverse)

    @property
    def tokens_per_row(self) -> int:
        return self.value


def mark_grouped_tensor(*tensors: torch.Tensor | None, scale_inv: bool = False) -> None:
    """Mark ``tensors`` as dynamic saved tensors (``None`` entries are skipped).

    ``scale_inv=True`` marks MXFP8 scale-inverses (one row per 32 tokens).
    """
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mark_grouped_tensor expects tensors or None, got {type(t).__name__}")
        # Under torch.compile the mark is read only by te_paged's save helper
        # (te_paged.kernels.compiled), at trace time: no Transformer Engine probe to trace.
        if torch.compiler.is_compiling() or not te_mark_grouped_tensor(t, scale_inv):
            setattr(t, GROUPED_TENSOR_ATTR, bool(scale_inv))


def grouped_tensor_marker(t: torch.Tensor) -> MarkerKind | None:
    """The marker kind of ``t`` (ours or one Transformer Engine set), or ``None``."""
    value = getattr(t, GROUPED_TENSOR_ATTR, None)
    if value is None:
        return None
    return MarkerKind.SCALE_INV_ROWS if bool(value) else MarkerKind.TOKEN_ROWS


def is_grouped_tensor_marked(t: torch.Tensor | None) -> bool:
    """True when ``t`` carries a producer marker (set by te_paged or by Transformer Engine)."""
    return t is not None and grouped_tensor_marker(t) is not None


def propagate_paged_stash_marker(source: torch.Tensor | None, target: torch.Tensor | None) -> None:
    """Copy ``source``'s producer marker (if any) onto ``target``.

    Call it after every view/reshape/cast between the marked producer output and the tensor that
    is actually saved: such ops return a new tensor object without Python attributes.
    """
    if source is None or target is None:
        return
    kind = grouped_tensor_marker(source)
    if kind is not None:
        mark_grouped_tensor(target, scale_inv=kind is MarkerKind.SCALE_INV_ROWS)
