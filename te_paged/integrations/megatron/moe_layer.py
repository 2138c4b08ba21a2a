"""``PagedStashMoELayer``: Megatron-core's ``MoELayer`` on a static budget: te_paged's dispatcher,
or Megatron's HybridEP or NCCL EP dispatcher where it imports (and NCCL EP can drop).

Importing this module imports Megatron (the class derives from Megatron's ``MoELayer``);
:func:`~te_paged.integrations.megatron.get_te_paged_moe_spec` imports it only when the config
has ``moe_expert_rank_capacity_factor``.

The layer is Megatron's, routing, shared experts, recompute and all; only the token dispatcher
is replaced (Megatron's constructor builds its own first, from ``moe_token_dispatcher_type``,
which is then unused), or, with HybridEP or NCCL EP, wrapped. It takes part in the runner
protocol (:class:`~te_paged.moe.participant.PagedStashParticipant`): it reports its dispatcher;
its experts report their stash manager. While the dispatcher is dropless (the runner's rerun),
the experts' rows are dynamic and the layer keeps them out of the stash
(``manager.disabled()``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

from te_paged.integrations.megatron.common import compute_device, group_size, megatron_moe_config
from te_paged.integrations.megatron.dispatcher import StaticBudgetTokenDispatcher
from te_paged.integrations.megatron.flex import FlexTokenDispatcher, keeps_flex_dispatcher
from te_paged.integrations.megatron.loop import MegatronLoopAdapter
from te_paged.moe import PagedStashParticipant, StaticBudgetDispatcher
from te_paged.stash import PagedStashManager

__all__ = ["PagedStashMoELayer", "check_static_budget_config"]


def check_static_budget_config(config: object, tp_size: int = 1) -> None:
    """Reject Megatron settings the static-budget dispatcher cannot honour, with the fix."""
    problems = []
    for name, bad, fix in (
        ("moe_expert_capacity_factor", None, "set it to None: the static rank budget "
         "(moe_expert_rank_capacity_factor) replaces Megatron's per-expert capacity"),
        ("moe_pad_expert_input_to_capacity", False, "set it to False"),
        ("moe_shared_expert_overlap", False, "set it to False (shared experts still run)"),
        ("moe_latent_size", None, "set it to None"),
    ):  # fmt: skip
        value = getattr(config, name, bad)
        if value != bad:
            problems.append(f"{name}={value!r}: {fix}")
    if tp_size > 1:
        problems.append(
            f"tensor parallelism of {tp_size} ranks: the static-budget dispatcher exchanges tokens "
            "over the expert-parallel group only; use tensor_model_parallel_size=1"
        )
    if problems:
        raise ValueError(
            "te_paged's static-budget dispatcher (selected by moe_expert_rank_capacity_factor): "
            + "; ".join(problems)
        )


class PagedStashMoELayer(MoELayer, PagedStashParticipant):
    """Megatron's ``MoELayer`` whose token dispatcher is :class:`StaticBudgetTokenDispatcher`
    (or, with HybridEP or NCCL EP,
    :class:`~te_paged.integrations.megatron.flex.FlexTokenDispatcher`).

    Megatron's constructor arguments (``config, submodules, layer_number, pg_collection``, and
    whatever else the release's ``TransformerLayer`` passes, e.g. 0.19.2's ``is_mtp_layer`` and
    ``name``, handed on to ``MoELayer`` as they are) plus the spec param ``overrides``
    (te_paged-only config fields, e.g. the capacity factor, see
    :func:`~te_paged.integrations.megatron.megatron_moe_config`).

    A config that selects Megatron's ``"flex"`` dispatcher (a 0.19.2 config written for
    Megatron's own paged stash must) keeps it with the HybridEP backend where ``deep_ep``
    imports, or NCCL EP where Transformer Engine's ``ep`` imports and can drop:
    :class:`~te_paged.integrations.megatron.flex.FlexTokenDispatcher` wraps it, only real rows
    cross the wire. Otherwise (DeepEP, NCCL EP that traps, or no library, e.g. on CPU)
    it never builds it: ``MoELayer``'s constructor sees a copy of the config with
    ``moe_token_dispatcher_type="alltoall"`` (a dispatcher that needs no communication library,
    replaced right after by te_paged's), and the layer keeps the user's config.
    """

    def __init__(
        self,
        config: object,
        submodules: object = None,
        layer_number: int | None = None,
        pg_collection: object = None,
        *,
        overrides: Mapping[str, object] | None = None,
        loop: MegatronLoopAdapter | None = None,
        **megatron_kwargs: object,
    ) -> None:
        build_config = config
        keep_flex = keeps_flex_dispatcher(config)
        if getattr(config, "moe_token_dispatcher_type", None) == "flex" and not keep_flex:
            build_config = copy.copy(config)  # a shallow copy: __post_init__ does not run again
            build_config.moe_token_dispatcher_type = "alltoall"
        super().__init__(build_config, submodules, layer_number, pg_collection, **megatron_kwargs)
        self.config = config
        check_static_budget_config(config, group_size(self.tp_group))
        cfg = megatron_moe_config(config, **dict(overrides or {}))
        #: te_paged's side of Megatron's own PagedStashRunner (Megatron-LM's training loop).
        self.loop = loop if loop is not None else MegatronLoopAdapter()
        self.token_dispatcher: StaticBudgetTokenDispatcher | FlexTokenDispatcher
        if keep_flex:  # Megatron's HybridEP or NCCL EP dispatcher, te_paged's seams around it
            self.token_dispatcher = FlexTokenDispatcher(
                self.token_dispatcher,
                cfg,
                self.ep_group,
                align=get_align_size_for_quantization(config),
                backend=config.moe_flex_dispatcher_backend,
                device=compute_device(),
                loop=self.loop,
            )
        else:
            self.token_dispatcher = StaticBudgetTokenDispatcher(
                cfg,
                self.ep_group,
                align=get_align_size_for_quantization(config),
                device=compute_device(),
                loop=self.loop,
            )
        self.loop.register(self)
        if layer_number is not None:
            self._number_experts(layer_number)

    def forward(self, *args: object, **kwargs: object) -> object:
        # Before the router: the adapter snapshots the layers' state (the routers' buffers,
        # the aux-loss tracker) at the first MoE forward of a step, when Megatron's runner
        # drives it. Host-side bookkeeping only.
        if not self.loop.on_forward(training=self.training, grad=torch.is_grad_enabled()):
            return super().forward(*args, **kwargs)
        # An inference pass no runner checks (between steps): exact whatever the routing,
        # nothing paged, and the step's counters left as they were.
        with self.token_dispatcher.budget.outside_step():
            return super().forward(*args, **kwargs)

    def attach_runner(self, runner: object) -> None:
        """The runner protocol: a te_paged runner drives this layer, not Megatron's."""
        self.loop.note_runner(runner)

    def set_layer_number(self, layer_number: int) -> None:
        """Megatron's hook (``TransformerLayer`` calls it): also numbers te_paged's experts,
        whose stash and pop NVTX ranges then carry it (``te_paged.stash.layer<N>``)."""
        super().set_layer_number(layer_number)
        self._number_experts(layer_number)

    def _number_experts(self, layer_number: int) -> None:
        set_number = getattr(self.experts, "set_layer_number", None)  # te_paged's experts
        if set_number is not None:
            set_number(layer_number)

    def budget_dispatchers(self) -> tuple[StaticBudgetDispatcher, ...]:
        """The runner protocol: this layer's dispatcher (its experts report their manager)."""
        return (self.token_dispatcher.budget,)

    def _managers(self) -> tuple[PagedStashManager, ...]:
        experts = self.experts
        if isinstance(experts, PagedStashParticipant):
            return experts.paged_stash_managers()
        return ()

    def routed_experts_compute(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with contextlib.ExitStack() as stack:
            if self.token_dispatcher.dropless:
                # Dynamic-shaped rows have no static budget to page against.
                for manager in self._managers():
                    stack.enter_context(manager.disabled())
            elif hasattr(self.experts, "balanced_tokens"):  # te_paged's experts: exact N·K
                budget = self.token_dispatcher.budget
                topk = self.token_dispatcher.config.moe_router_topk
                stack.enter_context(self.experts.balanced_tokens(budget.last_num_tokens * topk))
            return super().routed_experts_compute(hidden_states, probs)
