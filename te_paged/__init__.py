"""te_paged: paged stashing of MoE expert activations for PyTorch training.

Importing this package touches no CUDA state and needs neither Triton nor Transformer Engine,
nor PyTorch: its names are imported at first use (so ``import te_paged.jax`` needs no torch).

Logging: modules log to ``logging.getLogger(__name__)`` (children of ``te_paged``). No handler
is attached to the ``te_paged`` logger, deliberately not even a ``NullHandler``: with no logging
configured, Python's last-resort handler then prints WARNING and above (a runner's fallback) on
stderr and nothing below it, whereas a ``NullHandler`` would silence the warnings as well.
``logging.basicConfig(level=logging.INFO)`` (or a level on the ``te_paged`` logger) shows the
INFO events too: pool sizing, host spills, pool growth (``grow_pool``).
"""

from te_paged._lazy import lazy_exports
from te_paged._version import __version__ as __version__  # re-exported: the one source

_MODULES = {  # the module that defines each public name
    "te_paged.config": ["MoEConfig"],
    "te_paged.grouped": [
        "Fp8Recipe", "Fp8Tensor", "GroupedLinear", "GroupedTensor", "make_grouped_linear",
        "weighted_quick_geglu", "weighted_swiglu",
    ],
    "te_paged.kernels.backends": ["KernelBackend"],
    "te_paged.markers": [
        "is_checkpoint_without_output_tensor", "is_grouped_tensor_marked", "mark_grouped_tensor",
        "mark_recompute_managed", "propagate_paged_stash_marker",
    ],
    "te_paged.moe": [
        "CheckpointWithoutOutput", "MoELayer", "PagedStashParticipant", "RouterOutput",
        "StaticBudgetDispatcher", "TEGroupedMLP", "TopKRouter",
    ],
    "te_paged.runtime.records": ["FallbackLimitError", "StepDesyncError", "StepRecord"],
    "te_paged.runtime.runner": ["PagedStashRunner"],
    "te_paged.stash": [
        "PagedStashBuffer", "PagedStashManager", "StashKey", "StashMode", "StashStats",
    ],
}  # fmt: skip
__getattr__, __dir__, __all__ = lazy_exports(__name__, _MODULES, globals())
