"""Stash copy/pop kernels: a pure-torch reference and a Triton implementation."""

from te_paged.kernels.layout import FLAGS_LEN, META_LEN, STATE_LEN, Flag, Meta, State, Tier
from te_paged.kernels.ops import KernelBackend, resolve_backend, stash_copy, stash_pop
from te_paged.kernels.reference import torch_stash_copy, torch_stash_pop

__all__ = [
    "FLAGS_LEN",
    "META_LEN",
    "STATE_LEN",
    "Flag",
    "KernelBackend",
    "Meta",
    "State",
    "Tier",
    "resolve_backend",
    "stash_copy",
    "stash_pop",
    "torch_stash_copy",
    "torch_stash_pop",
]
