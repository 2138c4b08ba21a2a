"""What an expert MLP layer stashes, the pool a pipeline stage's manager sizes after its
capture step, and the capacity model: the planner's arithmetic that :mod:`te_paged.jax` shares
with the torch side (free of torch).

Under pipeline parallelism (:func:`pipeline_pool_plan`) a stage holds the saved activations of
several microbatches at its peak (:mod:`te_paged.runtime.schedules`): its pool is sized as the
manager sizes it after the capture step, from the peak of live tensors, ``in flight × layers per
chunk`` layers' worth, each tensor's balanced rows rounded up to whole pages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

from te_paged.runtime.schedules import InFlight, PipelineConfig, in_flight

__all__ = [
    "SavedTensor",
    "StagePool",
    "capacity_model_saving",
    "expert_mlp_saved_tensors",
    "pipeline_pool_plan",
    "reload_adjusted_saving",
    "stashed_bytes_per_token",
]


def stashed_bytes_per_token(
    hidden: int,
    ffn: int,
    *,
    gated: bool = True,
    itemsize: int = 2,
    fp8: str | None = None,
    fp8_activation_input: bool = False,
) -> float:
    """Bytes the expert MLP saves per routed token: FC1 input (H), activation input (2F gated),
    probability (4 bytes, fp32), FC2 input (F), stored as :func:`expert_mlp_saved_tensors`
    says (``fp8``: the FC1 and FC2 inputs at the recipe's bytes, scales included: 1 byte an
    element tensorwise, 1 + 1/32 MXFP8, 0.5 + 1/16 NVFP4, i.e. 4.5 bits)."""
    saved = expert_mlp_saved_tensors(
        hidden, ffn, gated=gated, itemsize=itemsize, fp8=fp8,
        fp8_activation_input=fp8_activation_input,
    )  # fmt: skip
    total = sum(Fraction(t.row_bytes, t.tokens_per_row) for t in saved)
    return int(total) if total.denominator == 1 else float(total)


#: The dtype a stashed element of ``itemsize`` bytes stands for, as pool keys name it.
_DTYPE_NAMES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}
#: ``MoEConfig.fp8``'s recipes (te_paged.grouped.fp8.Fp8Recipe), and None.
_FP8_RECIPES = (None, "tensorwise", "mxfp8", "nvfp4")


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One tensor a layer stashes per microbatch: the pool it lands in (``key``, as
    :class:`~te_paged.stash.StashKey` prints it: ``dtype x width``), the bytes of one of its rows
    and the tokens per row (1; 32 for an MXFP8 scale-inverse)."""

    key: str
    row_bytes: int
    tokens_per_row: int = 1


