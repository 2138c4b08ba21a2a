"""``TEGroupedMLP``: the expert MLP of an MoE layer, a drop-in for Megatron-core's.

Shape suffixes: ``T`` rows of the static expert buffer (``max_num_tokens``; the real tokens are a
prefix of ``sum(tokens_per_expert)`` rows, grouped by expert), ``H`` hidden, ``F`` FFN width,
``C`` FC1 width (``2F`` gated), ``E`` local experts.

    x_TH ─ [× probs] ─ FC1 (GroupedLinear) ─ h_TC ─ weighted activation(h, probs) ─ a_TF
         ─ FC2 (GroupedLinear) ─ y_TH ─ [+ bias[expert] × probs] ─ out_TH

Two execution paths give bit-identical outputs and gradients:

* **non-op-fuser** (``use_transformer_engine_op_fuser=False``): the modules above, each an
  autograd function; the whole forward runs inside one paged-stash scope. GroupedLinear marks its
  own saved inputs; this module marks only at two places, both driven by
  ``config.moe_paged_stash`` (never by attributes on operands): the optional pre-FC1 probability
  multiply, and the activation's input/probabilities (inside the fused activation, or at the
  recompute boundary with ``recompute_modules=["moe_act"]``), plus the packed-bias operands.
* **op-fuser** (``use_transformer_engine_op_fuser=True``): one autograd function for FC1 →
  activation → FC2 (:mod:`te_paged.moe.fused_mlp`) that saves and marks its own tensors.

Nothing in forward or backward reads ``tokens_per_expert`` on the host.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn

from te_paged.config import Activation, MoEConfig
from te_paged.grouped import GroupedLinear, grouped_mm, weighted_quick_geglu, weighted_swiglu
from te_paged.grouped.grouped_tensor import (
    group_ids_from_offsets,
    offsets_from_splits,
    row_mask_from_offsets,
    splits_are_invalid,
)
from te_paged.grouped.weighted_activation import (
    fused_weighted_squared_relu,
    weighted_activation,
)
from te_paged.kernels.layout import Flag
from te_paged.markers import mark_grouped_tensor
from te_paged.moe.config_adapter import as_moe_config
from te_paged.moe.participant import PagedStashParticipant
from te_paged.moe.recompute import CheckpointWithoutOutput
from te_paged.stash import PagedStashManager

__all__ = ["TEGroupedMLP"]


def activation_function(cfg: MoEConfig, num_rows: torch.Tensor) -> Callable:
    """``act(h_TC, probs_T) -> a_TF`` for ``cfg``, probability-weighted, as Megatron's
    ``TEGroupedMLP`` computes it: with ``bias_activation_fusion`` SwiGLU and QuickGeGLU use the
    fused kernels (computed in fp32, rounded once: the numerics of Megatron's compiled fused
    kernels), ``use_fused_weighted_squared_relu`` Megatron's fused squared ReLU; everything else
    Megatron's unfused op order (rounded per op, bit for bit)."""
    kind = cfg.activation_type
    if cfg.bias_activation_fusion and kind.has_fused_kernel:
        fp8 = cfg.fp8 if cfg.activation_func_fp8_input_store else None
        common = {"fp8_input_store": fp8, "paged_stash": cfg.moe_paged_stash, "num_rows": num_rows}
        if kind is Activation.SWIGLU:
            return functools.partial(weighted_swiglu, **common)
        return functools.partial(
            weighted_quick_geglu,
            limit=cfg.activation_func_clamp_value,
            linear_offset=cfg.glu_linear_offset,
            **common,
        )
    if cfg.use_fused_weighted_squared_relu:  # MoEConfig checked: activation is squared_relu
        return functools.partial(fused_weighted_squared_relu, paged_stash=cfg.moe_paged_stash)
    return functools.partial(
        weighted_activation,
        activation=kind.function,
        gated=kind.is_gated,
        limit=cfg.activation_func_clamp_value,
        linear_offset=cfg.glu_linear_offset,
        paged_stash=cfg.moe_paged_stash,
    )


