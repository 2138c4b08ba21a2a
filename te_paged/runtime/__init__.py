"""Step runtime: the rerun-on-overflow runner. Its names are imported at first use: the
planner and the step record (``te_paged.runtime.planner``, ``te_paged.runtime.records``) need no
torch, and te_paged.jax uses them."""

from te_paged._lazy import lazy_exports

_MODULES = {
    "te_paged.runtime.records": [
        "CapacityLimitError", "FallbackLimitError", "InvalidCountsError", "PoolLimitError",
        "StepDesyncError", "StepRecord",
    ],
    "te_paged.runtime.runner": ["PagedStashRunner"],
    "te_paged.runtime.step_state": ["StepState"],
}  # fmt: skip
__getattr__, __dir__, __all__ = lazy_exports(__name__, _MODULES, globals())
