"""te_paged inside Megatron-core: specs, a static-budget dispatcher, a step runner, checkpoints.

Importing this package does not import Megatron; the spec builders, the runner's calls and
:class:`PagedStashMoELayer` do (with an install hint when it is missing). Tested against
megatron-core 0.19.2 and 0.16.1 on CPU (see docs/megatron.md); what differs between them is the
table in ``releases``.

=================  =====================================================================
module             what
=================  =====================================================================
``experts``        :class:`MegatronTEGroupedMLP` (te_paged's experts behind Megatron's
                   expert-module protocol) and the spec builders
                   (:func:`get_te_paged_moe_spec`: with ``moe_expert_rank_capacity_factor``
                   the layer is :class:`PagedStashMoELayer`)
``moe_layer``      :class:`PagedStashMoELayer`: Megatron's ``MoELayer`` with te_paged's
                   dispatcher (imports Megatron)
``dispatcher``     :class:`StaticBudgetTokenDispatcher`: Megatron's token-dispatcher
                   interface on te_paged's static budget (HybridEP's budget rule)
``runner``         :class:`MegatronPagedStashRunner`: around ``forward_backward_func``
``loop``           :class:`MegatronLoopAdapter`: te_paged's side of Megatron's own
                   ``PagedStashRunner`` (Megatron-LM's ``pretrain()``)
``specs``          whole-model specs: :func:`with_te_paged_moe` (every MoE layer of a layer,
                   block or hybrid-stack spec), :func:`gpt_layer_spec` (Megatron-LM's
                   ``--spec te_paged.integrations.megatron gpt_layer_spec``)
``linears``        :class:`MegatronGroupedLinear` for Megatron's own ``TEGroupedMLP``;
                   :func:`declare_parallel_layout` (fc1 column, fc2 row: what
                   Megatron-Bridge's AutoBridge reads)
``state_dict``     Megatron expert checkpoints ↔ te_paged modules
``dist_ckpt``      Megatron ``dist_checkpointing`` layout of te_paged's experts and linears
``cpu_shims``      stand-ins for Megatron's CUDA-only calls, for CPU runs only (never
                   installed by importing anything); ``cpu_loop_shims`` Megatron-LM's
                   training loop's, ``cpu_bridge_shims`` Megatron-Bridge's (on
                   ``cpu_import_hooks``)
``log_sources``    where the loop adapter reads the loop's logging settings (Megatron-LM's
                   global arguments, Megatron-Bridge's ``GlobalState``)
``releases``       the supported megatron-core (and megatron-bridge) releases and what
                   differs between them
``common``         the lazy import, config reading, device rules
=================  =====================================================================

What the experts receive depends on the dispatcher:

=====================================  ======================================  =================
dispatcher                             expert input                            stash saves
=====================================  ======================================  =================
te_paged's static budget (the spec     static ``[max_num_tokens, H]``, device  the padding: the
builder's choice whenever              counts, real tokens a prefix (sync-     (cf − bf) × S of
``moe_expert_rank_capacity_factor``    free)                                   DESIGN §1
is set)
``alltoall``/``allgather``, dropless   dynamic ``[sum(tokens), H]``, host      nothing (and
(no rank capacity factor)              ``tokens_per_expert`` (a D2H sync)      paged stash needs
                                                                               the factor)
=====================================  ======================================  =================
"""

# ruff: noqa: E402 — the torch check comes before the imports that need torch

from __future__ import annotations

from te_paged._lazy import require_torch

require_torch(__name__)

from typing import Any

from te_paged.integrations.megatron.common import megatron_moe_config
from te_paged.integrations.megatron.dispatcher import StaticBudgetTokenDispatcher
from te_paged.integrations.megatron.experts import (
    MegatronTEGroupedMLP,
    get_te_paged_experts_spec,
    get_te_paged_moe_spec,
    paged_stash_managers,
)
from te_paged.integrations.megatron.linears import (
    MegatronGroupedLinear,
    declare_parallel_layout,
    get_te_paged_linear_moe_spec,
)
from te_paged.integrations.megatron.loop import MegatronLoopAdapter
from te_paged.integrations.megatron.runner import MegatronPagedStashRunner
from te_paged.integrations.megatron.specs import (
    gpt_layer_spec,
    local_hybrid_stack_spec,
    with_te_paged_moe,
)
from te_paged.integrations.megatron.state_dict import (
    grouped_to_sequential_state_dict,
    load_megatron_expert_state_dict,
    sequential_to_grouped_state_dict,
    to_megatron_grouped_state_dict,
    to_megatron_sequential_state_dict,
)

__all__ = [
    "MegatronGroupedLinear",
    "MegatronLoopAdapter",
    "MegatronPagedStashRunner",
    "MegatronTEGroupedMLP",
    "PagedStashMoELayer",
    "StaticBudgetTokenDispatcher",
    "declare_parallel_layout",
    "get_te_paged_experts_spec",
    "get_te_paged_linear_moe_spec",
    "get_te_paged_moe_spec",
    "gpt_layer_spec",
    "grouped_to_sequential_state_dict",
    "load_megatron_expert_state_dict",
    "local_hybrid_stack_spec",
    "megatron_moe_config",
    "paged_stash_managers",
    "sequential_to_grouped_state_dict",
    "to_megatron_grouped_state_dict",
    "to_megatron_sequential_state_dict",
    "with_te_paged_moe",
]


def __getattr__(name: str) -> Any:
    # PagedStashMoELayer derives from Megatron's MoELayer: import Megatron only when asked.
    if name == "PagedStashMoELayer":
        from te_paged.integrations.megatron.moe_layer import PagedStashMoELayer

        return PagedStashMoELayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
