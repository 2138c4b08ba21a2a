"""Stash copy/pop kernels behind a registry of backends: the pure-torch reference and Triton.
Names are imported at first use: the flag and state layout (``te_paged.kernels.layout``) needs
no torch, and te_paged.jax uses it."""

from te_paged._lazy import lazy_exports

_MODULES = {
    "te_paged.kernels.backends": [
        "AUTO", "KernelBackend", "StashBackend", "backend_choices", "get_backend",
        "register_backend", "resolve_backend",
    ],
    "te_paged.kernels.layout": [
        "FLAGS_LEN", "META_LEN", "STATE_LEN", "Flag", "Meta", "State", "Tier",
    ],
    "te_paged.kernels.ops": ["stash_copy", "stash_pop"],
    "te_paged.kernels.reference": ["torch_stash_copy", "torch_stash_pop"],
    "te_paged.kernels.triton_backend": ["triton_available"],
}  # fmt: skip
__getattr__, __dir__, __all__ = lazy_exports(__name__, _MODULES, globals())
