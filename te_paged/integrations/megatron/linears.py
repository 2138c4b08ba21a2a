"""te_paged's ``GroupedLinear`` as ``linear_fc1``/``linear_fc2`` of Megatron's own
``TEGroupedMLP`` (no Transformer Engine needed), and :func:`declare_parallel_layout`, which
every te_paged expert linear built for Megatron carries. Importing this module does not import
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

__all__ = [
    "PARTITION_DIMS",
    "MegatronGroupedLinear",
    "declare_parallel_layout",
    "get_te_paged_linear_moe_spec",
    "uses_expert_groups",
]

#: The axis of each ``[out, in]`` weight that Megatron splits across tensor-parallel ranks.
PARTITION_DIMS = {"column": 0, "row": 1}


def uses_expert_groups(config: object) -> bool:
    """Whether Megatron reduces expert gradients over its expert-data-parallel group (not the
    data-parallel one): with expert parallelism, or expert tensor parallelism unlike the dense
    layers' (megatron-core 0.19.2, ``extensions/transformer_engine.py:982``)."""
    ep = getattr(config, "expert_model_parallel_size", 1) or 1
    etp = getattr(config, "expert_tensor_parallel_size", None)
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    return ep > 1 or (etp is not None and etp != tp)


def declare_parallel_layout(
    linear: GroupedLinear, parallel_mode: str, *, expert_groups: bool = False
) -> None:
    """Declare on ``linear`` what Megatron's ``TEColumnParallelGroupedLinear`` (``"column"``: an
    expert MLP's fc1) and ``TERowParallelGroupedLinear`` (``"row"``: fc2) declare by their
    class names: Transformer Engine's ``parallel_mode``, and the module attributes
    ``tensor_model_parallel = True`` and ``partition_dim`` (0 column, 1 row) that tools read
    from a linear whose class they do not know: Megatron-Bridge's ``AutoMapping`` (0.6.2,
    ``models/conversion/param_mapping.py:1512``; without them, importing Hugging Face weights
    fails with "Cannot determine parallelism type for module 'GroupedLinear'") and
    megatron-core's FSDP adapter (0.19.2, ``distributed/fsdp/mcore_fsdp_adapter.py:291``).
    Registering the class name with Bridge could not do this: fc1 and fc2 are one class. The
    layout is the axis a split would follow; the linear itself stays whole (expert tensor
    parallelism is refused), as Megatron's own linears are at tensor-parallel size 1.

    Each parameter also gets Megatron's ``allreduce`` (``not expert_groups``: see
    :func:`uses_expert_groups`), which Megatron's DDP and distributed optimizer read to put an
    expert's gradient in the expert buffers, reduced over the ranks holding the same experts
    (``param_and_grad_buffer.py:918``). Without it, with expert parallelism, DDP averaged each
    local expert's gradient with other ranks' different experts'."""
    if parallel_mode not in PARTITION_DIMS:
        raise ValueError(
            f"parallel_mode={parallel_mode!r} is not one of {sorted(PARTITION_DIMS)}: an expert "
            "MLP's fc1 is 'column', its fc2 'row'"
        )
    linear.parallel_mode = parallel_mode
    linear.tensor_model_parallel = True
    linear.partition_dim = PARTITION_DIMS[parallel_mode]
    for param in linear.parameters(recurse=False):
        param.allreduce = not expert_groups


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
    TE's autocast, so ``config.fp8`` is rejected: use te_paged's experts for FP8. Megatron
    names the linear ``tp_comm_buffer_name="fc1"`` or ``"fc2"``: ``"fc2"`` is row-parallel, any
    other column-parallel (:func:`declare_parallel_layout`).
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
        declare_parallel_layout(self, "row" if tp_comm_buffer_name == "fc2" else "column",
                                expert_groups=uses_expert_groups(config))  # fmt: skip
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
            tp_axis=self.partition_dim,
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
