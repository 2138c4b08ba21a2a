"""Size the static budgets from a recorded routing profile; print a named model's sizes.

Profile: ``tokens[step][layer][expert]`` routed tokens, for a model with ``num_experts`` experts
over ``ep_size`` ranks (rank ``r`` holds experts ``[r·E/P, (r+1)·E/P)``), ``tokens_per_rank``
input tokens per rank and top-``k`` routing, so a rank's balanced load is ``N·k`` rows.
Optionally ``tokens_by_source[step][layer][source][expert]``: the same counts split by the rank
the tokens came from (what :class:`~te_paged.runtime.PagedStashRunner` records), a profile
"step" being one forward pass of every MoE layer.

For one step:

* the **capacity factor** it needs: te_paged's dispatcher lets each source rank send at most
  ``C = cf·N·k / P`` rows to each destination rank, so with ``tokens_by_source`` it is ``max
  over layers and (source, destination) pairs of rows × P / (N·k)`` — exact: any pair over its
  budget reruns the step. Without it only the per-rank totals are known, and ``max over layers
  and ranks of received / (N·k)`` is a lower bound (a one-sided skew fills a pair first);
* the **receive factor** a budget per receiving rank needs (Megatron's and torchtitan's
  HybridEP dispatchers, which write only the real rows into one static buffer per rank): ``max
  over layers and ranks of received / (N·k)``, exact from the totals, each local expert's rows
  rounded up to HybridEP's ``pad_multiple`` when it pads;
* the **CUDA buffer factor** it needs is ``max over ranks of Σ_layers received / (L·N·k)`` —
  the stash pool is shared by all layers, so skew averages over layers (the point of paging).

Worked example (2 ranks, 2 experts, N·k = 8): rank 0 routes all 8 rows to expert 0 (on rank 0)
and rank 1 all 8 to expert 1 (rank 1). Each rank receives 8 = N·k rows (per-rank need 1.0), but
the pairs (0→0) and (1→1) carry 8 rows against ``C = cf·8/2``: the budget needs ``cf = 2.0``.

A factor that covers the ``1 − target_rerun_rate`` quantile of the per-step needs reruns at
most that fraction of steps. Memory per choice: te_paged's static expert buffers cost
``expert_capacity_factor × S`` and the pool ``buffer_factor × S``, with ``S`` the balanced-case
bytes of the stashed activations (``N·k × bytes_per_token × L``).

What a layer stashes, a pipeline stage's pool and the capacity model are in
:mod:`te_paged.runtime.pool_plan` (re-exported here).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from te_paged.runtime.pool_plan import (
    SavedTensor,
    StagePool,
    capacity_model_saving,
    expert_mlp_saved_tensors,
    pipeline_pool_plan,
    reload_adjusted_saving,
    stashed_bytes_per_token,
)

__all__ = [
    "NAMED_CONFIGS",
    "FactorChoice",
    "NamedConfig",
    "RoutingProfile",
    "SavedTensor",
    "StagePool",
    "capacity_model_saving",
    "expert_mlp_saved_tensors",
    "min_profile_steps",
    "named_sizes",
    "pipeline_pool_plan",
    "recommend",
    "reload_adjusted_saving",
    "stashed_bytes_per_token",
]


@dataclasses.dataclass
class RoutingProfile:
    num_experts: int
    ep_size: int
    top_k: int
    tokens_per_rank: int
    tokens: list[list[list[int]]] | None = None  # [step][layer][expert], all sources
    tokens_by_source: list[list[list[list[int]]]] | None = None  # [step][layer][source][expert]

    def __post_init__(self) -> None:
        for name in ("num_experts", "ep_size", "top_k", "tokens_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} is more than num_experts={self.num_experts}")
        if self.tokens is not None:
            _check_counts("tokens", self.tokens, 3)
        if self.tokens_by_source is not None:
            _check_counts("tokens_by_source", self.tokens_by_source, 4)
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}"
            )
        if self.tokens_by_source is not None:
            summed = []
            for s, step in enumerate(self.tokens_by_source):
                for layer, sources in enumerate(step):
                    if len(sources) != self.ep_size:
                        raise ValueError(
                            f"tokens_by_source step {s} layer {layer} has {len(sources)} "
                            f"source ranks, expected ep_size={self.ep_size}"
                        )
                    self._check_experts(sources, f"tokens_by_source step {s} layer {layer}")
                summed.append([[sum(col) for col in zip(*sources)] for sources in step])
            if self.tokens is None:
                self.tokens = summed
            elif self.tokens != summed:
                raise ValueError("tokens is not tokens_by_source summed over source ranks")
        if not self.tokens:
            raise ValueError("the routing profile has no steps (give tokens or tokens_by_source)")
        for s, step in enumerate(self.tokens):
            self._check_experts(step, f"step {s}")

    def _check_experts(self, rows: list[list[int]], where: str) -> None:
        for i, counts in enumerate(rows):
            if len(counts) != self.num_experts:
                raise ValueError(
                    f"{where} [{i}] has {len(counts)} experts, expected {self.num_experts}"
                )

    @property
    def balanced(self) -> int:
        return self.tokens_per_rank * self.top_k

    @property
    def pairwise(self) -> bool:
        """True when the capacity needs are exact for the per-pair budget (counts by source)."""
        return self.tokens_by_source is not None

    def _by_rank(self, counts: list[int]) -> list[int]:
        per = self.num_experts // self.ep_size
        return [sum(counts[r * per : (r + 1) * per]) for r in range(self.ep_size)]

    def received(self, step: int) -> list[list[int]]:
        """``[layer][rank]`` rows each rank receives."""
        return [self._by_rank(counts) for counts in self.tokens[step]]

    def capacity_needs(self) -> list[float]:
        """Per step, the capacity factor the dispatch budget needed (see the module docstring:
        exact per pair with ``tokens_by_source``, else a per-rank lower bound)."""
        if self.tokens_by_source is None:
            return self.receive_needs()
        return [
            max(max(self._by_rank(src)) for sources in step for src in sources)
            * self.ep_size
            / self.balanced
            for step in self.tokens_by_source
        ]

    def peak_received(self, pad_multiple: int = 1) -> list[int]:
        """Per step, the most rows one rank received in one layer, each local expert's rows
        rounded up to ``pad_multiple`` (HybridEP pads every expert's block to it)."""
        per = self.num_experts // self.ep_size
        pad = max(1, pad_multiple)
        return [
            max(
                sum(-(-c // pad) * pad for c in counts[r * per : (r + 1) * per])
                for counts in step
                for r in range(self.ep_size)
            )
            for step in self.tokens
        ]

    def receive_needs(self, pad_multiple: int = 1) -> list[float]:
        """Per step, the factor a budget per *receiving rank* needed (Megatron's HybridEP,
        ``moe_expert_rank_capacity_factor × N·k`` rows): :meth:`peak_received` over the
        balanced rows. Exact from per-expert totals; te_paged's per-pair budget needs at least
        this much."""
        return [rows / self.balanced for rows in self.peak_received(pad_multiple)]

    @property
    def worst_case_received(self) -> int:
        """The rows one rank can receive at most, ``N·P·min(L, k)``: what torchtitan's
        HybridEP ``non_blocking_capacity_factor`` multiplies (1.0 never drops)."""
        local = self.num_experts // self.ep_size
        return self.tokens_per_rank * self.ep_size * min(local, self.top_k)

    def buffer_needs(self) -> list[float]:
        needs = []
        for s in range(len(self.tokens)):
            recv = self.received(s)
            layers = len(recv)
            needs.append(
                max(sum(layer[r] for layer in recv) for r in range(self.ep_size))
                / (layers * self.balanced)
            )
        return needs

    def to_json_text(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json_text())

    @classmethod
    def load(cls, path: str | Path) -> RoutingProfile:
        """JSON (the fields above) or CSV: a ``#`` line ``num_experts,ep_size,top_k,
        tokens_per_rank`` of values, then a header and rows ``step,layer,expert,tokens`` or,
        split by source rank, ``step,layer,source,expert,tokens``."""
        path = Path(path)
        if path.suffix == ".json":
            try:
                data = json.loads(path.read_text(), parse_constant=_no_constant)
            except RecursionError:
                raise ValueError("nested too deeply to be a routing profile") from None
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(data) - fields)
            if unknown:
                raise ValueError(f"unknown field(s) {unknown}; a profile has {sorted(fields)}")
            return cls(**data)
        if path.suffix != ".csv":
            raise ValueError(f"routing profile must be .json or .csv, got {path.name}")
        lines = path.read_text().splitlines()
        meta = dict(
            zip(
                ("num_experts", "ep_size", "top_k", "tokens_per_rank"),
                map(int, lines[0].lstrip("#").split(",")),
            )
        )
        rows = list(csv.DictReader(lines[1:]))
        steps = 1 + max(int(r["step"]) for r in rows)
        layers = 1 + max(int(r["layer"]) for r in rows)
        by_source = "source" in rows[0]
        sources = meta["ep_size"] if by_source else 1
        tokens = [
            [[[0] * meta["num_experts"] for _ in range(sources)] for _ in range(layers)]
            for _ in range(steps)
        ]
        for r in rows:
            src = int(r["source"]) if by_source else 0
            tokens[int(r["step"])][int(r["layer"])][src][int(r["expert"])] = int(r["tokens"])
        if by_source:
            return cls(tokens_by_source=tokens, **meta)
        return cls(tokens=[[layer[0] for layer in step] for step in tokens], **meta)


_MAX_COUNT = 2**53  # tokens routed to one expert in one step: past this, not a count


def _no_constant(constant: str) -> None:
    raise ValueError(f"{constant} is not a token count")


def _check_counts(name: str, rows: object, depth: int) -> None:
    """``rows`` nested ``depth`` lists deep (steps, layers[, sources], experts) of counts:
    every level a non-empty list, every count an integer in [0, 2**53). Raises naming the
    field and the index of the first bad entry."""

    names = (
        ("steps", "layers", "source ranks", "experts")
        if depth == 4
        else ("steps", "layers", "experts")
    )

    def walk(value: object, where: str, level: int) -> None:
        if level == depth:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{where} must be an integer token count, got {value!r}")
            if not 0 <= value < _MAX_COUNT:
                raise ValueError(f"{where} must be in [0, 2**53), got {value}")
            return
        if not isinstance(value, list) or not value:
            what = names[level]
            raise ValueError(f"{where} must be a non-empty list of {what}, got {value!r:.60}")
        for i, item in enumerate(value):
            walk(item, f"{where}[{i}]", level + 1)

    walk(rows, name, 0)
    layers = {len(step) for step in rows}  # type: ignore[union-attr]
    if len(layers) > 1:
        raise ValueError(f"{name}: the steps have different numbers of layers {sorted(layers)}")


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[idx]


def _round_up(x: float) -> float:
    return math.ceil(x * 100 - 1e-9) / 100


def min_profile_steps(target_rerun_rate: float) -> int:
    """The fewest profiled steps that can show a rerun rate of ``target_rerun_rate``.

    Over ``n`` steps a rate is measured in units of ``1/n``: with 2 steps the recommendation
    for a 1 % target covers the worse of the two (0 % of the profile reruns), which says
    nothing about 1 % of training. ``ceil(1 / target_rerun_rate)`` steps (100 for 1 %) let
    one step in the profile stand for the rate allowed to rerun.
    """
    if not 0 < target_rerun_rate < 1:
        raise ValueError(f"target_rerun_rate must be in (0, 1), got {target_rerun_rate}")
    return math.ceil(1 / target_rerun_rate - 1e-9)


@dataclasses.dataclass
class FactorChoice:
    """What :func:`recommend` chose. ``capacity_factor`` is te_paged's per-pair budget: the
    factor to start its wire at (``moe_a2a_capacity_factor``); ``expert_capacity_factor`` its
    expert buffer (``moe_expert_rank_capacity_factor``), the largest profiled need ×
    ``capacity_headroom``, room for the runner to raise the wire into after a step over it.
    ``receive_capacity_factor`` is the same target for a budget per receiving rank (Megatron's
    HybridEP dispatcher's ``moe_expert_rank_capacity_factor``), and
    ``non_blocking_capacity_factor`` that budget as torchtitan's HybridEP states it, a fraction
    of :attr:`RoutingProfile.worst_case_received` (at most 1.0)."""

    target_rerun_rate: float
    capacity_factor: float
    buffer_size_factor_cuda: float
    buffer_size_factor_cpu: float
    rerun_rate_capacity: float  # fraction of profiled steps over the capacity factor
    rerun_rate_stash: float  # fraction of profiled steps overflowing cuda + cpu pools
    spill_rate: float  # fraction of steps spilling to the host tier (no rerun)
    static_bytes: int | None  # expert buffers' saved activations without stashing
    pool_bytes: int | None  # CUDA pool
    host_pool_bytes: int | None
    expert_capacity_factor: float  # te_paged's expert buffer: the most the wire grows to
    receive_capacity_factor: float  # a budget per receiving rank (Megatron HybridEP)
    rerun_rate_receive: float  # fraction of profiled steps over the receive budget
    non_blocking_capacity_factor: float  # the receive budget over the worst case (torchtitan)


def _fitting(rows: int, whole: int) -> float:
    """The smallest factor in steps of 0.01 whose ``int(whole × factor)`` holds ``rows``."""
    factor = _round_up(rows / whole)
    while int(whole * factor) < rows:
        factor = round(factor + 0.01, 2)
    return factor


def recommend(
    profile: RoutingProfile,
    target_rerun_rate: float = 0.01,
    *,
    host_spill: bool = False,
    bytes_per_token: int | None = None,
    num_layers: int | None = None,
    capacity_headroom: float = 1.10,
    pad_multiple: int = 1,
) -> FactorChoice:
    """Factors whose profiled rerun rate is at most ``target_rerun_rate`` (see
    :class:`FactorChoice`); ``capacity_headroom`` as the runner's (its default too), and
    ``pad_multiple`` HybridEP's per-expert padding of the received rows.

    With ``host_spill`` the CUDA factor covers the median step and a host tier covers the rest
    up to the target quantile (spilling costs bandwidth, not a rerun).
    """
    if not 0 <= target_rerun_rate < 1:
        raise ValueError(f"target_rerun_rate must be in [0, 1), got {target_rerun_rate}")
    if not capacity_headroom >= 1:
        raise ValueError(f"capacity_headroom must be >= 1, got {capacity_headroom}")
    cap_needs, buf_needs = profile.capacity_needs(), profile.buffer_needs()
    q = 1 - target_rerun_rate
    cap = _round_up(max(1.0, _quantile(cap_needs, q)))
    expert = max(cap, _round_up(max(cap_needs) * capacity_headroom))
    received = profile.peak_received(pad_multiple)
    recv_rows = max(profile.balanced, round(_quantile(received, q)))
    recv = _fitting(recv_rows, profile.balanced)
    non_blocking = min(1.0, _fitting(recv_rows, profile.worst_case_received))
    total = _round_up(_quantile(buf_needs, q))
    cuda, cpu = (_round_up(_quantile(buf_needs, 0.5)), 0.0) if host_spill else (total, 0.0)
    if host_spill:
        cpu = _round_up(max(0.0, total - cuda))
    n = len(cap_needs)
    s_bytes = None
    if bytes_per_token is not None:
        layers = num_layers if num_layers is not None else len(profile.tokens[0])
        s_bytes = profile.balanced * bytes_per_token * layers
    return FactorChoice(
        target_rerun_rate=target_rerun_rate,
        capacity_factor=cap,
        buffer_size_factor_cuda=cuda,
        buffer_size_factor_cpu=cpu,
        rerun_rate_capacity=sum(c > cap for c in cap_needs) / n,
        rerun_rate_stash=sum(b > cuda + cpu for b in buf_needs) / n,
        spill_rate=sum(cuda < b <= cuda + cpu for b in buf_needs) / n,
        static_bytes=None if s_bytes is None else math.ceil(expert * s_bytes),
        pool_bytes=None if s_bytes is None else math.ceil(cuda * s_bytes),
        host_pool_bytes=None if s_bytes is None else math.ceil(cpu * s_bytes),
        expert_capacity_factor=expert,
        receive_capacity_factor=recv,
        rerun_rate_receive=sum(r > int(profile.balanced * recv) for r in received) / n,
        non_blocking_capacity_factor=non_blocking,
    )


@dataclasses.dataclass(frozen=True)
class NamedConfig:
    name: str
    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    moe_layers: int


NAMED_CONFIGS = {
    "deepseek-v3": NamedConfig(
        "deepseek-v3", hidden=7168, ffn=2048, num_experts=256, top_k=8, moe_layers=58
    ),
}


def named_sizes(
    cfg: NamedConfig,
    *,
    seq: int,
    batch: int,
    ep: int,
    capacity_factor: float,
    buffer_factor: float,
    layers: int | None = None,
    ring_of_experts: bool = False,
    itemsize: int = 2,
    skip_immediate_backward: bool = True,
    fp8: str | None = None,
) -> dict[str, float]:
    """Sizes per rank, in bytes, for a model with no run.

    ``ring_of_experts`` reproduces MaxText's layout (every rank's buffer holds the tokens of
    all EP ranks: worst case ``batch·EP·seq·k`` rows, of which ``1/EP`` are expected);
    otherwise a rank's balanced load is ``batch·seq·k`` rows and its static buffer
    ``capacity_factor`` times that (Megatron's HybridEP budget).

    ``skip_immediate_backward`` (``moe_paged_stash_skip_immediate_backward``; not for the ring
    of experts, whose JAX port pages every layer) keeps the last layer, whose backward comes
    first, out of the pool: it holds ``(L − 1)/L`` of ``buffer_factor × S``. ``fp8`` (a
    recipe of ``MoEConfig.fp8``) prices the FC1 and FC2 inputs as
    :func:`expert_mlp_saved_tensors` stores them (NVFP4: 4.5 bits an element).
    """

    layers = cfg.moe_layers if layers is None else layers
    if ring_of_experts:
        worst = batch * ep * seq * cfg.top_k
        balanced = worst // ep
    else:
        balanced = batch * seq * cfg.top_k
        worst = math.ceil(balanced * capacity_factor)
    row = cfg.hidden * itemsize  # one saved activation of width H, e.g. the FC2 output
    per_token = stashed_bytes_per_token(cfg.hidden, cfg.ffn, itemsize=itemsize, fp8=fp8)
    s_bytes = balanced * per_token * layers
    bf = buffer_factor * (layers - 1) / layers if skip_immediate_backward else buffer_factor
    return {
        "worst_case_rows": worst,
        "balanced_rows": balanced,
        "hidden_row_bytes_per_layer_static": worst * row,
        "hidden_row_bytes_all_layers_static": worst * row * layers,
        "hidden_row_bytes_all_layers_balanced": balanced * row * layers,
        "mlp_saved_bytes_static": (worst / balanced) * s_bytes,
        "mlp_saved_bytes_pool": bf * s_bytes,
        "S_bytes": s_bytes,
        "pool_over_S": bf,
        "predicted_saving_bytes": capacity_model_saving(worst / balanced, bf, s_bytes),
        "peak_saving_bytes": reload_adjusted_saving(worst / balanced, bf, s_bytes, layers),
    }