class TEGroupedMLP(nn.Module, PagedStashParticipant):
    """Grouped expert MLP with paged stashing of its saved activations.

    ``TEGroupedMLP(num_local_experts, config, submodules=None, pg_collection=None, name=None,
    *, manager=None, device=None)`` — the first five are Megatron's expert-module arguments
    (``config`` may be Megatron's ``TransformerConfig``; ``submodules``/``pg_collection`` are
    accepted for compatibility and unused: te_paged's experts are not tensor-parallel).
    ``manager`` is the :class:`PagedStashManager` shared by the model's MoE layers; with
    ``moe_paged_stash`` and no manager the module owns one.

    ``forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)`` returns
    ``(output, None)``: FC2's bias, if any, is applied inside, weighted by the routing
    probability (Megatron's convention), so there is never a bias left for the caller to add.
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
    ) -> None:
        super().__init__()
        cfg = as_moe_config(config)
        if cfg.moe_mlp_glu_interleave_size is not None:
            raise ValueError(
                "moe_mlp_glu_interleave_size is not supported by te_paged's TEGroupedMLP: "
                "de-interleave the FC1 weights and set it to None"
            )
        expt_tp = getattr(pg_collection, "expt_tp", None)
        if expt_tp is not None and expt_tp.size() > 1:
            raise ValueError(
                f"expert tensor parallelism (expt_tp size {expt_tp.size()}) is not supported by "
                "te_paged's TEGroupedMLP: set expert_tensor_parallel_size=1"
            )
        if num_local_experts < 1:
            raise ValueError(f"num_local_experts must be >= 1, got {num_local_experts}")
        self.config, self.name = cfg, name
        self.num_local_experts = num_local_experts
        kw = {
            "params_dtype": cfg.params_dtype,
            "device": device,
            "fp8_recipe": cfg.fp8,
            "use_grouped_tensor": cfg.moe_use_grouped_tensor,
        }
        bias = cfg.add_bias_linear
        self.linear_fc1 = GroupedLinear(
            num_local_experts, cfg.hidden_size, cfg.fc1_output_size, bias=bias, **kw
        )
        self.linear_fc2 = GroupedLinear(
            num_local_experts,
            cfg.moe_ffn_hidden_size,
            cfg.hidden_size,
            bias=bias,
            return_bias=True,
            **kw,
        )
        if cfg.moe_paged_stash and manager is None:
            manager = PagedStashManager.from_config(cfg, device or "cpu")
        self.manager = manager
        if cfg.use_transformer_engine_op_fuser and not cfg.activation_type.has_fused_kernel:
            raise ValueError(
                "use_transformer_engine_op_fuser=True fuses SwiGLU/QuickGeGLU only; got "
                f"activation={cfg.activation!r}: use the non-op-fuser path for it"
            )
        if cfg.use_transformer_engine_op_fuser and not cfg.moe_use_grouped_tensor:
            raise ValueError(
                "use_transformer_engine_op_fuser=True runs the device-initiated grouped GEMMs: "
                "set moe_use_grouped_tensor=True"
            )

    def paged_stash_managers(self) -> tuple[PagedStashManager, ...]:
        """The runner protocol (:class:`~te_paged.moe.participant.PagedStashParticipant`)."""
        return () if self.manager is None else (self.manager,)

    def invalid_count_flags(self) -> tuple[torch.Tensor, ...]:
        """The runner protocol: the linears' counters of invalid ``tokens_per_expert``."""
        return (self.linear_fc1.invalid_splits, self.linear_fc2.invalid_splits)

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook. te_paged computes weight gradients in the
        regular backward pass, so there is nothing left to do here."""

    def _stash_scope(
        self, max_num_tokens: int, num_tokens: torch.Tensor
    ) -> contextlib.AbstractContextManager:
        cfg = self.config
        if not cfg.moe_paged_stash or self.manager is None or not self.manager.enabled:
            return contextlib.nullcontext()
        avg = cfg.avg_num_tokens(max_num_tokens)
        return self.manager.scope(max_num_tokens, num_tokens, avg)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        x_TH = permuted_local_hidden_states
        if x_TH.dim() != 2 or x_TH.shape[1] != self.config.hidden_size:
            raise ValueError(
                f"permuted_local_hidden_states must be [tokens, "
                f"{self.config.hidden_size}], got {tuple(x_TH.shape)}"
            )
        rows = x_TH.shape[0]
        if not isinstance(tokens_per_expert, torch.Tensor):
            raise TypeError(
                "tokens_per_expert must be an integer tensor (on the device, or on "
                "the CPU as Megatron passes it)"
            )
        if tokens_per_expert.numel() != self.num_local_experts:
            raise ValueError(
                f"tokens_per_expert has {tokens_per_expert.numel()} entries for "
                f"{self.num_local_experts} local experts"
            )
        probs_T = permuted_probs.reshape(-1)
        if probs_T.numel() != rows:
            raise ValueError(f"permuted_probs has {probs_T.numel()} entries for {rows} rows")
        # A host tensor (Megatron's dynamic path) is copied to the device without a sync.
        splits_E = tokens_per_expert.to(x_TH.device, torch.int64, non_blocking=True)
        offsets_E = offsets_from_splits(splits_E, rows)  # clamped to the buffer
        # Unclamped: a count over the static budget must reach the stash, which flags it.
        num_tokens = splits_E.sum().reshape(1)
        if self.manager is not None:  # also in the manager's stats() (the linears count too)
            self.manager.flags[Flag.INVALID] += splits_are_invalid(splits_E, rows)
        with self._stash_scope(rows, num_tokens):
            if self.config.use_transformer_engine_op_fuser:
                from te_paged.moe.fused_mlp import fused_grouped_mlp

                out_TH = fused_grouped_mlp(self, x_TH, splits_E, offsets_E, probs_T, num_tokens)
            else:
                out_TH = self._unfused_forward(x_TH, splits_E, offsets_E, probs_T, num_tokens)
        return out_TH, None

    def _unfused_forward(self, x_TH, splits_E, offsets_E, probs_T, num_tokens) -> torch.Tensor:
        cfg = self.config
        paged = cfg.moe_paged_stash
        x_TH, act_probs_T = pre_fc1_probs(cfg, x_TH, probs_T)
        h_TC = self.linear_fc1(x_TH, splits_E)
        act = activation_function(cfg, num_tokens)
        if cfg.recompute_moe_act:
            # Marker call site 2 (recompute form): the checkpoint saves the activation's inputs.
            h_in, p_in = h_TC.view_as(h_TC), act_probs_T.view_as(act_probs_T)
            if paged:
                mark_grouped_tensor(h_in, p_in)
            ckpt = CheckpointWithoutOutput()
            a_TF = ckpt.checkpoint(act, h_in, p_in)
        else:
            a_TF = act(h_TC, act_probs_T)  # marker call site 2, inside the fused activation
        y_TH, b = self.linear_fc2(a_TF, splits_E)
        b_EH = torch.stack(b) if isinstance(b, list) else b  # TE's return_bias form
        if cfg.recompute_moe_act:
            ckpt.discard_output_and_register_recompute(y_TH)
        if b_EH is None:
            return y_TH
        return apply_packed_bias(y_TH, b_EH, offsets_E, act_probs_T, paged)


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
    x_in, p_T1 = x_TH.view_as(x_TH), probs_T.reshape(-1, 1)
    if cfg.moe_paged_stash:
        mark_grouped_tensor(x_in, p_T1)
    return (p_T1 * x_in).to(x_TH.dtype), torch.ones_like(probs_T)


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
    if paged_stash:
        mark_grouped_tensor(b_TH, p_T1)
    out_TH = (y_TH + b_TH * p_T1).to(y_TH.dtype)
    pad_T1 = ~row_mask_from_offsets(offsets_E, rows).unsqueeze(1)
    return out_TH.masked_fill(pad_T1, 0)
