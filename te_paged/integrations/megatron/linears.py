"""te_paged's ``GroupedLinear`` as ``linear_fc1``/``linear_fc2`` of Megatron's own
``TEGroupedMLP`` (no Transformer Engine needed). Importing this module does not import
Megatron; :func:`get_te_paged_linear_moe_spec` does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from te_paged.grouped import GroupedLinear
from te_paged.integrations.megatron.common import group_size, import_megatron, param_device
from te_paged.integrations.megatron.dist_ckpt import (
    drop_extra_state_keys,
    linear_sharded_state_dict,
)

__all__ = ["MegatronGroupedLinear", "get_te_paged_linear_moe_spec"]


def _no_init(weight: torch.Tensor) -> None:
    """``perform_initialization=False``: leave the weights as allocated (a checkpoint loads)."""


class MegatronGroupedLinear(GroupedLinear):
    """te_paged's :class:`~te_paged.GroupedLinear` as ``linear_fc1``/``linear_fc2`` of
    Megatron's own ``TEGroupedMLP``.

    Constructor: Megatron's grouped-linear builder protocol, ``(num_gemms, input_size,
    output_size, *, config, init_method, bias, skip_bias_add, is_expert, tp_comm_buffer_name,
    pg_collection, name=None)``. ``forward(x, tokens_per_expert) -> (out, bias)``: Megatron
    passes the host counts as a list (it calls ``.tolist()`` first); they are copied to ``x``'s
    device (host→device, no sync) for the device-initiated path. With ``skip_bias_add`` the bias
    is returned as ``[E, out]`` (Megatron zips it per expert), else added and ``None`` returned.
    Parameters are ``weight{i}``/``bias{i}``, as in Transformer Engine. FP8 here would need
    TE's autocast, so ``config.fp8`` is rejected: use te_paged's experts for FP8.
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: object,
        init_method: Callable[[torch.Tensor], object] | None,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: object = None,
        name: str | None = None,
    ) -> None:
        if not is_expert:
            raise ValueError("MegatronGroupedLinear serves expert layers only (is_expert=True)")
        etp = group_size(getattr(pg_collection, "expt_tp", None))
        if etp > 1:
            raise ValueError(
                f"the expert tensor-parallel group has {etp} ranks: MegatronGroupedLinear is not "
                "tensor-parallel; set expert_tensor_parallel_size=1"
            )
        for flag in ("fp8", "fp4"):
            if getattr(config, flag, None):
                raise ValueError(
                    f"{flag}={getattr(config, flag)!r}: MegatronGroupedLinear computes in high "
                    "precision; use te_paged's experts (get_te_paged_moe_spec) for FP8 storage"
                )
        if not getattr(config, "perform_initialization", True):
            init_method = _no_init
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            bias=bias,
            return_bias=skip_bias_add and bias,
            params_dtype=getattr(config, "params_dtype", None),
            device=param_device(config),
            init_method=init_method,
            use_grouped_tensor=getattr(config, "moe_use_grouped_tensor", True),
        )
        self.skip_bias_add = skip_bias_add
        self.tp_comm_buffer_name, self.name = tp_comm_buffer_name, name
        self.pg_collection = pg_collection
        drop_extra_state_keys(self, ("",))

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor | list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = torch.tensor(list(tokens_per_expert), dtype=torch.int64)
        splits_E = tokens_per_expert.to(x.device, torch.int64, non_blocking=True)
        out = super().forward(x, splits_E)
        return out if self.return_bias else (out, None)

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: te_paged computes them in backward."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """What Transformer Engine's grouped linear gives Megatron's ``TEGroupedMLP``: one
        sharded weight per local expert under ``{prefix}weight`` with the global expert axis
        prepended (the module adds the swiglu split and its ``experts.`` prefix)."""
        return linear_sharded_state_dict(
            self,
            prefix,
            "",
            prefix,
            tp_axis=1 if self.tp_comm_buffer_name == "fc2" else 0,
            swiglu=False,
            sharded_offsets=sharded_offsets,
            metadata=metadata,
            pg_collection=self.pg_collection,
        )


def get_te_paged_linear_moe_spec(shared_experts: object = None) -> Any:
    """``MoELayer`` spec with Megatron's own ``TEGroupedMLP`` whose ``linear_fc1``/``linear_fc2``
    are :class:`MegatronGroupedLinear` (no Transformer Engine needed)."""
    mc = import_megatron()
    linears = mc.MLPSubmodules(linear_fc1=MegatronGroupedLinear, linear_fc2=MegatronGroupedLinear)
    experts = mc.ModuleSpec(module=mc.McoreTEGroupedMLP, submodules=linears)
    submodules = mc.MoESubmodules(experts=experts, shared_experts=shared_experts)
    return mc.ModuleSpec(
        module=mc.MoELayer, submodules=submodules, metainfo={"fuse_pre_mlp_layernorm": False}
    )
