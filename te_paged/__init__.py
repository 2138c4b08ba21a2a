"""te_paged: paged stashing of MoE expert activations for PyTorch training.

Importing this package touches no CUDA state and needs neither Triton nor Transformer Engine.

Logging: modules log to ``logging.getLogger(__name__)`` (children of ``te_paged``). No handler
is attached to the ``te_paged`` logger, deliberately not even a ``NullHandler``: with no logging
configured, Python's last-resort handler then prints WARNING and above (a runner's fallback) on
stderr and nothing below it, whereas a ``NullHandler`` would silence the warnings as well.
``logging.basicConfig(level=logging.INFO)`` (or a level on the ``te_paged`` logger) shows the
INFO events too: pool sizing, host spills, pool growth (``grow_pool``).
"""

from te_paged._version import __version__ as __version__  # re-exported: the one source
from te_paged.config import MoEConfig
from te_paged.grouped import (
    Fp8Recipe,
    Fp8Tensor,
    GroupedLinear,
    GroupedTensor,
    make_grouped_linear,
    weighted_quick_geglu,
    weighted_swiglu,
)
from te_paged.kernels import KernelBackend
from te_paged.markers import (
    is_checkpoint_without_output_tensor,
    is_grouped_tensor_marked,
    mark_grouped_tensor,
    mark_recompute_managed,
    propagate_paged_stash_marker,
)
from te_paged.moe import (
    CheckpointWithoutOutput,
    MoELayer,
    PagedStashParticipant,
    RouterOutput,
    StaticBudgetDispatcher,
    TEGroupedMLP,
    TopKRouter,
)
from te_paged.runtime import FallbackLimitError, PagedStashRunner, StepDesyncError, StepRecord
from te_paged.stash import PagedStashBuffer, PagedStashManager, StashKey, StashMode, StashStats

__all__ = [
    "CheckpointWithoutOutput",
    "FallbackLimitError",
    "Fp8Recipe",
    "Fp8Tensor",
    "GroupedLinear",
    "GroupedTensor",
    "KernelBackend",
    "MoEConfig",
    "MoELayer",
    "PagedStashBuffer",
    "PagedStashManager",
    "PagedStashParticipant",
    "PagedStashRunner",
    "RouterOutput",
    "StashKey",
    "StashMode",
    "StashStats",
    "StaticBudgetDispatcher",
    "StepDesyncError",
    "StepRecord",
    "TEGroupedMLP",
    "TopKRouter",
    "is_checkpoint_without_output_tensor",
    "is_grouped_tensor_marked",
    "make_grouped_linear",
    "mark_grouped_tensor",
    "mark_recompute_managed",
    "propagate_paged_stash_marker",
    "weighted_quick_geglu",
    "weighted_swiglu",
]
