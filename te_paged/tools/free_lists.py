"""Free lists as a workload leaves them, for the stash benchmark (``te-paged bench``).

A stash takes the pages at the head of its pool's free list, so how fast it moves rows depends
on that list: consecutive pages move as one slice, scattered ones do not. Three lists:

``fresh``
    The list of a pool just reset: pages ``0 1 2 ...``, one run.
``1F1B``
    The list as pipeline stage 0 leaves it under Megatron-core's 1F1B schedule
    (:func:`te_paged.runtime.schedules.pass_order`; 4 stages, 8 microbatches): every forward
    stashes ``layers`` tensors of this pool's key, token counts drawn around the measured
    tensor's, every backward pops its microbatch's tensors in reverse layer order, so the pages
    that come back interleave different tensors'. The pool is sized as the manager sizes it,
    1.10 × the peak of live pages; the measured tensor is the first one the last steady-state
    forward stashes, the most fragmented point of the step.
``alternating``
    The worst case: every other page free (``0 2 4 ...``), held by a tensor between them; no
    two pages of the measured tensor are adjacent.

The schedule is run through the real reference kernels on a one-element-wide shadow pool (a free
list depends on page counts only, never on the rows' width), and stops right after the measured
tensor's stash. A *filler* tensor then takes every free page the measured tensor did not (a
stand-in for the rest of the step), and the measured tensor is popped: the free list now holds
exactly its pages, in the order it received them, so every timed stash+pop takes the same
pages as that stash did in the schedule.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import random

import torch

from te_paged.kernels.layout import FLAGS_LEN, META_LEN, Meta, State, Tier
from te_paged.kernels.reference import torch_stash_copy, torch_stash_pop
from te_paged.runtime.schedules import PipelineConfig, pass_order
from te_paged.stash import PagedStashBuffer, StashKey

__all__ = ["FreeList", "PreparedFreeList", "page_runs", "prepare_free_list"]

#: The pool over its peak of live pages: the manager's default ``buffer_size_factor_cuda``.
POOL_FACTOR = 1.10


class FreeList(enum.Enum):
    """The free list a benchmark stash starts from (module docstring)."""

    FRESH = "fresh"
    PIPELINE = "1F1B"
    ALTERNATING = "alternating"


@dataclasses.dataclass(frozen=True)
class PreparedFreeList:
    """A pool's free list, ready for a stash of ``len(pages)`` pages to take exactly ``pages``.

    ``free_P`` is the whole circular list (``num_pages`` slots) and ``head``/``tail`` its
    monotone counters (layout in :mod:`te_paged.kernels.layout`); ``tail − head == len(pages)``.
    """

    kind: FreeList
    num_pages: int
    free_P: tuple[int, ...]
    head: int
    tail: int
    pages: tuple[int, ...]

    @property
    def runs(self) -> int:
        return page_runs(self.pages)


def page_runs(pages: tuple[int, ...] | list[int]) -> int:
    """How many runs of consecutive page ids ``pages`` is: ``[3 4 5 0 1]`` is 2."""
    return sum(1 for i, p in enumerate(pages) if i == 0 or p != pages[i - 1] + 1)


class _Shadow:
    """A pool of one-element rows driven by the reference kernels: only the free list matters."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.buffer = PagedStashBuffer(StashKey(torch.int16, 1), num_pages, page_size, "cpu")
        self.flags = torch.zeros(FLAGS_LEN, dtype=torch.int64)

    def stash(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        page_size = self.buffer.page_size
        rec = torch.empty(max(1, -(-tokens // page_size)), dtype=torch.int32)
        meta = torch.empty(META_LEN, dtype=torch.int64)
        src = torch.zeros(max(tokens, 1), 1, dtype=torch.int16)
        torch_stash_copy(src, torch.tensor([tokens]), 1, page_size, *self.buffer.kernel_args(),
                         self.flags, rec, meta)  # fmt: skip
        if int(meta[Meta.TIER]) != Tier.DEVICE:  # sized from the schedule's peak: never
            raise AssertionError(f"shadow pool of {self.buffer.num_pages} pages overflowed")
        return rec, meta, src.shape[0]

    def pop(self, record: tuple[torch.Tensor, torch.Tensor, int]) -> None:
        rec, meta, rows = record
        dst = torch.empty(rows, 1, dtype=torch.int16)
        torch_stash_pop(dst, self.buffer.page_size, *self.buffer.kernel_args(), self.flags, rec,
                        meta, False)  # fmt: skip

    @property
    def free_pages(self) -> int:
        state = self.buffer.state
        return int(state[State.TAIL] - state[State.HEAD])


def _pipeline_ops(
    tokens: int, layers: int, stages: int, microbatches: int, spread: float, seed: int
) -> tuple[list[tuple[bool, tuple[int, int], int]], int]:
    """``(stash?, (microbatch, layer), tokens)`` of stage 0's 1F1B step up to and including the
    measured stash (the first of the last forward pass), and that op's index."""
    rng = random.Random(seed)
    order = pass_order(PipelineConfig(pipeline_parallel=stages, microbatches=microbatches), 0)
    last_forward = max(i for i, p in enumerate(order) if p.forward)
    ops: list[tuple[bool, tuple[int, int], int]] = []
    for i, p in enumerate(order[: last_forward + 1]):
        if p.forward:
            for layer in range(layers):
                n = round(tokens * rng.uniform(1 - spread, 1 + spread))
                ops.append((True, (p.microbatch, layer), n))
                if i == last_forward:  # the measured tensor: exactly `tokens`, first of its pass
                    ops[-1] = (True, (p.microbatch, layer), tokens)
                    return ops, len(ops) - 1
        else:
            ops += [(False, (p.microbatch, layer), 0) for layer in reversed(range(layers))]
    raise AssertionError("unreachable: the last forward pass returns")


def prepare_free_list(
    kind: FreeList,
    tokens: int,
    page_size: int,
    *,
    layers: int = 2,
    stages: int = 4,
    microbatches: int = 8,
    spread: float = 0.25,
    seed: int = 0,
) -> PreparedFreeList:
    """The free list ``kind`` leaves for a stash of ``tokens`` rows (module docstring).

    ``layers`` tensors of this key per microbatch, token counts uniform in ``tokens × [1 −
    spread, 1 + spread]`` (seeded) — only for ``1F1B``.
    """
    need = -(-tokens // page_size)
    if need < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if kind is FreeList.FRESH:
        free = tuple(range(need))
        return PreparedFreeList(kind, need, free, 0, need, free)
    if kind is FreeList.ALTERNATING:
        shadow = _Shadow(2 * need, page_size)
        records = [shadow.stash(page_size) for _ in range(2 * need)]  # pages 0, 1, 2, ...
        for record in records[::2]:  # free the even pages; the odd ones stay held
            shadow.pop(record)
    elif kind is FreeList.PIPELINE:
        ops, measured = _pipeline_ops(tokens, layers, stages, microbatches, spread, seed)
        sizes = {key: n for stash, key, n in ops if stash}
        live = peak = 0
        for stash, key, _ in ops:  # the peak of live pages sizes the pool, as in the manager
            live += (1 if stash else -1) * -(-sizes[key] // page_size)
            peak = max(peak, live)
        shadow = _Shadow(math.ceil(POOL_FACTOR * peak), page_size)
        held: dict[tuple[int, int], tuple] = {}
        for stash, key, _ in ops:
            if stash:
                held[key] = shadow.stash(sizes[key])
            else:
                shadow.pop(held.pop(key))
        filler = shadow.free_pages * page_size
        if filler:
            shadow.stash(filler)
        shadow.pop(held.pop(ops[measured][1]))
    else:  # pragma: no cover - the enum is closed
        raise ValueError(f"unknown free list {kind!r}")
    buffer = shadow.buffer
    head, tail = int(buffer.state[State.HEAD]), int(buffer.state[State.TAIL])
    free = tuple(buffer.free_P.tolist())
    pages = tuple(free[i % buffer.num_pages] for i in range(head, tail))
    assert len(pages) == need, (kind, len(pages), need)
    return PreparedFreeList(kind, buffer.num_pages, free, head, tail, pages)
