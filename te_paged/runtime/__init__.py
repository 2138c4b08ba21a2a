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
__all__ = sorted(name for names in _MODULES.values() for name in names)
__getattr__, __dir__ = lazy_exports(
    __name__, {n: m for m, names in _MODULES.items() for n in names}, globals()
)
