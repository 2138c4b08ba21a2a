"""Paged stash inside torchtitan's MoE: experts, a static-budget token dispatcher, the routed
experts that hold both, and the conversion of a torchtitan model config.

Shape suffixes (torchtitan's): ``T`` local tokens, ``K`` top-k, ``D`` model dim, ``F`` expert
hidden dim, ``E`` experts, ``e`` local experts, ``R`` rows handed to the local experts (the
static budget ``max_num_tokens``; the real rows are a prefix of ``sum(counts)``).

::

    RoutedExperts (torchtitan)            PagedRoutedExperts (this module)
    ──────────────────────────            ─────────────────────────────────────────────────────
    token_dispatcher: AllToAll...         token_dispatcher: StaticBudgetTokenDispatcher
      host split sizes (a D2H sync)         te_paged's StaticBudgetDispatcher: fixed-size
      R = real rows (dynamic)               all_to_all on the EP mesh, R = static budget,
                                            over-budget flag, dropless mode for the rerun
    inner_experts: GroupedExperts          inner_experts: PagedGroupedExperts
      saves x twice and four [R, F]         the same arithmetic; x, and the four [R, F], are
      tensors for backward                  marked and paged (actual rows only) into the
                                            shared PagedStashManager

The experts keep torchtitan's parameter names (``w1_EFD``, ``w2_EDF``, ``w3_EFD``), so its
sharding plans, FSDP, checkpoints and state-dict adapters apply unchanged. The routing scores
are applied in ``combine``, in fp32, as torchtitan's dispatchers do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.config import derive
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    HybridEPTokenDispatcher,
    LocalTokenDispatcher,
)
from torchtitan.protocols.model import ModelConfigConverter

from te_paged.config import MoEConfig
from te_paged.config.checks import require_bool
from te_paged.grouped.grouped_tensor import splits_are_invalid
from te_paged.integrations.torchtitan.hybridep import PagedHybridEPTokenDispatcher
from te_paged.kernels.compiled import StashSite, save_for_backward, saved_tensors
from te_paged.kernels.layout import Flag
from te_paged.markers import mark_grouped_tensor
from te_paged.moe import DispatchHandle, PagedStashParticipant, StaticBudgetDispatcher
from te_paged.stash import PagedStashManager

__all__ = [
    "PagedGroupedExperts",
    "PagedRoutedExperts",
    "PagedStashConverter",
    "StaticBudgetTokenDispatcher",
    "attach_paged_stash",
    "convert_moe",
    "convert_node",
]

#: te_paged's knobs (the names of its MoE config and of Megatron's fields) with their defaults.
#: The converter's config and the trainer's ``te_paged`` section carry them under these names.
STASH_FIELDS = (
    "moe_paged_stash",
    "moe_paged_stash_page_size",
    "moe_paged_stash_buffer_size_factor_cuda",
    "moe_paged_stash_buffer_size_factor_cpu",
    "moe_paged_stash_kernel_backend",
    "moe_paged_stash_skip_immediate_backward",
)


class PagedGroupedExperts(GroupedExperts, PagedStashParticipant):
    """torchtitan's ``GroupedExperts`` whose saved activations are paged.

    Same parameters, same ``forward(x_RD, num_tokens_per_expert_E)`` and the same arithmetic
    as ``GroupedExperts.forward`` (bf16 grouped GEMMs through the ``_grouped_mm`` seam, so a
    low-precision ``_grouped_mm`` of a subclass composes), bit for bit in forward and
    backward; the bf16 copy of the input is made once instead of twice (its two gradients are
    still summed in the input's dtype). Inside the manager's scope the bf16 input and the four
    ``[R, F]`` intermediates autograd saves are marked, so the stash keeps their actual rows
    (``sum(num_tokens_per_expert_E)``, read on the device) in its shared pool.

    :attr:`manager` is set by :func:`attach_paged_stash` (the trainer does it after building
    the model): the layers of a model share one manager. Without one, a forward that records
    for backward with ``moe_paged_stash`` on raises.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        moe_paged_stash: bool = True
        moe_paged_stash_page_size: int = 64
        moe_paged_stash_buffer_size_factor_cuda: float = 1.10
        moe_paged_stash_buffer_size_factor_cpu: float = 0.0
        moe_paged_stash_kernel_backend: str = "auto"
        moe_paged_stash_skip_immediate_backward: bool = True

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.stash_options = {name: getattr(config, name) for name in STASH_FIELDS}
        self.manager: PagedStashManager | None = None
        self.layer_number: int | None = None
        self._stash_site = StashSite(self)  # names this layer in a compiled graph's scopes
        #: Balanced-case rows of the next forward (``T·K``), set by :class:`PagedRoutedExperts`;
        #: sizes the pools. ``None``: the static rows.
        self.balanced_rows: int | None = None

    def paged_stash_managers(self) -> tuple[PagedStashManager, ...]:
        return () if self.manager is None else (self.manager,)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ws = (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        return tuple(w.to_local() if isinstance(w, DTensor) else w for w in ws)  # type: ignore[return-value]

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        paged = self.stash_options["moe_paged_stash"] and torch.is_grad_enabled()
        manager = self.manager
        if paged and manager is None:
            raise RuntimeError(
                "PagedGroupedExperts has no stash manager: call "
                "te_paged.integrations.torchtitan.attach_paged_stash(model) after building the "
                "model (PagedStashTrainer does), or set moe_paged_stash=False"
            )
        if not paged or not manager.enabled:
            return self._experts(x_RD, num_tokens_per_expert_E, mark=False)
        rows = x_RD.shape[0]
        counts_e = num_tokens_per_expert_E
        manager.add_flag(Flag.INVALID, splits_are_invalid(counts_e, rows))
        num_tokens = counts_e.sum().reshape(1)  # on the device: no host read
        balanced = rows if self.balanced_rows is None else min(rows, self.balanced_rows)
        with manager.scope(rows, num_tokens, balanced, layer=self._stash_site):
            return self._experts(x_RD, counts_e, mark=True)

    def _experts(self, x_RD: torch.Tensor, counts_e: torch.Tensor, *, mark: bool) -> torch.Tensor:
        """``GroupedExperts.forward``'s arithmetic; ``mark``: mark what autograd saves."""
        w1_EFD, w2_EDF, w3_EFD = self._weights()
        offsets_E = torch.cumsum(counts_e, dim=0, dtype=torch.int32)
        if torch.compiler.is_compiling():  # stash ON and OFF alike: one arithmetic compiled
            w1, w3, w2 = (w.bfloat16().transpose(-2, -1) for w in (w1_EFD, w3_EFD, w2_EDF))
            out = _CompiledExperts.apply(x_RD, offsets_E, w1, w3, w2, self._grouped_mm, mark)
            return out.type_as(x_RD)
        # A mark must be set before the op that saves the tensor runs (its pack hook reads it).
        # GroupedExperts casts x to bf16 once per GEMM: two copies, two gradients summed in x's
        # dtype. _TwoCasts gives the same two gradients from one copy (and a view of it), which
        # the stash pages once.
        x1_bf, x3_bf = _TwoCasts.apply(x_RD) if x_RD.dtype != torch.bfloat16 else (x_RD, x_RD)
        if mark:
            mark_grouped_tensor(x1_bf, x3_bf)
        g1_RF = self._grouped_mm(A=x1_bf, B_t=w1_EFD.bfloat16().transpose(-2, -1), offs=offsets_E)
        if mark:
            mark_grouped_tensor(g1_RF)  # saved by silu
        s_RF = F.silu(g1_RF)
        g3_RF = self._grouped_mm(A=x3_bf, B_t=w3_EFD.bfloat16().transpose(-2, -1), offs=offsets_E)
        if mark:
            mark_grouped_tensor(s_RF, g3_RF)  # saved by the product
        h_RF = s_RF * g3_RF
        if mark:
            mark_grouped_tensor(h_RF)  # saved by the last grouped GEMM
        out = self._grouped_mm(A=h_RF, B_t=w2_EDF.bfloat16().transpose(-2, -1), offs=offsets_E)
        return out.type_as(x_RD)


class _CompiledExperts(torch.autograd.Function):
    """:meth:`PagedGroupedExperts._experts` under torch.compile, where the compiler, not the
    marked objects, decides what plain ops save: one function that saves the bf16 input (once)
    and the two first GEMMs' outputs ``g1``, ``g3`` (paged when ``mark``) and the three bf16
    weights, recomputes ``s = silu(g1)`` and ``h = s · g3`` in backward, and differentiates each
    op there with ``torch.func.vjp``: autograd's formulas (the vjp's primal recomputation is
    dead code the compiler drops). ``x`` in another dtype gets two gradients summed in its
    dtype, as two casts would.

    Why not save ``s`` and ``h`` as eager autograd does (five tensors a layer): Inductor's
    partitioner recomputes such pointwise values in backward when they are ordinary saved
    tensors (stash OFF), fused and unrounded, but not when they pass through the stash's ops
    (ON): ON and OFF would differ in the last bits. Recomputing them in both is what Inductor
    does with torchtitan's own experts, and keeps ON and OFF one arithmetic.

    ``[R, D]`` input, ``[E, D, F]`` (w1, w3) and ``[E, F, D]`` (w2) weights transposed,
    ``[R, D]`` out; saved ``R·D·2 + 2·R·F·2`` bytes in bf16 (what the stash pages, actual rows
    only) and the weights (references)."""

    @staticmethod
    def forward(ctx, x_RD, offsets_E, w1_EDF, w3_EDF, w2_EFD, grouped_mm, mark: bool):
        x_bf = x_RD.bfloat16()
        g1_RF = grouped_mm(A=x_bf, B_t=w1_EDF, offs=offsets_E)
        s_RF = F.silu(g1_RF)
        g3_RF = grouped_mm(A=x_bf, B_t=w3_EDF, offs=offsets_E)
        h_RF = s_RF * g3_RF
        out_RD = grouped_mm(A=h_RF, B_t=w2_EFD, offs=offsets_E)
        acts = [t.view_as(t) for t in (x_bf, g1_RF, g3_RF)]
        if mark:
            mark_grouped_tensor(*acts)
        save_for_backward(ctx, *acts, w1_EDF, w3_EDF, w2_EFD, offsets_E)
        ctx.grouped_mm, ctx.x_dtype = grouped_mm, x_RD.dtype
        return out_RD

    @staticmethod
    def backward(ctx, dout_RD):
        x_bf, g1_RF, g3_RF, w1, w3, w2, offsets_E = saved_tensors(ctx)
        gmm = ctx.grouped_mm
        s_RF = F.silu(g1_RF)
        h_RF = s_RF * g3_RF

        def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return gmm(A=a, B_t=b, offs=offsets_E)

        dh_RF, dw2 = torch.func.vjp(mm, h_RF, w2)[1](dout_RD.bfloat16())
        ds_RF, dg3_RF = torch.func.vjp(torch.mul, s_RF, g3_RF)[1](dh_RF)
        (dg1_RF,) = torch.func.vjp(F.silu, g1_RF)[1](ds_RF)
        dx3, dw3 = torch.func.vjp(mm, x_bf, w3)[1](dg3_RF)
        dx1, dw1 = torch.func.vjp(mm, x_bf, w1)[1](dg1_RF)
        dx = dx1.to(ctx.x_dtype) + dx3.to(ctx.x_dtype)
        return dx, None, dw1, dw3, dw2, None, None


class _TwoCasts(torch.autograd.Function):
    """``(x.bfloat16(), the same bf16 tensor as a view)``; backward casts each gradient to x's
    dtype and adds them, as autograd does for two separate casts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.dtype = x.dtype
        x_bf = x.to(torch.bfloat16)
        return x_bf, x_bf.view_as(x_bf)

    @staticmethod
    def backward(ctx, d1: torch.Tensor, d3: torch.Tensor) -> torch.Tensor:
        return d1.to(ctx.dtype) + d3.to(ctx.dtype)


@dataclasses.dataclass(frozen=True)
class _Metadata:
    """What :meth:`StaticBudgetTokenDispatcher.combine` needs from its dispatch."""

    handle: DispatchHandle
    probs_R: torch.Tensor  # routing scores of the rows handed to the experts (padding: 0)


class StaticBudgetTokenDispatcher(LocalTokenDispatcher):
    """torchtitan's token-dispatcher interface on te_paged's :class:`StaticBudgetDispatcher`.

    ``dispatch(x_TD, topk_scores_TK, topk_expert_ids_TK, counts_E)`` returns
    ``(routed_RD, counts_e, metadata)`` with ``R`` the static budget (``T·K·factor``, rounded to
    split evenly over the EP ranks; real rows a prefix, padding zero), ``counts_e`` on the
    device, and nothing read on the host; ``combine`` weights the expert outputs by the scores
    in fp32 and sums each token's ``K`` rows. One fixed-size ``all_to_all_single`` per tensor on
    the EP mesh's group (:meth:`wire_meshes`, which ``RoutedExperts.parallelize`` calls).

    Assignments over the budget are dropped from this attempt and counted on the device; the
    step runner sees the count and reruns the step dropless (:attr:`budget`'s
    ``dropless_block``). ``moe_expert_rank_capacity_factor=None`` is always dropless (a host
    read per layer, nothing ever dropped).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(LocalTokenDispatcher.Config):
        dim: int
        moe_expert_rank_capacity_factor: float | None = 1.25
        # The wire's factor (docs/design.md, "The wire"); None: auto, sized by the runner.
        moe_a2a_capacity_factor: float | None = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.dim = config.dim
        self.capacity_factor = config.moe_expert_rank_capacity_factor
        self.a2a_capacity_factor = config.moe_a2a_capacity_factor
        self.ep_mesh: Any = None
        self._budget: StaticBudgetDispatcher | None = None
        self.moe_config(1)  # the factor and sizes are checked now, not at the first step

    def moe_config(self, ep_size: int) -> MoEConfig:
        return MoEConfig(
            hidden_size=self.dim,
            num_moe_experts=self.num_experts,
            moe_router_topk=self.top_k,
            moe_expert_rank_capacity_factor=self.capacity_factor,
            moe_a2a_capacity_factor=self.a2a_capacity_factor,
            expert_model_parallel_size=ep_size,
        )

    def wire_meshes(self, *, ep_mesh: Any) -> None:
        """Install the expert-parallel mesh (``None``: no expert parallelism)."""
        if self._budget is not None:
            raise RuntimeError("wire_meshes after the first dispatch: the exchange is built")
        self.ep_mesh = ep_mesh

    def budget(self, device: torch.device | str) -> StaticBudgetDispatcher:
        """The underlying dispatcher (its device counters, ``dropless_block``), built on first
        use on ``device`` with the wired mesh's group."""
        if self._budget is None:
            group = None
            ep_size = 1
            if self.ep_mesh is not None and self.ep_mesh.size() > 1:
                group, ep_size = self.ep_mesh.get_group(), self.ep_mesh.size()
            self._budget = StaticBudgetDispatcher(self.moe_config(ep_size), group, device=device)
        return self._budget

    def dispatch(
        self,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, _Metadata]:
        del num_local_tokens_per_expert_E  # counted from the ids, on the device
        budget = self.budget(x_TD.device)
        routed_RD, counts_e, probs_R, handle = budget.dispatch(
            x_TD, topk_scores_TK, topk_expert_ids_TK
        )
        return routed_RD, counts_e, _Metadata(handle, probs_R)

    def combine(
        self, routed_output_RD: torch.Tensor, metadata: _Metadata, x_TD: torch.Tensor
    ) -> torch.Tensor:
        # Rows past the last group are uninitialised (torch._grouped_mm writes nothing there; NaN
        # possible). The combine reads only each assignment's own row, and in backward their
        # score gradients land on the exchange's dummy slot, which feeds nothing.
        weighted_RD = routed_output_RD.to(torch.float32) * metadata.probs_R.reshape(-1, 1)
        out_TD = self.budget(x_TD.device).combine(
            weighted_RD.to(routed_output_RD.dtype), metadata.handle
        )
        return out_TD.to(x_TD.dtype)


class PagedRoutedExperts(RoutedExperts, PagedStashParticipant):
    """torchtitan's ``RoutedExperts`` over :class:`StaticBudgetTokenDispatcher` and
    :class:`PagedGroupedExperts`: the module a step runner finds (its manager and its
    dispatcher's counters)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        pass

    #: Set when a step runner drives this layer (:meth:`attach_runner`).
    runner: object | None = None

    def attach_runner(self, runner: object) -> None:
        self.runner = runner

    def paged_stash_managers(self) -> tuple[PagedStashManager, ...]:
        experts = self.inner_experts
        return experts.paged_stash_managers() if isinstance(experts, PagedStashParticipant) else ()

    def budget_dispatchers(self) -> tuple[StaticBudgetDispatcher, ...]:
        dispatcher = self.token_dispatcher
        if not isinstance(dispatcher, (StaticBudgetTokenDispatcher, PagedHybridEPTokenDispatcher)):
            return ()
        return (dispatcher.budget(_param_device(self.inner_experts)),)

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        dispatcher = self.token_dispatcher
        budgeted = isinstance(
            dispatcher, (StaticBudgetTokenDispatcher, PagedHybridEPTokenDispatcher)
        ) and (dispatcher.capacity_factor is not None)
        if budgeted and self.runner is None and torch.is_grad_enabled() and self.training:
            raise RuntimeError(
                "te_paged's MoE layer is training without a step runner: its static budget "
                "drops the tokens over it, and only a runner sees that and reruns the step. "
                "Train with te_paged.integrations.torchtitan.PagedStashTrainer (or build a "
                "PagedStashRunner over the model and run each step through it)"
            )
        if isinstance(self.inner_experts, PagedGroupedExperts):
            # Balanced rows per rank: every local token's K assignments (EP ranks hold equal
            # token counts, so each receives T·K when the routing is balanced).
            tokens = x_BLD.shape[0] * x_BLD.shape[1]
            self.inner_experts.balanced_rows = tokens * topk_scores_BLK.shape[-1]
        return super().forward(
            x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E
        )


def _param_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.to_local().device if isinstance(p, DTensor) else p.device
    return torch.device("cpu")


# ------------------------------------------------------------------------------- conversion

_STANDARD_DISPATCHERS = (LocalTokenDispatcher.Config, AllToAllTokenDispatcher.Config)
_DISPATCH_FIELDS = ("moe_expert_rank_capacity_factor", "moe_a2a_capacity_factor")


def _check_options(options: dict[str, Any]) -> None:
    if "moe_paged_stash" in options:  # a string such as "false" would read as True
        require_bool("moe_paged_stash", options["moe_paged_stash"])
    cf = options.get("moe_expert_rank_capacity_factor")
    if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0
                           or not math.isfinite(cf)):  # fmt: skip
        raise ValueError(f"moe_expert_rank_capacity_factor must be a positive number, got {cf!r}")
    a2a = options.get("moe_a2a_capacity_factor")
    if a2a is not None and cf is None and "moe_expert_rank_capacity_factor" in options:
        raise ValueError(
            f"moe_a2a_capacity_factor={a2a!r} sizes the wire of a static expert budget, but "
            "moe_expert_rank_capacity_factor=None is dropless (no budget, no wire to size): "
            "give the expert factor, or leave moe_a2a_capacity_factor None"
        )
    if a2a is not None:  # MoEConfig's own checks: a positive number, at most the expert factor
        MoEConfig(moe_expert_rank_capacity_factor=cf, moe_a2a_capacity_factor=a2a)
    # te_paged's own checks of every stash knob (a manager is not built here).
    fields = {k: options[k] for k in STASH_FIELDS if k in options}
    fields.pop("moe_paged_stash", None)
    if fields:
        MoEConfig(**fields)


def convert_node(node: Any, *, fqn: str = "routed_experts", **options: Any) -> Any:
    """One ``RoutedExperts.Config`` as a :class:`PagedRoutedExperts.Config` (a new node; an
    already converted one gets the options); see :func:`convert_moe`."""
    unknown = set(options) - {*STASH_FIELDS, *_DISPATCH_FIELDS}
    if unknown:
        raise TypeError(f"unknown te_paged option(s) {sorted(unknown)}")
    _check_options(options)
    expert_opts = {k: v for k, v in options.items() if k in STASH_FIELDS}
    dispatch_opts = {k: v for k, v in options.items() if k in _DISPATCH_FIELDS}
    experts, dispatcher = node.inner_experts, node.token_dispatcher
    if type(experts) not in (GroupedExperts.Config, PagedGroupedExperts.Config):
        raise ValueError(
            f"{fqn}.inner_experts is {type(experts).__qualname__}: te_paged pages "
            "torchtitan's GroupedExperts (apply te_paged's converter before, or instead "
            "of, converters that replace the experts)"
        )
    hybridep = type(dispatcher) in (
        HybridEPTokenDispatcher.Config, PagedHybridEPTokenDispatcher.Config
    )  # fmt: skip
    if not hybridep and type(dispatcher) not in (
        *_STANDARD_DISPATCHERS, StaticBudgetTokenDispatcher.Config
    ):  # fmt: skip
        raise ValueError(
            f"{fqn}.token_dispatcher is {type(dispatcher).__qualname__}: te_paged replaces "
            "the standard dispatcher (moe_comm_backend='standard') with its static-budget "
            "one, or keeps HybridEP's (moe_comm_backend='hybridep', non-blocking) and reruns "
            "the steps it drops tokens in; it does not stack on DeepEP or MinimalAsyncEP "
            "(MinimalAsyncEP's worst-case buffer cannot overflow)"
        )
    given = sorted(k for k, v in dispatch_opts.items() if v is not None)
    if hybridep and given:
        raise ValueError(
            f"{fqn}.token_dispatcher is HybridEP, whose budget is its own "
            f"non_blocking_capacity_factor: {', '.join(given)} size te_paged's static-budget "
            "dispatcher and would do nothing here; leave them out (or None), or use "
            "moe_comm_backend='standard'"
        )
    if hybridep and dispatcher.non_blocking_capacity_factor is None:
        raise ValueError(
            f"{fqn}.token_dispatcher is HybridEP in its blocking mode: set "
            "non_blocking_capacity_factor in (0, 1] (the static budget te_paged's experts page "
            "against; te_paged reruns the steps that go over it), or use "
            "moe_comm_backend='standard'"
        )
    new = (
        node
        if isinstance(node, PagedRoutedExperts.Config)
        else derive(node, PagedRoutedExperts.Config)
    )
    new.inner_experts = derive(experts, PagedGroupedExperts.Config, **expert_opts)
    if hybridep:  # its own budget (non_blocking_capacity_factor); te_paged's factors unused
        new.token_dispatcher = derive(dispatcher, PagedHybridEPTokenDispatcher.Config)
    elif isinstance(dispatcher, StaticBudgetTokenDispatcher.Config):
        new.token_dispatcher = derive(dispatcher, type(dispatcher), **dispatch_opts)
    else:
        new.token_dispatcher = derive(
            dispatcher, StaticBudgetTokenDispatcher.Config, dim=experts.dim, **dispatch_opts
        )
    return new


def convert_moe(model_config: Any, **options: Any) -> Any:
    """Turn every ``RoutedExperts.Config`` of a torchtitan model config into a paged-stash one
    (in place; also returned): experts → :class:`PagedGroupedExperts`, dispatcher →
    :class:`StaticBudgetTokenDispatcher` (a non-blocking HybridEP dispatcher is kept, as
    :class:`~te_paged.integrations.torchtitan.hybridep.PagedHybridEPTokenDispatcher`, whose
    dropped tokens rerun the step; its budget is its ``non_blocking_capacity_factor``).
    ``options``: ``moe_expert_rank_capacity_factor``,
    ``moe_a2a_capacity_factor`` (the wire; ``None``: auto) and the stash knobs of
    :data:`STASH_FIELDS`, by te_paged's names. Already converted nodes get the new options.
    Raises ``ValueError`` for experts other than torchtitan's
    ``GroupedExperts`` (e.g. the fused-w13 override, MXFP8) and dispatchers other than the
    ``standard`` backend's and HybridEP's, whose communication the static budget would replace
    silently."""
    found = 0
    for fqn, node, parent, attr in list(model_config.traverse(RoutedExperts.Config)):
        found += 1
        new = convert_node(node, fqn=fqn, **options)
        if parent is None:
            return new
        if isinstance(attr, int):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    if not found:
        raise ValueError("the model config has no RoutedExperts (no MoE layer) to convert")
    return model_config


class PagedStashConverter(ModelConfigConverter):
    """A ``ModelConfigConverter`` for ``model_registry(..., converters=[...])``:
    ``PagedStashConverter.Config(moe_expert_rank_capacity_factor=1.25, moe_paged_stash=True,
    ...)`` applies :func:`convert_moe` with those options."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        moe_expert_rank_capacity_factor: float | None = 1.25
        moe_a2a_capacity_factor: float | None = None
        moe_paged_stash: bool = True
        moe_paged_stash_page_size: int = 64
        moe_paged_stash_buffer_size_factor_cuda: float = 1.10
        moe_paged_stash_buffer_size_factor_cpu: float = 0.0
        moe_paged_stash_kernel_backend: str = "auto"
        moe_paged_stash_skip_immediate_backward: bool = True

        def __post_init__(self) -> None:  # checked where given, not at the conversion
            _check_options(self.stash_options())

        def stash_options(self) -> dict[str, Any]:
            """The options for :func:`convert_moe`: the stash knobs, and the dispatcher's
            factors where they differ from their defaults (a HybridEP model, which has its own
            budget, refuses them)."""
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            options = {name: getattr(self, name) for name in STASH_FIELDS}
            for name in _DISPATCH_FIELDS:
                if getattr(self, name) != defaults[name]:
                    options[name] = getattr(self, name)
            return options

    def __init__(self, config: Config) -> None:
        self.config = config
        _check_options(config.stash_options())

    def convert(self, model_config: Any) -> Any:
        return convert_moe(model_config, **self.config.stash_options())


def attach_paged_stash(
    model_parts: nn.Module | list[nn.Module], device: torch.device | str | None = None
) -> list[PagedStashManager]:
    """Give every :class:`PagedGroupedExperts` of a built model (one module or torchtitan's
    ``model_parts``) its stash manager: one per distinct set of stash options, shared by the
    layers, on ``device`` (default: the experts' parameters'). Numbers the layers for the NVTX
    ranges. Returns the managers. Experts with ``moe_paged_stash=False`` get none."""
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    managers: dict[tuple, PagedStashManager] = {}
    layer = 0
    for part in parts:
        for module in part.modules():
            if not isinstance(module, PagedGroupedExperts):
                continue
            module.layer_number = layer
            layer += 1
            options = module.stash_options
            if not options["moe_paged_stash"]:
                module.manager = None
                continue
            where = torch.device(device) if device is not None else _param_device(module)
            key = (where, *(options[k] for k in STASH_FIELDS))
            if key not in managers:
                managers[key] = PagedStashManager.from_config(MoEConfig(**{
                    k: v for k, v in options.items() if k != "moe_paged_stash"
                }), where)  # fmt: skip
            module.manager = managers[key]
    return list(managers.values())
