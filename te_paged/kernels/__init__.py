"""Stash copy/pop kernels behind a registry of backends: the pure-torch reference and Triton."""

from te_paged.kernels.backends import (
    AUTO,
    KernelBackend,
    StashBackend,
    backend_choices,
    get_backend,
    register_backend,
    resolve_backend,
)
from te_paged.kernels.layout import FLAGS_LEN, META_LEN, STATE_LEN, Flag, Meta, State, Tier
from te_paged.kernels.ops import stash_copy, stash_pop
from te_paged.kernels.reference import torch_stash_copy, torch_stash_pop
from te_paged.kernels.triton_backend import triton_available

__all__ = [
    "AUTO",
    "FLAGS_LEN",
    "META_LEN",
    "STATE_LEN",
    "Flag",
    "KernelBackend",
    "Meta",
    "StashBackend",
    "State",
    "Tier",
    "backend_choices",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "stash_copy",
    "stash_pop",
    "torch_stash_copy",
    "torch_stash_pop",
    "triton_available",
]
