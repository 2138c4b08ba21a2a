"""Check 4: CUDA-graph capture and replay of TEGroupedMLP's captured step."""

from __future__ import annotations

import functools
import itertools

from .common import need_cuda, run_cases
from .stack import overlap_label, overlaps, replay

NAME = "CUDA graph capture and replay of TEGroupedMLP's captured step"
TARGET = "every replay bitwise equal to eager"


def run() -> str:
    """Two chained TEGroupedMLPs, bf16 and MXFP8, each stream-overlap setting."""
    need_cuda("CUDA graphs")
    return run_cases({
        f"fp8={fp8}, {overlap_label(overlap)}": functools.partial(
            replay, "experts", fp8, overlap
        )
        for fp8, overlap in itertools.product([None, "mxfp8"], overlaps())
    }, isolate=True)  # fmt: skip