def expert_mlp_saved_tensors(
    hidden: int,
    ffn: int,
    *,
    gated: bool = True,
    itemsize: int = 2,
    fp8: str | None = None,
    fp8_activation_input: bool = False,
) -> tuple[SavedTensor, ...]:
    """What te_paged's expert MLP stashes per layer (the tensors of
    :func:`stashed_bytes_per_token`), in the order its manager meets them: FC1 input
    ``[rows, H]``, activation input ``[rows, 2F]`` (``F`` not gated), probabilities
    ``[rows, 1]`` fp32, FC2 input ``[rows, F]``, the activations of ``itemsize`` bytes. With an
    ``fp8`` recipe (``MoEConfig.fp8``) the FC1 and FC2 inputs, and with
    ``fp8_activation_input`` (``activation_func_fp8_input_store``) the activation input, are
    stored as :class:`~te_paged.grouped.fp8.Fp8Tensor` pages them: ``tensorwise`` e4m3 data;
    ``mxfp8`` e4m3 data and an e8m0 scale per 32 rows of a column (one scale row per 32
    tokens); ``nvfp4`` E2M1 data packed two to a byte and an e4m3 scale per 16 elements of a
    row — 4.5 bits an element (the float32 per-tensor scale rides with the record)."""
    if itemsize not in _DTYPE_NAMES:
        raise ValueError(f"itemsize must be one of {sorted(_DTYPE_NAMES)}, got {itemsize!r}")
    if fp8 not in _FP8_RECIPES:
        raise ValueError(f"fp8 must be one of {_FP8_RECIPES[1:]} or None, got {fp8!r}")
    if fp8_activation_input and fp8 is None:
        raise ValueError("fp8_activation_input needs an fp8 recipe")
    name = _DTYPE_NAMES[itemsize]
    act_in = (2 if gated else 1) * ffn

    def stored(width: int, quantised: bool) -> list[SavedTensor]:
        if not quantised:
            return [SavedTensor(f"{name}x{width}", width * itemsize)]
        if fp8 == "tensorwise":
            return [SavedTensor(f"float8_e4m3fnx{width}", width)]
        if fp8 == "mxfp8":
            return [SavedTensor(f"float8_e4m3fnx{width}", width),
                    SavedTensor(f"float8_e8m0fnux{width}", width, tokens_per_row=32)]  # fmt: skip
        if width % 16:
            raise ValueError(f"NVFP4 scales blocks of 16 elements: width {width} is not a multiple")
        return [SavedTensor(f"uint8x{width // 2}", width // 2),
                SavedTensor(f"float8_e4m3fnx{width // 16}", width // 16)]  # fmt: skip

    return (
        *stored(hidden, fp8 is not None),
        *stored(act_in, fp8_activation_input),
        SavedTensor("float32x1", 4),
        *stored(ffn, fp8 is not None),
    )


@dataclasses.dataclass(frozen=True)
class StagePool:
    """One pipeline stage's peak and the pool the manager sizes from it (per key: pages)."""

    stage: int
    in_flight: InFlight  # peak of passes forwarded, not backwarded (microbatch-chunks)
    live_layers: int  # in_flight.peak × layers per chunk: layers' tensors held at the peak
    pooled_layers: int  # of those, the layers in the pool (skip_immediate_backward keeps one)
    peak_balanced_pages: dict[str, int]  # what the capture step records
    pool_pages: dict[str, int]  # ceil(buffer_factor × peak balanced pages), at least 1
    pool_bytes: dict[str, int]
    s_bytes: int  # S: balanced-case bytes of the tensors live at the peak
    static_bytes: float  # OFF: the same tensors at their static size, capacity_factor × S
    # The capacity model, (capacity_factor − bf) × S, and less one layer reloaded at static
    # size, (cf − bf − cf/layers)·S, with bf the pool over S: buffer_factor × pooled/live layers.
    saving_bytes: float
    peak_saving_bytes: float

    @property
    def total_pool_bytes(self) -> int:
        return sum(self.pool_bytes.values())

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["in_flight"] = self.in_flight.peak
        d["chunk_peaks"] = list(self.in_flight.chunk_peaks)
        d["total_pool_bytes"] = self.total_pool_bytes
        return d


def pipeline_pool_plan(
    *,
    pipeline_parallel: int,
    microbatches: int,
    num_layers: int,
    balanced_rows: int,
    saved: Sequence[SavedTensor],
    virtual_stages: int | None = None,
    microbatch_group_size: int | None = None,
    page_size: int = 64,
    buffer_factor: float = 1.10,
    capacity_factor: float = 2.0,
    skip_immediate_backward: bool = True,
) -> list[StagePool]:
    """Each pipeline stage's in-flight peak and the pool its manager allocates after capture.

    ``num_layers`` stashing layers (MoE layers) split evenly over ``pipeline_parallel × chunks``
    model chunks; every layer stashes ``saved`` per microbatch with ``balanced_rows`` balanced
    rows (``N·k``: the scope's ``avg_num_tokens``); one manager per stage, shared by its chunks.
    As the manager counts it, a live tensor takes ``ceil(min(balanced, static) rows / page)``
    pages (static rows: ``ceil(capacity_factor × balanced)``), the capture peak is ``live_layers
    × Σ pages`` per key — the peak comes right after a forward pass, when every layer of the
    in-flight passes is live — and the pool ``max(1, ceil(buffer_factor × peak))`` pages, the
    manager's expression, float rounding included (``ceil(1.1 × 50)`` is 56). With
    ``skip_immediate_backward`` (:class:`~te_paged.config.MoEConfig`'s
    ``moe_paged_stash_skip_immediate_backward``) a
    forward whose backward comes next (PP 1, a last stage under 1F1B) keeps its last layer
    out of the pool (:meth:`~te_paged.runtime.schedules.InFlight.pooled_layers`).

    With ``pipeline_parallel = 1`` this is the plan of one microbatch in flight (Megatron-core
    runs forward and backward of each microbatch in turn), whatever ``microbatches`` is.
    Layouts Megatron-core 0.16.1 refuses raise ``ValueError`` (see
    :class:`~te_paged.runtime.schedules.PipelineConfig`).
    """

    pipeline = PipelineConfig(
        pipeline_parallel, microbatches, virtual_stages, microbatch_group_size
    )
    per_chunk = pipeline.check_layers(num_layers)
    for name, value in (("balanced_rows", balanced_rows), ("page_size", page_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    for name, value in (("buffer_factor", buffer_factor), ("capacity_factor", capacity_factor)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if not saved:
        raise ValueError("saved is empty: give the tensors each layer stashes")
    static_rows = math.ceil(capacity_factor * balanced_rows)
    pages_per_layer: dict[str, int] = {}
    for t in saved:
        rows = min(-(-balanced_rows // t.tokens_per_row), -(-static_rows // t.tokens_per_row))
        pages_per_layer[t.key] = pages_per_layer.get(t.key, 0) + -(-rows // page_size)
    row_bytes = {t.key: t.row_bytes for t in saved}
    if len(row_bytes) != len({(t.key, t.row_bytes) for t in saved}):
        raise ValueError("saved has one key with two row sizes: a key is one (dtype, width)")
    bytes_per_token = sum(t.row_bytes / t.tokens_per_row for t in saved)
    plans = []
    for stage in range(pipeline_parallel):
        flight = in_flight(pipeline, stage)
        layers = flight.peak * per_chunk
        pooled = flight.pooled_layers(per_chunk, skip_immediate_backward)
        peak = {k: pooled * n for k, n in pages_per_layer.items()}
        pool = {k: max(1, math.ceil(buffer_factor * n)) for k, n in peak.items()}
        s_bytes = math.ceil(layers * balanced_rows * bytes_per_token)
        bf = buffer_factor * pooled / layers
        plans.append(
            StagePool(
                stage=stage,
                in_flight=flight,
                live_layers=layers,
                pooled_layers=pooled,
                peak_balanced_pages=peak,
                pool_pages=pool,
                pool_bytes={k: n * page_size * row_bytes[k] for k, n in pool.items()},
                s_bytes=s_bytes,
                static_bytes=capacity_factor * s_bytes,
                saving_bytes=capacity_model_saving(capacity_factor, bf, s_bytes),
                peak_saving_bytes=reload_adjusted_saving(capacity_factor, bf, s_bytes, layers),
            )
        )
    return plans


def capacity_model_saving(capacity_factor: float, buffer_factor: float, s_bytes: float) -> float:
    """Predicted peak saving of paged stashing: ``(capacity_factor − buffer_factor) × S``."""
    return (capacity_factor - buffer_factor) * s_bytes


def reload_adjusted_saving(
    capacity_factor: float,
    buffer_factor: float,
    s_bytes: float,
    layers: int,
    reload_layers: int = 1,
) -> float:
    """The capacity model less the reloads live at the peak: ``(cf − bf − R · cf / L) × S``.

    Backward pops a layer's tensors into static-size buffers (``cf × S / L``) while the pool
    still holds the layers not yet reached, so at the peak one layer's worth is held twice;
    ``reload_layers`` ``R`` is 1, or ``1 + reload_lookahead`` when a manager with stream
    overlap prefetches earlier layers. ``buffer_factor`` is the pool over ``S``: where
    ``skip_immediate_backward`` keeps the last layer unpaged (its tensors are then the first
    layer's reload), the pool holds ``(L − 1)/L`` of the configured factor's. Example: 8
    layers, cf 2.0, bf 1.1 → 0.65 S instead of 0.9 S; 4 layers, cf 1.5 → 0.025 S, almost
    nothing — fewer, larger layers leave paging less to gain.
    """
    live = reload_layers * capacity_factor / layers
    return (capacity_factor - buffer_factor - live) * s_bytes
