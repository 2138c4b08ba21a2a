"""te_paged for JAX: the page pool as functional state, stash/pop with static shapes, and a
``custom_vjp`` pair that threads the pool through a ``lax.scan`` over layers (docs/jax.md).

Needs JAX (``pip install 'te_paged[jax]'``); ``import te_paged`` never imports it. Shares the
page layout (:mod:`te_paged.kernels.layout`), the planner and the capacity model with the torch
side, and nothing else.
"""

from __future__ import annotations

try:
    import jax as _jax  # noqa: F401 - fail here, with the install hint
except ImportError as e:  # pragma: no cover - the jax extra is installed in CI
    raise ImportError("te_paged.jax needs JAX: pip install 'te_paged[jax]'") from e

from te_paged.jax.checkpoint import paged_checkpoint, paged_scope
from te_paged.jax.pool import (
    STAMP,
    PagedPool,
    StashRecord,
    make_pool,
    overflowed,
    pop,
    reset_pool,
    stash,
)

__all__ = [
    "STAMP",
    "PagedPool",
    "StashRecord",
    "make_pool",
    "overflowed",
    "paged_checkpoint",
    "paged_scope",
    "pop",
    "reset_pool",
    "stash",
]
