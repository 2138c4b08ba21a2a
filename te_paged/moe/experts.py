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
from collections.abc import Iterator

import torch
from torch import nn

from te_paged.config.budget import balanced_rows
from te_paged.grouped import GroupedLinear
from te_paged.grouped.grouped_tensor import offsets_from_splits, splits_are_invalid
from te_paged.kernels.compiled import StashSite
from te_paged.kernels.layout import Flag
from te_paged.markers import mark_grouped_tensor
from te_paged.moe.config_adapter import as_moe_config
from te_paged.moe.expert_ops import activation_function, apply_packed_bias, pre_fc1_probs
from te_paged.moe.fused_mlp import fused_grouped_mlp
from te_paged.moe.participant import PagedStashParticipant
from te_paged.moe.recompute import CheckpointWithoutOutput
from te_paged.stash import PagedStashManager
from te_paged.torch_compat import assume_constant_result

__all__ = ["TEGroupedMLP"]

#: ``floor(max_num_tokens / factor)`` of the exact decimal factor (a ``Fraction``, which Dynamo
#: does not trace): evaluated once per traced shape, a constant of the graph.
_balanced_rows = assume_constant_result(balanced_rows)


def _manager_device(device: torch.device | str | None) -> torch.device | str | None:
    """Where an owned manager goes: with the parameters (on ``device``, else torch's default
    device), since a manager elsewhere refuses every scope. Under a meta-device init the
    manager keeps its own default (the current accelerator)."""
    if device is not None:
        return device
    default = torch.get_default_device()
    return default if default.type in ("cpu", "cuda") else None


class TEGroupedMLP(nn.Module, PagedStashParticipant):
    """Grouped expert MLP with paged stashing of its saved activations.

    ``TEGroupedMLP(num_local_experts, config, submodules=None, pg_collection=None, name=None,
    *, manager=None, device=None, layer_number=None)`` — the first five are Megatron's
    expert-module arguments (``config`` may be Megatron's ``TransformerConfig``;
    ``submodules``/``pg_collection`` are accepted for compatibility and unused: te_paged's
    experts are not tensor-parallel). ``manager`` is the :class:`PagedStashManager` shared by
    the model's MoE layers; with ``moe_paged_stash`` and no manager the module owns one, on
    ``device`` (default: torch's default device, where the parameters are made).
    ``layer_number`` (or :meth:`set_layer_number`, Megatron's hook) names this layer's NVTX
    ranges (``te_paged.stash.layer<N>``); ``None``: unnumbered.

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
        layer_number: int | None = None,
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
        self.layer_number = layer_number
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
            manager = PagedStashManager.from_config(cfg, _manager_device(device))
        self.manager = manager
        self._stash_site = StashSite(self)  # names this layer in a compiled graph's scopes
        self._balanced_num_tokens: int | None = None  # see balanced_tokens()
        if cfg.use_transformer_engine_op_fuser and not cfg.moe_use_grouped_tensor:
            raise ValueError(
                "use_transformer_engine_op_fuser=True runs the device-initiated grouped GEMMs: "
                "set moe_use_grouped_tensor=True"
            )

    def set_layer_number(self, layer_number: int | None) -> None:
        """Megatron's hook (its ``MoELayer`` has the same): the number NVTX ranges carry."""
        self.layer_number = layer_number

    def paged_stash_managers(self) -> tuple[PagedStashManager, ...]:
        """The runner protocol (:class:`~te_paged.moe.participant.PagedStashParticipant`)."""
        return () if self.manager is None else (self.manager,)

    def invalid_count_flags(self) -> tuple[torch.Tensor, ...]:
        """The runner protocol: the linears' counters of invalid ``tokens_per_expert``."""
        return (self.linear_fc1.invalid_splits, self.linear_fc2.invalid_splits)

    @contextlib.contextmanager
    def balanced_tokens(self, num_tokens: int) -> Iterator[None]:
        """Within this block the stash sizes its pool from ``num_tokens`` balanced rows — the
        exact ``N·K`` the dispatcher knows (te_paged's ``MoELayer`` and the Megatron layer pass
        it) — instead of estimating ``floor(max_num_tokens / capacity_factor)`` from the
        rounded budget (e.g. 203 for 200)."""
        previous, self._balanced_num_tokens = self._balanced_num_tokens, int(num_tokens)
        try:
            yield
        finally:
            self._balanced_num_tokens = previous

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook. te_paged computes weight gradients in the
        regular backward pass, so there is nothing left to do here."""

    def _stash_scope(
        self, max_num_tokens: int, num_tokens: torch.Tensor
    ) -> contextlib.AbstractContextManager:
        cfg = self.config
        if not cfg.moe_paged_stash or self.manager is None or not self.manager.enabled:
            return contextlib.nullcontext()
        avg = self._balanced_num_tokens
        if avg is None and torch.compiler.is_compiling():  # a constant of the traced shapes
            avg = _balanced_rows(max_num_tokens, cfg.moe_expert_rank_capacity_factor)
        elif avg is None:  # not told by the dispatcher: estimated from the rounded budget
            avg = cfg.avg_num_tokens(max_num_tokens)
        # Under torch.compile the layer is named by its site, read when the scope opens: one
        # graph serves every layer (te_paged.kernels.compiled).
        return self.manager.scope(max_num_tokens, num_tokens, avg, layer=self._stash_site)

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
            self.manager.add_flag(Flag.INVALID, splits_are_invalid(splits_E, rows))
        with self._stash_scope(rows, num_tokens):
            if self.config.use_transformer_engine_op_fuser:
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
