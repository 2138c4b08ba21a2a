"""Megatron-core 0.16's pipeline schedules as pure data: which passes one stage runs, in order,
and how many microbatch-chunks it holds for backward at its peak.

A *pass* is the forward or the backward of one microbatch through one model chunk of one
pipeline stage (rank). Under 1F1B a stage has one chunk (its ``L / P`` layers); under the
interleaved schedule ``V`` chunks of ``L / (P·V)`` layers each. A forward pass saves its layers'
activations, the backward pass of the same (microbatch, chunk) frees them: a pass is *in flight*
from the end of its forward to the start of its backward — Megatron's ``input_tensors`` /
``output_tensors`` queues of that stage, summed over chunks. Within a stage the passes run one
after the other (no ``overlap_moe_expert_parallel_comm``, whose combined 1F1B runs a forward
and a backward together), so the saved activations peak right after a forward, at
``in flight × layers per chunk`` layers.

The order is Megatron-core's (``megatron/core/pipeline_parallel/schedules.py``; the other stages
only make a stage wait, never reorder it):

* ``forward_backward_no_pipelining`` (P = 1): forward and backward of each microbatch in turn.
* ``forward_backward_pipelining_without_interleaving`` (1F1B): ``W = min(P − r − 1, M)``
  warmup forwards on stage ``r``, then ``M − W`` times one forward and one backward, then the
  ``W`` remaining backwards; backwards go in forward order. Peak ``min(P − r, M)``.
* ``forward_backward_pipelining_with_interleaving`` (``get_forward_backward_func`` picks it
  whenever a virtual size is set, 1 included): the ``M·V`` forward passes follow
  ``get_schedule_table`` — microbatches in groups of ``G`` (``microbatch_group_size_per_vp_stage``,
  default ``P``), each group through chunk 0, then chunk 1, ... (the last group takes the rest).
  Backward pass ``k`` is the ``k``-th entry of the same table with the chunk mirrored
  (``V − 1 − chunk``). ``W = min(2·(P − r − 1) + (V − 1)·G, M·V)`` warmup forwards
  (``get_pp_rank_microbatches``), then forward ``W + k`` and backward ``k`` alternate, then the
  remaining backwards. Peak ``min(W + 1, M·V)`` microbatch-chunks.

Worked example, interleaved, P = 2, V = 2, M = 4 (so G = 2), stage 0: ``W = 2·1 + 1·2 = 4``::

    F(0,c0) F(1,c0) F(0,c1) F(1,c1) | F(2,c0) B(0,c1) F(3,c0) B(1,c1) F(2,c1) B(0,c0)
    F(3,c1) B(1,c0) | B(2,c1) B(3,c1) B(2,c0) B(3,c0)

In flight after each pass: 1 2 3 4 | 5 4 5 4 5 4 5 4 | 3 2 1 0 — peak 5 = W + 1 microbatch-chunks
of L/4 layers, one microbatch's activations of 1.25·L layers (1F1B's stage 0 holds 2
microbatches of L/2 layers: L). Chunk 0 alone peaks at 4 live microbatches (after F(3,c0)),
chunk 1 at 2.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = [
    "InFlight",
    "Pass",
    "PipelineConfig",
    "PipelineSchedule",
    "in_flight",
    "pass_order",
    "schedule_table",
    "warmup_passes",
]


class PipelineSchedule(enum.Enum):
    """The Megatron-core function that runs the step (``get_forward_backward_func``)."""

    NO_PIPELINING = "forward_backward_no_pipelining"
    ONE_F_ONE_B = "forward_backward_pipelining_without_interleaving"
    INTERLEAVED = "forward_backward_pipelining_with_interleaving"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A pipeline layout, checked as Megatron-core 0.16.1 checks it.

    ``virtual_stages`` None is 1F1B (or no pipelining at P = 1); any value, 1 included, is the
    interleaved schedule with that many model chunks per stage, as
    ``get_forward_backward_func(pp_size, vp_size)`` chooses. ``microbatch_group_size`` is
    ``microbatch_group_size_per_vp_stage`` (interleaved only; None: ``P``, Megatron's default).
    """

    pipeline_parallel: int
    microbatches: int
    virtual_stages: int | None = None
    microbatch_group_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("pipeline_parallel", "microbatches", "virtual_stages",
                     "microbatch_group_size"):  # fmt: skip
            value = getattr(self, name)
            if value is None and name in ("virtual_stages", "microbatch_group_size"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        p, m, v = self.pipeline_parallel, self.microbatches, self.virtual_stages
        if v is not None and p == 1:
            raise ValueError(
                f"virtual_stages={v} needs pipeline_parallel > 1: with one stage Megatron-core "
                "runs forward_backward_no_pipelining, which takes a single model chunk"
            )
        if v is None and self.microbatch_group_size is not None:
            raise ValueError(
                f"microbatch_group_size={self.microbatch_group_size} applies to the interleaved "
                "schedule only: give virtual_stages too"
            )
        if v is None:
            return
        g = self.group_size
        # forward_backward_pipelining_with_interleaving's two checks (0.16.1), in its order.
        if not p <= g <= m:
            raise ValueError(
                f"the interleaved schedule needs pipeline_parallel ({p}) <= microbatch group "
                f"size ({g}{'' if self.microbatch_group_size else ', the default: P'}) <= "
                f"microbatches ({m}); give at least {max(p, g)} microbatches"
            )
        if 0 < m % g < p:
            raise ValueError(
                f"the interleaved schedule needs microbatches ({m}) to be a multiple of the "
                f"microbatch group size ({g}) or to leave a remainder >= pipeline_parallel "
                f"({p}); the remainder is {m % g} (Megatron-core raises: dependency bubbles)"
            )

    @property
    def schedule(self) -> PipelineSchedule:
        if self.pipeline_parallel == 1:
            return PipelineSchedule.NO_PIPELINING
        if self.virtual_stages is None:
            return PipelineSchedule.ONE_F_ONE_B
        return PipelineSchedule.INTERLEAVED

    @property
    def chunks(self) -> int:
        """Model chunks per stage."""
        return 1 if self.virtual_stages is None else self.virtual_stages

    @property
    def group_size(self) -> int:
        """Microbatches run back to back through one chunk (interleaved); P by default."""
        return self.microbatch_group_size or self.pipeline_parallel

    def check_layers(self, num_layers: int) -> int:
        """Layers per model chunk, ``num_layers / (P·V)``; ValueError unless it divides."""
        parts = self.pipeline_parallel * self.chunks
        if num_layers < 1 or num_layers % parts:
            raise ValueError(
                f"num_layers={num_layers} must be a positive multiple of pipeline_parallel × "
                f"model chunks = {self.pipeline_parallel} × {self.chunks} = {parts}"
            )
        return num_layers // parts


@dataclasses.dataclass(frozen=True)
class Pass:
    """One forward or backward of ``microbatch`` through model chunk ``chunk`` of a stage."""

    forward: bool
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{'F' if self.forward else 'B'}({self.microbatch},c{self.chunk})"


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A stage's peak of passes forwarded and not yet backwarded.

    ``peak`` counts microbatch-chunks over all chunks at the worst moment (microbatches under
    1F1B); ``chunk_peaks[c]`` is chunk ``c``'s own peak of live microbatches (reached at
    different moments, so they may sum to more than ``peak``).

    ``peak_immediate`` is the largest count right after a forward whose own backward comes
    next (its last layer's tensors are popped first: ``skip_immediate_backward`` keeps them
    unpaged), ``peak_other`` after any other forward; 0 where there is none.
    """

    peak: int
    chunk_peaks: tuple[int, ...]
    peak_immediate: int = 0
    peak_other: int = 0

    def pooled_layers(self, per_chunk: int, skip_immediate_backward: bool) -> int:
        """Layers whose tensors the stage's pool holds at its peak, ``per_chunk`` layers a
        chunk: ``peak × per_chunk``, less the kept last layer of an immediate forward."""
        if not skip_immediate_backward:
            return self.peak * per_chunk
        return max(self.peak_other * per_chunk, self.peak_immediate * per_chunk - 1)


def schedule_table(microbatches: int, chunks: int, group_size: int) -> list[tuple[int, int]]:
    """``(microbatch, chunk)`` of each forward pass in order: Megatron-core's
    ``get_schedule_table``. PP 2, V 2, M 5, G 3: ``(0,0) (1,0) (2,0) (0,1) (1,1) (2,1) (3,0)
    (4,0) (3,1) (4,1)``."""
    table = []
    for first in range(0, microbatches, group_size):
        last = microbatches if first + group_size >= microbatches else first + group_size
        table += [(mb, c) for c in range(chunks) for mb in range(first, last)]
    return table


def warmup_passes(pipeline: PipelineConfig, rank: int) -> int:
    """Forward passes stage ``rank`` runs before its first backward (``num_warmup_microbatches``
    of Megatron-core, capped at the step's passes as Megatron caps it)."""
    p, total = pipeline.pipeline_parallel, pipeline.microbatches * pipeline.chunks
    if not 0 <= rank < p:
        raise ValueError(f"rank must be in [0, {p}), got {rank}")
    schedule = pipeline.schedule
    if schedule is PipelineSchedule.NO_PIPELINING:
        return 0
    if schedule is PipelineSchedule.ONE_F_ONE_B:
        return min(p - rank - 1, total)
    warmup = (p - rank - 1) * 2 + (pipeline.chunks - 1) * pipeline.group_size
    return min(warmup, total)


def pass_order(pipeline: PipelineConfig, rank: int) -> list[Pass]:
    """Every pass stage ``rank`` runs in one step, in Megatron-core's order (module docstring)."""
    warmup = warmup_passes(pipeline, rank)
    v = pipeline.chunks
    table = schedule_table(pipeline.microbatches, v, pipeline.group_size)
    forwards = [Pass(True, mb, c) for mb, c in table]
    backwards = [Pass(False, mb, v - 1 - c) for mb, c in table]
    if pipeline.schedule is PipelineSchedule.NO_PIPELINING:  # F0 B0 F1 B1 ...
        return [p for pair in zip(forwards, backwards) for p in pair]
    order = forwards[:warmup]
    for k in range(len(table) - warmup):  # steady state: one forward, then one backward
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[len(table) - warmup :]


def in_flight(pipeline: PipelineConfig, rank: int) -> InFlight:
    """Run :func:`pass_order` and count the live microbatch-chunks after every pass."""
    live: list[set[int]] = [set() for _ in range(pipeline.chunks)]
    peak, chunk_peaks = 0, [0] * pipeline.chunks
    peaks = {True: 0, False: 0}  # after an immediate forward, after another
    order = pass_order(pipeline, rank)
    for i, p in enumerate(order):
        if p.forward:
            assert p.microbatch not in live[p.chunk], p  # forwarded twice
            live[p.chunk].add(p.microbatch)
            chunk_peaks[p.chunk] = max(chunk_peaks[p.chunk], len(live[p.chunk]))
            count = sum(map(len, live))
            peak = max(peak, count)
            nxt = order[i + 1] if i + 1 < len(order) else None
            immediate = nxt == Pass(False, p.microbatch, p.chunk)
            peaks[immediate] = max(peaks[immediate], count)
        else:
            assert p.microbatch in live[p.chunk], p  # backward of a pass never forwarded
            live[p.chunk].remove(p.microbatch)
    assert not any(live), live  # every pass backwarded by the end of the step
    return InFlight(peak, tuple(chunk_peaks), peaks[True], peaks[False])
