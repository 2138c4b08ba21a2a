"""``TopKRouter``: top-k expert selection, routing probabilities and the load-balancing loss.

Shape suffixes: ``N`` tokens, ``H`` hidden, ``E`` experts (all of them, not the local ones),
``K`` top-k.

Score functions (``logits_NE = x_NH · Wᵀ``, computed in fp32; ``b_E`` the optional expert bias,
``s_E`` the optional test-only skew)::

    softmax:  select = topk(logits + s + b)       probs = softmax(logits + s over the K selected)
    sigmoid:  σ = sigmoid(logits + s)
              select = topk(σ + b)                probs = σ[selected] / Σ σ[selected]   (K > 1)

The softmax convention is Megatron's ``moe_router_pre_softmax=False``: the softmax runs over the
K selected logits only, so a token's probabilities always sum to 1. With sigmoid and K = 1 the
probability is the raw σ (normalising one value would make it a constant 1 and cut the router's
gradient), as in Megatron.

The expert bias (DeepSeek-V3's auxiliary-loss-free balancing) is a non-trainable buffer that
changes *which* experts are selected, never the probabilities; :meth:`TopKRouter.update_expert_bias`
nudges it against the observed load. The auxiliary loss is Switch-Transformer style, on this
rank's tokens::

    aux = coeff · E · Σ_e f_e · P_e,   f_e = tokens_e / (N·K),   P_e = mean_n score_ne

(score = full softmax, or σ normalised over all experts); it is ``coeff`` under perfect balance.

Everything here is static-shape and sync-free: no ``.item()``, ``nonzero`` or boolean indexing.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch
import torch.nn.functional as F
from torch import nn

from te_paged.moe.config_adapter import as_moe_config

__all__ = ["RouterOutput", "RoutingSkew", "ScoreFunction", "TopKRouter"]

#: Megatron's guard against a zero denominator when normalising sigmoid scores.
_EPS = 1e-20


class ScoreFunction(str, enum.Enum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclasses.dataclass
class RouterOutput:
    """What :meth:`TopKRouter.forward` returns.

    ``probs`` fp32 ``[N, K]`` (differentiable), ``indices`` int64 ``[N, K]`` global expert ids
    (distinct per token, in descending selection score), ``aux_loss`` a 0-dim fp32 tensor
    (exactly 0 when ``aux_loss_coeff == 0``), ``tokens_per_expert`` int64 ``[E]`` assignments
    per expert in this batch (detached; the input of :meth:`TopKRouter.update_expert_bias`).
    """

    probs: torch.Tensor
    indices: torch.Tensor
    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


@dataclasses.dataclass(frozen=True)
class RoutingSkew:
    """Test/benchmark-only routing skew: ``strength`` is added to the logits of ``experts``.

    A large strength (e.g. 1e3) makes every token pick those experts first, which forces a rank
    over its static budget on purpose. Never use it to train a model.
    """

    experts: tuple[int, ...]
    strength: float


class TopKRouter(nn.Module):
    """Top-k router with a ``[num_moe_experts, hidden_size]`` weight (no bias).

    ``TopKRouter(config, *, device=None, score_function="softmax", expert_bias=False,
    aux_loss_coeff=0.0)``; ``forward(x_NH) -> RouterOutput``. The weight is initialised from
    ``N(0, 0.02²)`` by the default generator or, via :meth:`reset_parameters`, by a seeded one.
    """

    def __init__(
        self,
        config: object,
        *,
        device: torch.device | str | None = None,
        score_function: ScoreFunction | str = ScoreFunction.SOFTMAX,
        expert_bias: bool = False,
        aux_loss_coeff: float = 0.0,
    ) -> None:
        super().__init__()
        cfg = as_moe_config(config)
        try:
            self.score_function = ScoreFunction(score_function)
        except ValueError:
            allowed = ", ".join(repr(s.value) for s in ScoreFunction)
            raise ValueError(
                f"score_function={score_function!r} is not supported; use one of {allowed}"
            ) from None
        coeff_ok = isinstance(aux_loss_coeff, (int, float)) and not isinstance(aux_loss_coeff, bool)
        if not coeff_ok or not math.isfinite(aux_loss_coeff) or aux_loss_coeff < 0:
            raise ValueError(
                f"aux_loss_coeff must be a finite number >= 0, got {aux_loss_coeff!r} "
                "(e.g. 1e-2; 0 disables the loss)"
            )
        if cfg.moe_router_topk > cfg.num_moe_experts:
            raise ValueError(
                f"moe_router_topk={cfg.moe_router_topk} exceeds num_moe_experts="
                f"{cfg.num_moe_experts}; set moe_router_topk <= num_moe_experts"
            )
        self.config = cfg
        self.num_experts, self.topk = cfg.num_moe_experts, cfg.moe_router_topk
        self.aux_loss_coeff = float(aux_loss_coeff)
        self.weight = nn.Parameter(
            torch.empty(cfg.num_moe_experts, cfg.hidden_size, dtype=cfg.params_dtype, device=device)
        )
        # fp32 like Megatron's expert bias: rate-sized updates would vanish in bf16.
        bias = torch.zeros(cfg.num_moe_experts, dtype=torch.float32, device=device)
        self.register_buffer("expert_bias", bias if expert_bias else None)
        self.skew: RoutingSkew | None = None
        self.register_buffer("_skew_E", None, persistent=False)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """``weight ~ N(0, 0.02²)``. A CPU ``generator`` gives the same weights on any device."""
        with torch.no_grad():
            w = torch.empty(self.weight.shape, dtype=torch.float32)
            w.normal_(0.0, 0.02, generator=generator)
            self.weight.copy_(w)
            if self.expert_bias is not None:
                self.expert_bias.zero_()

    # ----------------------------------------------------------------------------- test-only skew

    def set_skew(self, experts: list[int] | tuple[int, ...] | None, strength: float = 0.0) -> None:
        """Test/benchmark only: add ``strength`` to the logits of ``experts`` (``None`` clears).

        Each rank may skew differently (the skew is local state, not a parameter), which is how
        a test forces one rank over its budget.
        """
        if experts is None:
            self.skew, self._skew_E = None, None
            return
        experts = tuple(int(e) for e in experts)
        bad = [e for e in experts if not 0 <= e < self.num_experts]
        if bad or not math.isfinite(strength):
            raise ValueError(
                f"set_skew needs expert ids in [0, {self.num_experts}) and a finite strength; "
                f"got experts={list(experts)}, strength={strength!r}"
            )
        skew_E = torch.zeros(self.num_experts, dtype=torch.float32)
        skew_E[list(experts)] = float(strength)
        self.skew = RoutingSkew(experts, float(strength))
        self._skew_E = skew_E.to(self.weight.device)

    # ---------------------------------------------------------------------------- load balancing

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, rate: float = 1e-3) -> None:
        """DeepSeek-V3 update, in place and sync-free: ``b += rate · sign(mean(t) − t)``.

        ``tokens_per_expert`` int ``[E]``: the load to balance (e.g. the sum of
        :attr:`RouterOutput.tokens_per_expert` over the step, all-reduced over data-parallel
        ranks by the caller). Under-loaded experts get a higher bias, so they are picked more.
        """
        if self.expert_bias is None:
            raise RuntimeError(
                "update_expert_bias() needs the expert bias: build "
                "TopKRouter(..., expert_bias=True)"
            )
        if tokens_per_expert.shape != (self.num_experts,):
            raise ValueError(
                f"tokens_per_expert must have shape [{self.num_experts}], got "
                f"{tuple(tokens_per_expert.shape)}"
            )
        load_E = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        self.expert_bias.add_(torch.sign(load_E.mean() - load_E), alpha=rate)

    # ----------------------------------------------------------------------------------- forward

    def forward(self, x_NH: torch.Tensor) -> RouterOutput:
        if x_NH.dim() != 2 or x_NH.shape[1] != self.weight.shape[1]:
            raise ValueError(
                f"x must be [tokens, {self.weight.shape[1]}], got {tuple(x_NH.shape)}; "
                "flatten leading dimensions first"
            )
        num_tokens, k, num_experts = x_NH.shape[0], self.topk, self.num_experts
        logits_NE = F.linear(x_NH.to(self.weight.dtype), self.weight).float()
        if self._skew_E is not None:
            logits_NE = logits_NE + self._skew_E
        bias_E = self.expert_bias
        if self.score_function is ScoreFunction.SOFTMAX:
            select_NE = logits_NE if bias_E is None else logits_NE + bias_E
            indices_NK = torch.topk(select_NE, k, dim=1).indices
            probs_NK = torch.softmax(logits_NE.gather(1, indices_NK), dim=1)
            scores_NE = torch.softmax(logits_NE, dim=1) if self.aux_loss_coeff else None
        else:
            sig_NE = torch.sigmoid(logits_NE)
            select_NE = sig_NE if bias_E is None else sig_NE + bias_E
            indices_NK = torch.topk(select_NE, k, dim=1).indices
            probs_NK = sig_NE.gather(1, indices_NK)
            if k > 1:
                probs_NK = probs_NK / (probs_NK.sum(1, keepdim=True) + _EPS)
            scores_NE = None
            if self.aux_loss_coeff:
                scores_NE = sig_NE / (sig_NE.sum(1, keepdim=True) + _EPS)
        counts_E = torch.zeros(num_experts, dtype=torch.int64, device=x_NH.device)
        counts_E.scatter_add_(0, indices_NK.reshape(-1), torch.ones_like(indices_NK).reshape(-1))
        if scores_NE is None or num_tokens == 0:
            aux = logits_NE.new_zeros(())
        else:
            fraction_E = counts_E.to(torch.float32) / (num_tokens * k)
            aux = (fraction_E * scores_NE.mean(0)).sum() * (num_experts * self.aux_loss_coeff)
        return RouterOutput(probs_NK, indices_NK, aux, counts_E)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, topk={self.topk}, score={self.score_function.value}, "
            f"expert_bias={self.expert_bias is not None}, aux_loss_coeff={self.aux_loss_coeff}, "
            f"skew={self.skew}"
        )
