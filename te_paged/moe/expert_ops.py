"""The expert MLP's elementwise pieces, shared by both execution paths of
:class:`~te_paged.moe.experts.TEGroupedMLP` (the modules and the op-fuser function in
:mod:`te_paged.moe.fused_mlp`): the probability-weighted activation chosen from the config, the
optional pre-FC1 probability multiply and the probability-weighted FC2 bias.

Shape suffixes as in :mod:`te_paged.moe.experts`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from te_paged.config import MoEConfig
from te_paged.grouped import grouped_mm
from te_paged.grouped.activations import (
    ActivationSpec,
)
from te_paged.grouped.grouped_tensor import group_ids_from_offsets, row_mask_from_offsets
from te_paged.grouped.weighted_activation import fused_weighted_squared_relu, weighted_activation
from te_paged.kernels.compiled import paged_product

__all__ = ["activation_function", "apply_fused_activation", "apply_packed_bias", "pre_fc1_probs"]


def activation_function(cfg: MoEConfig, num_rows: torch.Tensor) -> Callable:
    """``act(h_TC, probs_T) -> a_TF`` for ``cfg``, probability-weighted, as Megatron's
    ``TEGroupedMLP`` computes it: with ``bias_activation_fusion`` an activation with a fused
    kernel (SwiGLU, QuickGeGLU) uses it (computed in fp32, rounded once: the numerics of
    Megatron's compiled fused kernels), ``use_fused_weighted_squared_relu`` Megatron's fused
    squared ReLU; everything else Megatron's unfused op order (rounded per op, bit for bit).
    The activation comes from the registry (:mod:`te_paged.grouped.activations`)."""
    spec = cfg.activation_type
    limit, offset = cfg.activation_func_clamp_value, cfg.glu_linear_offset
    if cfg.bias_activation_fusion and spec.fused is not None:
        fp8 = cfg.fp8_recipe if cfg.activation_func_fp8_input_store else None
        return functools.partial(
            apply_fused_activation, spec, fp8_input_store=fp8, paged_stash=cfg.moe_paged_stash,
            num_rows=num_rows, limit=limit, linear_offset=offset,
        )  # fmt: skip
    if cfg.use_fused_weighted_squared_relu:  # MoEConfig checked: activation is squared_relu
        return functools.partial(fused_weighted_squared_relu, paged_stash=cfg.moe_paged_stash)
    return functools.partial(
        weighted_activation,
        activation=spec.elementwise,
        gated=spec.gated,
        limit=limit,
        linear_offset=offset,
        paged_stash=cfg.moe_paged_stash,
    )


def apply_fused_activation(spec: ActivationSpec, x, probs, *, fp8_input_store, paged_stash,
                           num_rows, limit, linear_offset) -> torch.Tensor:  # fmt: skip
    """``spec``'s fused kernel on ``x`` ``[R, C]`` and ``probs`` ``[R]`` (arguments the config
    checked: ``fp8_input_store`` a recipe or None, ``limit`` and ``linear_offset`` valid for
    the kernel, which refuses a clamp it does not take). No per-call probe: traceable."""
    return spec.fused.apply(
        x, probs, fp8_input_store, bool(paged_stash), num_rows,
        None if limit is None else float(limit), float(linear_offset),
    )  # fmt: skip


def pre_fc1_probs(
    cfg: MoEConfig, x_TH: torch.Tensor, probs_T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(FC1 input, activation probabilities)``: with ``moe_apply_probs_on_input`` the input
    is scaled by the probabilities and the activation gets ones, else both pass unchanged.

    Megatron's order: ``(probs[:, None] · x).to(x.dtype)`` — the product in the promoted dtype
    (fp32 probabilities with bf16 ``x``: fp32), rounded once.

    Marker call site 1: the multiply saves both of its operands; with ``moe_paged_stash`` they
    are marked (fresh aliases, so the caller's tensors stay unmarked).
    """
    if not cfg.moe_apply_probs_on_input:
        return x_TH, probs_T
    x_in = paged_product(probs_T.reshape(-1, 1), x_TH, dtype=x_TH.dtype, paged=cfg.moe_paged_stash)
    return x_in, torch.ones_like(probs_T)


def apply_packed_bias(
    y_TH: torch.Tensor,
    b_EH: torch.Tensor,
    offsets_E: torch.Tensor,
    probs_T: torch.Tensor,
    paged_stash: bool,
) -> torch.Tensor:
    """``(y + b[expert(row)] · prob(row)).to(y.dtype)`` on real rows, 0 on padding rows.

    Megatron's order (``TEGroupedMLP._apply_bias``): the product and the sum in the promoted
    dtype (fp32 probabilities: fp32), rounded once. On the CPU, where reading the offsets costs
    no synchronisation, it is computed as Megatron does, one expert's rows at a time, so the
    bias gradient is Megatron's per-expert sum bit for bit; on an accelerator with a gather of
    the bias rows (no host read), whose multiply saves its two token-major operands (``[T, H]``
    bias rows and ``[T, 1]`` probabilities) — with ``paged_stash`` they are marked, decided by
    the config so it holds when a recompute wrapper hands in detached operands.
    """
    rows = y_TH.shape[0]
    p_T1 = probs_T.reshape(-1, 1)
    if grouped_mm._host_reads_are_free(y_TH):
        ends = offsets_E.tolist()
        starts = [0, *ends[:-1]]
        parts = [
            y_TH[r0:r1] + b_EH[e] * p_T1[r0:r1] for e, (r0, r1) in enumerate(zip(starts, ends))
        ]
        pad = y_TH.new_zeros(rows - ends[-1], y_TH.shape[1], dtype=parts[0].dtype)
        return torch.cat([*parts, pad]).to(y_TH.dtype)
    group_T = group_ids_from_offsets(offsets_E, rows).clamp_(max=b_EH.shape[0] - 1)
    b_TH = b_EH.index_select(0, group_T)
    out_TH = (y_TH + paged_product(b_TH, p_T1, paged=paged_stash)).to(y_TH.dtype)
    pad_T1 = ~row_mask_from_offsets(offsets_E, rows).unsqueeze(1)
    return out_TH.masked_fill(pad_T1, 0)
