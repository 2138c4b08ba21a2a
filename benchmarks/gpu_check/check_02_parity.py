"""Check 2: paged stash ON vs OFF, and the op fuser vs unfused, bitwise."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

from .common import RUN, all_same, run_cases
from .stack import Stack, cfg, clean_stash, has_overlap, overlap_label, overlaps, step

NAME = "ON vs OFF and fused vs unfused, bitwise, CUDA bf16 and MXFP8"
TARGET = "every output and gradient bitwise equal; stashes = pops > 0, no overflow"


def run() -> str:
    """TEGroupedMLP over op-fuser x MXFP8 x recompute, and MoELayer (1 rank) in bf16 and MXFP8:
    paged stash ON (each stream-overlap setting) vs OFF, and fused vs unfused, two steps. A
    smoke run: the first configuration only."""
    cases: dict[str, Callable[[], str]] = {}
    for fuser, fp8, rc in itertools.product([False, True], [None, "mxfp8"], [[], ["moe_act"]]):
        kw = {"use_transformer_engine_op_fuser": fuser, "fp8": fp8, "recompute_modules": rc}
        cases[f"experts fuser={fuser} fp8={fp8} rc={rc}"] = functools.partial(
            _parity, "experts", kw, None, other=True
        )
    for fp8, overlap in itertools.product([None, "mxfp8"], overlaps()):
        label = f"layer fp8={fp8}, {overlap_label(overlap)}"
        cases[label] = functools.partial(_parity, "layer", {"fp8": fp8}, overlap)
    if has_overlap():
        cases["experts default, overlap off"] = functools.partial(_parity, "experts", {}, False)
    if RUN.smoke:
        cases = dict(itertools.islice(cases.items(), 1))
    detail = run_cases(cases)
    return f"{len(cases)} configurations x 2 steps, bitwise equal ({detail})"


def _parity(kind: str, kw: dict, overlap, other: bool = False) -> str:
    on = Stack(kind, cfg(moe_paged_stash=True, **kw), overlap=overlap)
    off = Stack(kind, cfg(**kw))
    alt = None
    if other:
        flip = not kw.get("use_transformer_engine_op_fuser", False)
        alt = Stack(kind, cfg(**{**kw, "use_transformer_engine_op_fuser": flip}))
    for index in range(2):
        a, b = step(on, index), step(off, index)
        if not all_same(a, b):
            raise AssertionError(f"ON != OFF at step {index}")
        if alt is not None and not all_same(b, step(alt, index)):
            raise AssertionError(f"fused != unfused at step {index}")
        clean_stash(on, f"step {index}")
    return "ok"
