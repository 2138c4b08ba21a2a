"""Check 3: no host synchronisation in the captured step."""

from __future__ import annotations

import functools
import itertools

import torch

from .common import need_cuda, run_cases
from .stack import Stack, cfg, clean_stash, inputs, overlap_label, overlaps, step

NAME = "no host sync in the captured step (set_sync_debug_mode='error')"
TARGET = "0 synchronising calls in forward + backward"


def run() -> str:
    """The captured step (pools allocated, kernels reading counts on the device) of two chained
    TEGroupedMLPs and of two MoELayers (1 rank: router, dispatcher, experts, combine), bf16 and
    MXFP8, each stream-overlap setting, under ``torch.cuda.set_sync_debug_mode("error")``."""
    need_cuda("set_sync_debug_mode")
    cases = {}
    for kind, fp8, overlap in itertools.product(["experts", "layer"], [None, "mxfp8"], overlaps()):
        label = f"{kind} fp8={fp8}, {overlap_label(overlap)}"
        cases[label] = functools.partial(_sync_free, kind, fp8, overlap)
    return run_cases(cases)


def _sync_free(kind: str, fp8: str | None, overlap) -> str:
    stack = Stack(kind, cfg(moe_paged_stash=True, fp8=fp8), overlap=overlap)
    step(stack, 0)  # the capture step reads counts on the host, by design
    stack.manager.reset()  # allocates the pools, outside the checked step
    batch = inputs(kind, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(stack, 1, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    clean_stash(stack, "checked step")
    s = stack.manager.stats()
    return f"{s.stashes} stashes, {s.pops} pops, no sync"
