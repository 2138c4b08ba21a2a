"""Check 5: CUDA-graph capture and replay of MoELayer's captured step (one rank)."""

from __future__ import annotations

import functools

from .common import need_cuda, run_cases
from .stack import overlap_label, overlaps, replay

NAME = "CUDA graph capture and replay of MoELayer's captured step (1 rank)"
TARGET = "every replay bitwise equal to eager"


def run() -> str:
    """Two chained MoELayers (router, dispatcher, experts, combine), bf16, each overlap
    setting; each replay routes new data."""
    need_cuda("CUDA graphs")
    return run_cases({
        overlap_label(overlap): functools.partial(replay, "layer", None, overlap)
        for overlap in overlaps()
    }, isolate=True)  # fmt: skip
