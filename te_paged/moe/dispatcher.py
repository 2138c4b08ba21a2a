"""``StaticBudgetDispatcher``: expert-parallel token exchange with a static, sync-free budget.

Shape suffixes: ``N`` local tokens, ``K`` top-k, ``A = N·K`` (token, k) assignments, ``H``
hidden, ``P`` ranks of the expert-parallel group, ``L`` local experts (``E / P``), ``C`` pair
capacity (rows one rank may send to one rank: the wire budget), ``S = P·C`` slots of a
send/receive buffer, ``T`` rows handed to the experts (the expert buffer ``max_num_tokens`` in
static mode, the real rows in dropless mode).

Global expert ``e`` lives on rank ``e // L`` as local expert ``e % L``.

**Two budgets (static mode).** The *expert buffer* is ``T = max_num_tokens =
config.max_num_tokens(N)`` (``N·K·cf`` rounded up, MXFP8 to 32, then to a multiple of ``lcm(P, 32 if
MXFP8 else 1)``): the static shape of everything the experts compute and save. The *wire* is
smaller: ``all_to_all_single`` needs equal splits to stay sync-free, so every rank sends every rank
a block of ``C`` rows, ``C = split_rows(N·K·a2a, P) / P`` with ``a2a = a2a_capacity_factor <= cf``.
Unset ("auto", :attr:`~StaticBudgetDispatcher.wire_auto`) it starts at ``cf`` and a runner sets it
from its first steps' demand; either way the runner raises it as routing needs, up to ``cf``. An
exchange moves ``P·C`` rows, not ``T``: about ``a2a ×`` the rows of a dropless exchange instead of
``cf ×``. The received ``P·C <= T`` rows are padded with zero rows to ``T`` for the experts. The
budget is *per (source, destination) pair*: an assignment whose position among its source's
assignments to that destination is ``>= C`` is dropped from this attempt, counted on the *source*
rank in :attr:`~StaticBudgetDispatcher.over_budget` and
:attr:`~StaticBudgetDispatcher.dropped_tokens` (device int64), and the runner reruns the step.

**Dispatch**::

    slot of (n, k) = dest·C + position       (position: cumsum over a [A, P] one-hot, in
                                              token-major (n, k) order; over C → dropped)
    send_SH, probs_S, local_expert_S         (empty slots: zero row, zero prob, sentinel L)
    ── all_to_all_single (equal splits) ──▶  recv_SH (block s = rows from source rank s)
    stable sort by local expert (sentinel L last), zero rows appended up to T
    ─▶ permuted_TH, tokens_per_expert_L, permuted_probs_T

Permutation order of the real rows: (local expert, source rank, source token, k). The dropless
mode (``capacity_factor=None``) runs the same code with ``C`` = the largest pair count over the
group (one host read plus an ``all_reduce(MAX)``) and strips the padding (keeping, with MXFP8,
zero rows up to a multiple of 32), so when nothing is dropped both modes hand the experts the
same rows in the same order, bit for bit, whatever the wire budget.

**Combine** (TEGroupedMLP already weighted each row by its probability, so this is an
*unweighted* sum): inverse permutation, all-to-all back, gather each assignment's row (dropped
ones read a zero row) and ``sum`` over the K slots of ``[N, K, H]`` — a fixed-order reduction,
no atomics. Every step is differentiable; the all-to-all's backward is the reverse all-to-all.

**Bytes on the wire.** Every exchange adds what this rank hands ``all_to_all_single`` (every
block, its own included, and the expert-id metadata) to the host int :attr:`bytes_sent`, in
forward and in backward; the device counter :attr:`dropless_bytes` adds what a dropless,
variable-split exchange of the same routing would move: each routed assignment's row once per
exchange, no metadata. Neither needs a host read (:meth:`reset_traffic` zeroes both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from te_paged.config import MoEConfig
from te_paged.config.budget import rank_rows, round_up, split_rows
from te_paged.config.checks import require_real
from te_paged.kernels.compiled import HostCall, host_call
from te_paged.moe.all_to_all import AllToAll, all_to_all
from te_paged.moe.config_adapter import as_moe_config
from te_paged.torch_compat import assume_constant_result, backward_running

__all__ = ["DispatchHandle", "StaticBudgetDispatcher", "static_budget"]


class _FromConfig:
    def __repr__(self) -> str:
        return "<from config>"


#: Default of ``capacity_factor``: use ``config.moe_expert_rank_capacity_factor``.
FROM_CONFIG = _FromConfig()


#: :attr:`StaticBudgetDispatcher.peak_pair_share`'s unit: a share of one is a pair demand of
#: exactly the balanced ``N·K / P`` rows.
SHARE_ONE = 1_000_000

#: ``rank_budget(num_tokens, capacity_factor) -> rows``: a rank's static budget before it is
#: split into pair budgets (default: :meth:`MoEConfig.max_num_tokens`).
RankBudget = Callable[[int, float], int]


def static_budget(
    config: MoEConfig,
    num_tokens: int,
    ep_size: int,
    rank_budget: RankBudget | None = None,
    *,
    capacity_factor: float | None = None,
) -> tuple[int, int]:
    """``(max_num_tokens, pair_capacity)`` of one rank with ``num_tokens`` local tokens, at
    ``capacity_factor`` (default: the config's).

    Example: 100 tokens, top-2, factor 1.1, 4 ranks: 220 rows → 220 (a multiple of 4), pair
    capacity 55; with MXFP8, 220 → 224 (lcm(4, 32) = 32), pair capacity 56. ``rank_budget``
    replaces the first step (e.g. Megatron HybridEP's rule, see the Megatron integration).
    Pure arithmetic (:mod:`te_paged.config.budget`): nothing is rebuilt or revalidated.
    """
    factor = config.moe_expert_rank_capacity_factor if capacity_factor is None else capacity_factor
    if factor is None:
        raise ValueError("static_budget needs a capacity factor; the config has none")
    block = config.budget_block
    if rank_budget is None:
        rows = rank_rows(num_tokens, config.moe_router_topk, factor, block)
    else:
        rows = rank_budget(num_tokens, factor)
    return split_rows(rows, ep_size, block)


@assume_constant_result
def _static_sizes(
    topk: int,
    block: int,
    num_tokens: int,
    ep_size: int,
    rank_budget: RankBudget | None,
    capacity_factor: str,
    a2a_capacity_factor: str,
    single: bool,
) -> tuple[int, int]:
    """``(max_num_tokens, C)`` of a static dispatch (see the module docstring): the expert
    buffer, and the wire's pair capacity, at most the buffer's pair share (one rank: the
    buffer's). Exact decimal arithmetic (``Fraction``, which Dynamo does not trace): a constant
    of the graph, evaluated once per traced shape and factors (a wire the runner resizes
    compiles again: its exchanges change shape). Plain values only (Dynamo guards an object
    argument on its identity: one config per layer would be one graph per layer); the factors
    as decimal text (a float that changed between compiles becomes a symbolic input)."""
    cf, a2a = float(capacity_factor), float(a2a_capacity_factor)
    rows = (
        rank_rows(num_tokens, topk, cf, block)
        if rank_budget is None
        else rank_budget(num_tokens, cf)
    )
    rows, expert_pair = split_rows(rows, ep_size, block)
    if single:
        return rows, expert_pair
    wire = split_rows(rank_rows(num_tokens, topk, a2a, block), ep_size, block)[1]
    return rows, min(wire, expert_pair)


def _traffic_counter(dispatcher: StaticBudgetDispatcher):
    """``dispatcher._add_traffic``, holding the dispatcher weakly (an op argument)."""
    ref = weakref.ref(dispatcher)

    def add(routed: torch.Tensor | None, sent: int, row_bytes: int) -> None:
        ref()._add_traffic(routed, sent, row_bytes)

    return add


def _token_noter(dispatcher: StaticBudgetDispatcher):
    """``dispatcher.step_num_tokens.append``, holding the dispatcher weakly; a dispatch that
    runs again inside backward (activation recomputation) is not a new microbatch."""
    ref = weakref.ref(dispatcher)

    def note(_: torch.Tensor | None, num_tokens: int) -> None:
        if not backward_running():
            ref().step_num_tokens.append(num_tokens)

    return note


def _resize_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The first ``rows`` rows of ``t``, zero rows appended when it has fewer."""
    pad = t.new_zeros(max(0, rows - t.shape[0]), *t.shape[1:])
    return t[:rows] if t.shape[0] >= rows else torch.cat([t, pad])


@dataclasses.dataclass
class DispatchHandle:
    """What :meth:`StaticBudgetDispatcher.combine` needs to undo one dispatch.

    ``slot_A``: each assignment's send slot (``S`` = dropped, reads a zero row);
    ``inverse_S``: position in the expert-ordered rows of each received slot;
    ``rows``: ``S = P·C``; ``num_out_rows``: ``T`` (rows handed to the experts);
    ``routed``: the routed assignments (device 0-dim), for the dropless byte count.
    """

    num_tokens: int
    topk: int
    hidden: int
    rows: int
    num_out_rows: int
    slot_A: torch.Tensor
    inverse_S: torch.Tensor
    dropless: bool
    routed: torch.Tensor


class StaticBudgetDispatcher(nn.Module):
    """Token exchange between the ranks of ``ep_group`` (``None``: one process, no collectives).

    ``dispatch(x_NH, probs_NK, indices_NK) -> (permuted_TH, tokens_per_expert_L,
    permuted_probs_T, handle)`` and ``combine(expert_out_TH, handle) -> y_NH``.

    Device counters (int64 0-dim buffers, so ``.to(device)`` moves them; ``reset_flags()``
    zeroes them, nothing here reads them on the host):

    * ``over_budget``: dispatches on this rank that dropped at least one assignment;
    * ``dropped_tokens``: assignments dropped on this rank (as the source);
    * ``peak_tokens``: the most rows this rank's experts were asked to take in one dispatch
      (before any drop), to compare with ``budget_tokens`` (host int, ``P·C`` of the last
      static dispatch);
    * ``peak_pair_tokens``: the most assignments this rank wanted to send to one rank, to
      compare with ``pair_capacity`` (host int ``C``); :meth:`fitting_capacity_factor` turns
      it into the smallest capacity factor that would have fitted;
    * ``peak_pair_share``: the same relative to its dispatch's balanced pair count, in
      millionths (:data:`SHARE_ONE`): ``peak_pair_tokens x P / (N x K)`` of the dispatch that
      asked most, whatever the sizes of the others: what a factor must hold when the
      microbatches' token counts vary (a variable-length workload, or a declared maximum);
    * ``peak_share``: ``peak_tokens`` relative to its dispatch's balanced count ``N·K``, in
      millionths: what a receive budget's factor must hold when the token counts vary;
    * ``invalid_indices``: dispatches with an expert id outside ``[0, num_moe_experts)`` (those
      assignments are dropped; the runner refuses the step);
    * ``dropless_bytes``: the bytes a dropless exchange of the same routing would have moved
      (see the module docstring; :attr:`bytes_sent` is the host int of what was sent).

    ``capacity_factor`` sizes the expert buffer, ``a2a_capacity_factor`` the wire (default: the
    config's ``moe_a2a_capacity_factor``; ``None`` is "auto": the wire starts at
    ``capacity_factor`` and :attr:`wire_auto` tells a runner to size it from its first steps);
    :meth:`set_a2a_capacity_factor` changes the wire between steps (the runner's self-sizing).
    """

    def __init__(
        self,
        config: object,
        ep_group: dist.ProcessGroup | None = None,
        *,
        capacity_factor: float | _FromConfig | None = FROM_CONFIG,
        device: torch.device | str | None = None,
        rank_budget: RankBudget | None = None,
        a2a_capacity_factor: float | _FromConfig | None = FROM_CONFIG,
    ) -> None:
        super().__init__()
        cfg = as_moe_config(config)
        self.rank_budget = rank_budget
        self.config, self.group = cfg, ep_group
        from_config = capacity_factor is FROM_CONFIG
        if from_config:
            capacity_factor = cfg.moe_expert_rank_capacity_factor
        if capacity_factor is not None:
            capacity_factor = require_real("capacity_factor", capacity_factor, strict=True)
        self._capacity_factor: float | None = capacity_factor
        if a2a_capacity_factor is FROM_CONFIG:
            a2a_capacity_factor = cfg.moe_a2a_capacity_factor
        self._a2a: float | None = None
        # The factors as their decimal text, what a traced dispatch reads: Dynamo makes a
        # float that changed between compiles a symbolic input, a string it keeps constant.
        self._factor_text: tuple[str, str] | None = None
        auto = a2a_capacity_factor is None
        if capacity_factor is not None:
            self.set_a2a_capacity_factor(capacity_factor if auto else a2a_capacity_factor)
        #: True while the wire is "auto" (no ``a2a_capacity_factor`` given) and no runner has
        #: sized it yet: it sits at ``capacity_factor`` until a runner sets it from the first
        #: step's demand (:meth:`set_a2a_capacity_factor` ends it).
        self.wire_auto = auto and capacity_factor is not None
        #: Bytes this rank handed the all-to-all since :meth:`reset_traffic` (host int).
        self.bytes_sent = 0
        self._counting = HostCall(_traffic_counter(self))
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        experts, cfg_ep = cfg.num_moe_experts, cfg.expert_model_parallel_size
        if experts % self.ep_size:
            raise ValueError(
                f"num_moe_experts={experts} is not divisible by the expert-parallel group size "
                f"{self.ep_size}; use a group whose size divides the number of experts"
            )
        if cfg_ep not in (1, self.ep_size):
            raise ValueError(
                f"config.expert_model_parallel_size={cfg_ep} but ep_group has {self.ep_size} "
                f"ranks; set expert_model_parallel_size={self.ep_size} (or leave it 1)"
            )
        self.num_local_experts = experts // self.ep_size
        self._dropless = False
        self._dropless_depth = 0  # open dropless_block()s
        self.budget_tokens = 0
        self.pair_capacity = 0
        #: The tokens per rank the last static dispatch was sized for: its local count, or
        #: :attr:`max_tokens_per_rank` where that is larger (what the budgets are relative to).
        self.last_num_tokens = 0
        #: The declared largest microbatch (``moe_max_tokens_per_rank``): over an
        #: expert-parallel group the static sizes are those of a microbatch that large whatever
        #: the local count, so every rank sends blocks of one size (None: sized from each
        #: dispatch's own count, which must then be the same on every rank of the group). One
        #: rank exchanges nothing and sizes from its own count.
        self.max_tokens_per_rank: int | None = getattr(cfg, "moe_max_tokens_per_rank", None)
        #: The local token count of each forward dispatch since :meth:`reset_traffic` (host
        #: ints, no read; a recomputation inside backward is not counted): the first layer's
        #: are the step's microbatches, which the runner records.
        self.step_num_tokens: list[int] = []
        self._noting = HostCall(_token_noter(self))
        counters = ("over_budget", "dropped_tokens", "peak_tokens", "peak_pair_tokens",
                    "peak_pair_share", "peak_share",
                    "invalid_indices", "dropless_bytes")  # fmt: skip
        for name in counters:
            zero = torch.zeros((), dtype=torch.int64, device=device)
            self.register_buffer(name, zero, persistent=False)

    # -------------------------------------------------------------------------------- settings

    @property
    def capacity_factor(self) -> float | None:
        """The static budget's factor; ``None``: always dropless."""
        return self._capacity_factor

    @property
    def a2a_capacity_factor(self) -> float | None:
        """The wire budget's factor (``<= capacity_factor``); ``None`` without a static budget."""
        return self._a2a

    def set_a2a_capacity_factor(self, factor: float) -> None:
        """Set the wire budget's factor, ``0 < factor <= capacity_factor`` (host only: takes
        effect at the next dispatch; every rank of the group must set the same)."""
        if self._capacity_factor is None:
            raise ValueError(
                "a dispatcher without a capacity factor is dropless: it has no wire budget"
            )
        factor = require_real("a2a_capacity_factor", factor, strict=True)
        if factor > self._capacity_factor:
            raise ValueError(
                f"a2a_capacity_factor={factor} is larger than the expert buffer's capacity_factor="
                f"{self._capacity_factor}: the received rows must fit the expert buffer"
            )
        self._a2a = factor
        self._factor_text = (repr(self._capacity_factor), repr(factor))
        self.wire_auto = False

    @property
    def dropless(self) -> bool:
        """True when the exchange is sized from the routing (also without a capacity factor)."""
        return self._dropless or self._dropless_depth > 0 or self.capacity_factor is None

    def set_dropless(self, dropless: bool) -> None:
        """Switch to the dropless reference and back (the caller's own setting). Without a
        capacity factor the dispatcher stays dropless whatever this says."""
        self._dropless = bool(dropless)

    @contextlib.contextmanager
    def dropless_block(self) -> Iterator[None]:
        """Dropless inside this block (the runner's rerun), whatever :meth:`set_dropless` said;
        blocks are counted, so they nest, and the caller's own setting comes back after."""
        self._dropless_depth += 1
        try:
            yield
        finally:
            self._dropless_depth -= 1

    @contextlib.contextmanager
    def outside_step(self) -> Iterator[None]:
        """A forward no runner checks (inference between steps, autograd off): dropless, so
        exact whatever the routing; the step's counters, bytes and microbatch sizes after it
        as before (device copies back, no read)."""
        saved = [(t, t.clone()) for t in self.buffers(recurse=False)]
        host = self.bytes_sent, list(self.step_num_tokens)
        with self.dropless_block():
            yield
        for t, before in saved:
            t.copy_(before)
        self.bytes_sent, self.step_num_tokens[:] = host

    def reset_flags(self) -> None:
        """Zero the device counters of the flags in place (allocation-free, sync-free); the
        byte counts are :meth:`reset_traffic`'s."""
        for t in (self.over_budget, self.dropped_tokens, self.peak_tokens, self.peak_pair_tokens,
                  self.peak_pair_share, self.peak_share,
                  self.invalid_indices):  # fmt: skip
            t.zero_()

    def reset_traffic(self, *, sent: bool = True) -> None:
        """Zero :attr:`dropless_bytes` (in place, sync-free) and, with ``sent``,
        :attr:`bytes_sent`. The runner zeroes both at each step and the reference alone
        before a rerun: after a step it is the kept attempt's."""
        if sent:
            self.bytes_sent = 0
        self.dropless_bytes.zero_()
        self.step_num_tokens.clear()

    def _note_share(
        self, rows: torch.Tensor, num_tokens: int, counter: torch.Tensor | None = None, ranks=1
    ) -> None:
        """Raise ``counter`` (default :attr:`peak_share`) to ``rows × ranks`` over the
        dispatch's balanced ``num_tokens · K``, in :data:`SHARE_ONE` units (device ops, no
        read): the receive share, or with ``ranks`` P the pair share."""
        counter = self.peak_share if counter is None else counter
        balanced = max(1, num_tokens * self.config.moe_router_topk)
        share = torch.div(rows.to(torch.int64) * (ranks * SHARE_ONE) + (balanced - 1), balanced,
                          rounding_mode="floor")  # fmt: skip
        torch.maximum(counter, share.to(counter.device), out=counter)

    def note_tokens(self, num_tokens: int) -> None:
        """A forward dispatch of ``num_tokens`` local tokens, for :attr:`step_num_tokens`
        (under torch.compile an op of the graph, run when the graph runs)."""
        host_call(self._noting, None, num_tokens)

    def _count(self, t: torch.Tensor, routed: torch.Tensor | None) -> None:
        """One exchange of ``t``: its bytes sent, and ``routed`` rows of it for the dropless
        reference (``None``: metadata, which a dropless exchange has no rows of). Under
        torch.compile both counts are one op of the graph (a host int Dynamo changed would be
        a guard, and the device counter a graph value written back at the graph's end)."""
        row_bytes = 0 if routed is None else math.prod(t.shape[1:]) * t.element_size()
        host_call(self._counting, routed, t.numel() * t.element_size(), row_bytes)

    def _add_traffic(self, routed: torch.Tensor | None, sent: int, row_bytes: int) -> None:
        """``_count``'s update: ``sent`` bytes, and ``routed`` rows of ``row_bytes`` each."""
        self.bytes_sent += sent
        if routed is not None:
            self.dropless_bytes.add_(routed * row_bytes)

    def wire_capacity(self, num_tokens: int) -> int:
        """``C``: the rows one rank sends another in a static dispatch of ``num_tokens`` local
        tokens, at :attr:`a2a_capacity_factor`, at most the expert buffer's pair share. One
        rank has no wire: its budget is the expert buffer."""
        if self._a2a is None:
            raise ValueError("a dispatcher without a capacity factor has no wire budget")
        return self._sizes(num_tokens)[1]

    def _sizes(self, num_tokens: int) -> tuple[int, int]:
        """``(max_num_tokens, C)`` of a static dispatch of ``num_tokens`` local tokens."""
        cfg = self.config
        return _static_sizes(
            cfg.moe_router_topk, cfg.budget_block, num_tokens, self.ep_size, self.rank_budget,
            *self._factor_text, self.group is None or self.ep_size == 1,
        )  # fmt: skip

    def fitting_capacity_factor(
        self, num_tokens: int, peak_pair_tokens: int, *, expert_buffer: bool = False
    ) -> float:
        """Smallest factor, in steps of 0.01, whose pair capacity for ``num_tokens`` local tokens
        holds ``peak_pair_tokens`` (a host int, e.g. the group-wide maximum of
        :attr:`peak_pair_tokens` read once by the runner): the wire's
        (``a2a_capacity_factor``), or with ``expert_buffer`` the expert buffer's
        (``capacity_factor``, whose rounding rule ``rank_budget`` may replace)."""
        topk = self.config.moe_router_topk
        balanced = max(1, num_tokens * topk)
        rule = self.rank_budget if expert_buffer else None
        factor = max(0.01, math.ceil(100 * peak_pair_tokens * self.ep_size / balanced) / 100)
        while True:  # the estimate ignores rounding; step up until the real budget fits
            pair = static_budget(
                self.config, num_tokens, self.ep_size, rule, capacity_factor=factor
            )[1]
            if pair >= peak_pair_tokens:
                return factor
            factor = round(factor + 0.01, 2)

    # -------------------------------------------------------------------------------- dispatch

    def _check_inputs(self, x_NH: torch.Tensor, probs_NK: torch.Tensor, idx_NK: torch.Tensor):
        cfg = self.config
        if x_NH.dim() != 2 or x_NH.shape[1] != cfg.hidden_size or x_NH.shape[0] == 0:
            raise ValueError(f"x must be [tokens >= 1, {cfg.hidden_size}], got {tuple(x_NH.shape)}")
        want = (x_NH.shape[0], cfg.moe_router_topk)
        for name, t in (("probs", probs_NK), ("indices", idx_NK)):
            if tuple(t.shape) != want:
                raise ValueError(
                    f"{name} must be [tokens, moe_router_topk] = {list(want)}, got "
                    f"{list(t.shape)}: pass the router's output for the same tokens"
                )
        if idx_NK.dtype.is_floating_point or idx_NK.dtype == torch.bool:
            raise TypeError(f"indices must be an integer tensor, got {idx_NK.dtype}")

    def _exchange(self, t: torch.Tensor, routed: torch.Tensor | None) -> torch.Tensor:
        """``t`` over the all-to-all, counted; differentiable unless it is metadata
        (``routed=None``)."""
        if self.group is None or self.ep_size == 1:
            return t
        if routed is None:
            self._count(t, None)
            return all_to_all(t, self.group)
        return AllToAll.apply(t, self.group, self, routed)

    def _dropless_capacity(self, demand_P: torch.Tensor) -> int:
        """Largest pair count over the group: the one host read of the dropless mode."""
        peak = demand_P.max()
        if self.group is not None and self.ep_size > 1:
            peak = peak.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        return int(peak)

    def dispatch(
        self,
        x_NH: torch.Tensor,
        probs_NK: torch.Tensor,
        indices_NK: torch.Tensor,
        routed_NK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
        """Send every (token, k) assignment to its expert's rank; group rows by local expert.

        ``indices_NK`` are global expert ids in ``[0, num_moe_experts)`` (not checked on the
        host: that would be a sync). Returns expert-grouped, prefix-packed rows ``[T, H]``
        (static mode: ``T = max_num_tokens``, padding rows zero with zero probability),
        ``tokens_per_expert`` int64 ``[L]`` on the device, the probabilities ``[T]`` and the
        handle for :meth:`combine`.

        ``routed_NK`` (bool, default all True) marks the assignments that exist: a token routed
        to fewer than ``moe_router_topk`` experts (Megatron's routing map allows it) has the
        rest False. Those are not sent, use no budget, are neither dropped nor invalid, and
        contribute exact zeros to :meth:`combine` (not ``0 × expert output``, which is NaN where
        the output is).
        """
        self._check_inputs(x_NH, probs_NK, indices_NK)
        if routed_NK is not None and (
            routed_NK.dtype != torch.bool or routed_NK.shape != indices_NK.shape
        ):
            raise ValueError(
                f"routed must be a bool tensor shaped like indices {list(indices_NK.shape)}, "
                f"got {routed_NK.dtype} {list(routed_NK.shape)}"
            )
        n, k = indices_NK.shape
        hidden, p, local = x_NH.shape[1], self.ep_size, self.num_local_experts
        a, dev = n * k, x_NH.device
        idx_A = indices_NK.reshape(a).to(torch.int64)
        # An expert id out of range is an error the host cannot see without a sync: count it
        # (the runner refuses the step) and drop the assignment, so nothing reads out of bounds.
        bad_A = (idx_A < 0) | (idx_A >= self.config.num_moe_experts)
        skip_A = None if routed_NK is None else ~routed_NK.reshape(a)
        if skip_A is not None:  # no such assignment: neither invalid nor sent
            bad_A = bad_A & ~skip_A
        self.invalid_indices.add_(bad_A.any().to(torch.int64))
        unsent_A = bad_A if skip_A is None else bad_A | skip_A
        idx_A = idx_A.masked_fill(unsent_A, 0)
        dest_A = torch.div(idx_A, local, rounding_mode="floor")
        local_A = idx_A - dest_A * local
        # Position of each assignment among this rank's assignments to the same destination,
        # in (n, k) order. e.g. P=2, dest = [1, 0, 1, 1] → position [0, 0, 1, 2].
        hit_AP = (dest_A.unsqueeze(1) == torch.arange(p, device=dev)) & ~unsent_A.unsqueeze(1)
        hit_AP = hit_AP.to(torch.int64)
        cum_AP = hit_AP.cumsum(0)
        pos_A = cum_AP.gather(1, dest_A.unsqueeze(1)).squeeze(1) - 1
        demand_P = cum_AP[-1]

        dropless = self.dropless
        # The tokens the static sizes are for: a group's ranks exchange blocks of one size, so
        # with a declared maximum every rank sizes for it; one rank follows its own count.
        exchanges = self.group is not None and self.ep_size > 1
        sized = max(n, self.max_tokens_per_rank or 0) if exchanges else n
        if dropless:
            cap = self._dropless_capacity(demand_P)
        else:
            self.budget_tokens, cap = self._sizes(sized)
            self.pair_capacity = cap
        self.last_num_tokens = sized
        self.note_tokens(n)
        rows = p * cap
        routed = a - unsent_A.sum()  # what a dropless, variable-split exchange would send
        keep_A = (pos_A < cap) & ~unsent_A
        slot_A = torch.where(keep_A, dest_A * cap + pos_A, rows)
        if not dropless:
            dropped = a - keep_A.sum() - unsent_A.sum()  # invalid ones are counted apart
            self.dropped_tokens.add_(dropped)
            self.over_budget.add_((dropped > 0).to(torch.int64))
        torch.maximum(self.peak_pair_tokens, demand_P.max(), out=self.peak_pair_tokens)
        self._note_share(demand_P.max(), n, self.peak_pair_share, ranks=p)

        # Inverse map: the assignment in each send slot, `a` (→ a zero row) for empty slots.
        # Only the dummy slot `rows` receives duplicate writes, and it is cut off.
        src_S = torch.full((rows + 1,), a, dtype=torch.int64, device=dev)
        src_S = src_S.scatter_(0, slot_A, torch.arange(a, device=dev))[:rows]
        # [A+1, H] with a zero last row; expanding (not indexing by token) keeps the backward
        # a sum over the K slots of each token instead of an atomic scatter-add.
        x_AH = x_NH.new_zeros(a + 1, hidden)
        x_AH[:a].view(n, k, hidden).copy_(x_NH.unsqueeze(1).expand(n, k, hidden))
        p_A = torch.cat([probs_NK.reshape(a), probs_NK.new_zeros(1)])
        e_A = torch.cat([local_A, local_A.new_full((1,), local)])  # sentinel: after every expert
        send_SH = x_AH.index_select(0, src_S)
        send_S = p_A.index_select(0, src_S)
        # The pair's demand rides along as an extra column: the receiver learns its peak load.
        meta_PC = torch.cat([e_A.index_select(0, src_S).view(p, cap), demand_P.view(p, 1)], 1)

        recv_SH = self._exchange(send_SH, routed)
        recv_S = self._exchange(send_S, routed)
        meta_PC = self._exchange(meta_PC, None)
        expert_S = meta_PC[:, :cap].reshape(rows)
        received = meta_PC[:, cap].sum()
        torch.maximum(self.peak_tokens, received, out=self.peak_tokens)
        self._note_share(received, n)

        # Stable: equal experts keep the receive order, i.e. (source rank, source (n, k)).
        order_S = torch.sort(expert_S, stable=True).indices
        inverse_S = torch.empty_like(order_S).scatter_(0, order_S, torch.arange(rows, device=dev))
        counts = torch.zeros(local + 1, dtype=torch.int64, device=dev)
        tokens_per_expert_L = counts.scatter_add_(0, expert_S, torch.ones_like(expert_S))[:local]
        permuted_TH = recv_SH.index_select(0, order_S)
        permuted_T = recv_S.index_select(0, order_S)
        out_rows = self.budget_tokens  # static: the expert buffer, the wire's rows padded to it
        if dropless:
            out_rows = int(tokens_per_expert_L.sum())  # host read: dropless mode only
            out_rows = round_up(out_rows, self.config.budget_block)  # MXFP8: whole scale blocks
        if out_rows != rows:
            permuted_TH = _resize_rows(permuted_TH, out_rows)
            permuted_T = _resize_rows(permuted_T, out_rows)
        handle = DispatchHandle(n, k, hidden, rows, out_rows, slot_A, inverse_S, dropless, routed)
        return permuted_TH, tokens_per_expert_L, permuted_T, handle

    # --------------------------------------------------------------------------------- combine

    def combine(self, expert_out_TH: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """``y_NH[n] = Σ_k out(n, k)``: the inverse of :meth:`dispatch`, unweighted (the experts
        applied the probabilities). Dropped assignments contribute 0."""
        h = handle
        if tuple(expert_out_TH.shape) != (h.num_out_rows, h.hidden):
            raise ValueError(
                f"expert output must be [{h.num_out_rows}, {h.hidden}] like the dispatched "
                f"rows, got {tuple(expert_out_TH.shape)}"
            )
        # Static: the expert buffer's padding past the wire's rows is cut. Dropless: the stripped
        # padding comes back as zeros (or MXFP8 padding is cut).
        out_SH = _resize_rows(expert_out_TH, h.rows)
        back_SH = self._exchange(out_SH.index_select(0, h.inverse_S), h.routed)
        back_SH = torch.cat([back_SH, back_SH.new_zeros(1, h.hidden)])  # row S: dropped
        y_AH = back_SH.index_select(0, h.slot_A)
        return y_AH.view(h.num_tokens, h.topk, h.hidden).sum(1)

    def extra_repr(self) -> str:
        return (
            f"ep_size={self.ep_size}, ep_rank={self.ep_rank}, local_experts="
            f"{self.num_local_experts}, capacity_factor={self.capacity_factor}, "
            f"a2a_capacity_factor={self.a2a_capacity_factor}, dropless={self.dropless}"
        )
