"""te_paged's experts inside Megatron's ``MoELayer``: :class:`MegatronTEGroupedMLP` and the
spec builders. Importing this module does not import Megatron; the spec builders do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from te_paged.integrations.megatron.common import (
    compute_device,
    import_megatron,
    megatron_moe_config,
    param_device,
)
from te_paged.integrations.megatron.dist_ckpt import (
    drop_extra_state_keys,
    expert_sharded_state_dict,
)
from te_paged.integrations.megatron.linears import declare_parallel_layout, uses_expert_groups
from te_paged.moe import TEGroupedMLP, find_participants
from te_paged.stash import PagedStashManager

if TYPE_CHECKING:
    from te_paged.integrations.megatron.loop import MegatronLoopAdapter

__all__ = [
    "MegatronTEGroupedMLP",
    "get_te_paged_experts_spec",
    "get_te_paged_moe_spec",
    "paged_stash_managers",
]


class MegatronTEGroupedMLP(TEGroupedMLP):
    """te_paged's :class:`~te_paged.TEGroupedMLP` built by Megatron's ``build_module``.

    Same signature as Megatron's expert modules (``num_local_experts, config, submodules,
    pg_collection``), plus the spec params ``manager`` (the shared :class:`PagedStashManager`),
    ``device`` (default: Megatron's rule, the CPU with ``use_cpu_initialization`` else the
    current device) and ``overrides`` (te_paged-only config fields, see
    :func:`megatron_moe_config`). Parameters are ``linear_fc1.weight{i}``/``linear_fc2.weight{i}``,
    the names of Megatron's ``TEGroupedMLP``; ``sharded_state_dict`` writes Megatron's
    distributed checkpoint layout, interchangeable with ``SequentialMLP``'s and across EP sizes.
    ``linear_fc1`` is declared column-parallel, ``linear_fc2`` row-parallel
    (:func:`~te_paged.integrations.megatron.linears.declare_parallel_layout`: what Megatron-
    Bridge's ``AutoBridge`` reads to import and export Hugging Face weights). Expert tensor
    parallelism is rejected.
    """

    def __init__(
        self,
        num_local_experts: int,
        config: object,
        submodules: object = None,
        pg_collection: object = None,
        name: str | None = None,
        *,
        manager: PagedStashManager | None = None,
        device: torch.device | str | None = None,
        overrides: Mapping[str, object] | None = None,
    ) -> None:
        # TEGroupedMLP itself rejects an expert tensor-parallel group.
        cfg = megatron_moe_config(config, **dict(overrides or {}))
        if cfg.moe_paged_stash and manager is None:
            manager = PagedStashManager.from_config(cfg, device or compute_device())
        super().__init__(
            num_local_experts,
            cfg,
            submodules,
            pg_collection,
            name,
            manager=manager,
            device=device if device is not None else param_device(config),
        )
        self.pg_collection = pg_collection
        expert_groups = uses_expert_groups(config)  # DDP reduces over the expert groups
        declare_parallel_layout(self.linear_fc1, "column", expert_groups=expert_groups)
        declare_parallel_layout(self.linear_fc2, "row", expert_groups=expert_groups)
        drop_extra_state_keys(self)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """Megatron's distributed checkpoint of these experts, with the keys and sharding of
        Megatron's ``SequentialMLP``/``TEGroupedMLP``: see
        :mod:`te_paged.integrations.megatron.dist_ckpt`."""
        return expert_sharded_state_dict(
            self, prefix, sharded_offsets, metadata, self.pg_collection
        )


def _check_manager(cfg: object, manager: object) -> None:
    """A ``manager=`` that the config would not use, or that contradicts it, is refused."""
    if manager is None:
        return
    if not isinstance(manager, PagedStashManager):
        raise TypeError(f"manager must be a PagedStashManager, got {type(manager).__name__}")
    if not cfg.moe_paged_stash:
        raise ValueError(
            "manager= was given but moe_paged_stash is off (on the config and in the "
            "overrides): the layers would never use it; turn moe_paged_stash on or drop manager="
        )
    if manager.page_size != cfg.moe_paged_stash_page_size:
        raise ValueError(
            f"manager= pages {manager.page_size} rows but moe_paged_stash_page_size is "
            f"{cfg.moe_paged_stash_page_size}: build the manager with "
            "PagedStashManager.from_config(config), or give both the same page size"
        )


def get_te_paged_experts_spec(
    config: object,
    *,
    manager: PagedStashManager | None = None,
    device: torch.device | str | None = None,
    **overrides: object,
) -> Any:
    """``ModuleSpec`` of :class:`MegatronTEGroupedMLP`, for ``MoESubmodules(experts=...)``.

    With ``moe_paged_stash`` (on ``config`` or in ``overrides``) and no ``manager``, one
    :class:`PagedStashManager` is made here, on ``device`` (default: the current device), and
    shared by every layer built from this spec. ``device`` also places the experts' parameters
    (default: Megatron's rule, see :class:`MegatronTEGroupedMLP`). The config is validated now,
    not at the first build.
    """
    mc = import_megatron()
    cfg = megatron_moe_config(config, **overrides)
    _check_manager(cfg, manager)
    if cfg.moe_paged_stash and manager is None:
        manager = PagedStashManager.from_config(cfg, device or compute_device())
    params = {"manager": manager, "device": device, "overrides": dict(overrides)}
    return mc.ModuleSpec(module=MegatronTEGroupedMLP, params=params)


def get_te_paged_moe_spec(
    config: object,
    *,
    manager: PagedStashManager | None = None,
    device: torch.device | str | None = None,
    shared_experts: object = None,
    loop: MegatronLoopAdapter | None = None,
    **overrides: object,
) -> Any:
    """``ModuleSpec(<MoE layer>, MoESubmodules(experts=<te_paged experts>))``.

    The layer is chosen by the static budget:

    * with ``moe_expert_rank_capacity_factor`` (on ``config`` or in ``overrides``; required by
      ``moe_paged_stash``): :class:`~te_paged.integrations.megatron.moe_layer.PagedStashMoELayer`,
      Megatron's ``MoELayer`` with te_paged's static-budget dispatcher, so the experts receive
      ``[max_num_tokens, hidden]`` buffers with device counts and the stash saves the padding;
    * without: Megatron's own ``MoELayer`` and the dispatcher ``moe_token_dispatcher_type``
      names (dynamic buffers: nothing for a stash to cut).

    Use it where a Megatron layer spec asks for the MoE module (``mlp=...``), or build one
    layer with ``build_module(spec, config=config)``. ``shared_experts`` is passed to
    ``MoESubmodules`` as is. ``loop`` (static budget only) is the
    :class:`~te_paged.integrations.megatron.MegatronLoopAdapter` the layers report to when
    Megatron-LM's own training loop drives them (``pretrain()``: Megatron's
    ``PagedStashRunner``); default, one made here for the layers of this spec. Give one to set
    its options or read its records, and the same one to every model chunk's spec. See
    :func:`get_te_paged_experts_spec` for the other arguments.
    """
    mc = import_megatron()
    experts = get_te_paged_experts_spec(config, manager=manager, device=device, **overrides)
    submodules = mc.MoESubmodules(experts=experts, shared_experts=shared_experts)
    module, params = mc.MoELayer, {}
    if megatron_moe_config(config, **overrides).moe_expert_rank_capacity_factor is not None:
        from te_paged.integrations.megatron.loop import MegatronLoopAdapter
        from te_paged.integrations.megatron.moe_layer import (
            PagedStashMoELayer,
            check_static_budget_config,
        )

        check_static_budget_config(config)  # now, not at the first build
        if loop is None:
            loop = MegatronLoopAdapter()
        elif not isinstance(loop, MegatronLoopAdapter):
            raise TypeError(f"loop must be a MegatronLoopAdapter, got {type(loop).__name__}")
        module, params = PagedStashMoELayer, {"overrides": dict(overrides), "loop": loop}
    elif loop is not None:
        raise ValueError(
            "loop= was given but the config has no moe_expert_rank_capacity_factor: Megatron's "
            "own MoELayer and dispatcher are built, and Megatron's PagedStashRunner is not used"
        )
    return mc.ModuleSpec(
        module=module,
        params=params,
        submodules=submodules,
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


def paged_stash_managers(model: nn.Module | list[nn.Module]) -> list[PagedStashManager]:
    """The distinct paged-stash managers in ``model`` (a module or model chunks), found through
    the runner protocol. :class:`~te_paged.integrations.megatron.MegatronPagedStashRunner`
    resets them at every step boundary."""
    return find_participants(model).managers
