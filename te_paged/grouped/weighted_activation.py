"""Probability-weighted expert activations in Megatron's unfused order, for every activation.

Shape suffixes: ``R`` rows (tokens of the static expert buffer), ``C`` input columns (``2F``
gated: ``[gate | up]``, else ``F``), ``F`` output columns.

The registry :data:`ACTIVATION_FUNCTIONS` names the elementwise functions Megatron-core's
experts take as ``activation_func`` — ``silu``, ``gelu``, ``quick_gelu``, ``relu``,
``squared_relu`` — with Megatron's own formulas. :func:`weighted_activation` applies one,
gated (GLU: ``act(gate') · (up' + offset)`` with GPT-OSS's optional clamp) or not, then the
routing probability, in exactly the op order of Megatron's ``TEGroupedMLP`` without bias/
activation fusion::

    h     = act(gate') · (up' + offset)          # gated; act(x) otherwise (x's dtype)
    y     = (h · probs[:, None]).to(x.dtype)     # probs promote (fp32): one more rounding

so outputs and gradients equal Megatron's bit for bit, in fp32 and bf16. Backward recomputes
this forward from the saved input and differentiates it with autograd: the same ops in the same
order, hence the same gradients, and nothing but the input and the probabilities is saved.

Paged stash: the saved ``x`` ``[R, C]`` and ``probs`` ``[R]`` are token-major and marked when
``paged_stash`` (the caller's config) says so, never inferred from operands; otherwise a marker
``x``/``probs`` already carry is propagated to the saved views.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from te_paged.kernels.compiled import save_for_backward, saved_tensors
from te_paged.markers import mark_grouped_tensor, propagate_paged_stash_marker

__all__ = [
    "ACTIVATION_FUNCTIONS",
    "fused_weighted_squared_relu",
    "quick_gelu",
    "squared_relu",
    "weighted_activation",
]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_compiled_quick_gelu: Callable[[torch.Tensor], torch.Tensor] | None = None


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x · σ(1.702 x)``, Megatron's formula — and, like Megatron's (``@jit_fuser``, which is
    ``torch.compile``), compiled on first use, so forward and backward give the bits of the
    compiled kernel (one rounding in bf16) rather than of three eager ops."""
    global _compiled_quick_gelu
    if torch.compiler.is_compiling():  # inside a compiled region: already compiled
        return _quick_gelu(x)
    if _compiled_quick_gelu is None:
        _compiled_quick_gelu = torch.compile(_quick_gelu)
    return _compiled_quick_gelu(x)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)²``, Megatron's formula (``activations.squared_relu``; eager here: its one
    rounding per op gives the compiled kernel's bits)."""
    return torch.pow(F.relu(x), 2)


#: Megatron's ``activation_func`` choices, by name (the name of the function object).
ACTIVATION_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "squared_relu": squared_relu,
}


def _forward(x_RC, probs_R, act, gated, limit, offset) -> torch.Tensor:
    if gated:
        gate_RF, up_RF = torch.chunk(x_RC, 2, dim=-1)
        if limit is not None:
            gate_RF = gate_RF.clamp(min=None, max=limit)
            up_RF = up_RF.clamp(min=-limit, max=limit)
        h_RF = act(gate_RF) * (up_RF + offset)
    else:
        h_RF = act(x_RC)
    return (h_RF * probs_R.unsqueeze(-1)).to(x_RC.dtype)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _WeightedActivation(torch.autograd.Function):
    """``y = (act-or-GLU(x) · probs).to(x.dtype)``; backward recomputes and differentiates it.

    ==========  =============  ==================================================
    tensor      shape          note
    ==========  =============  ==================================================
    ``x``       ``[R, C]``     ``C = 2F`` gated (``[gate | up]``), else ``F``
    ``probs``   ``[R]``        routing probability of each row (any float dtype)
    ``y``       ``[R, F]``     dtype of ``x``
    ==========  =============  ==================================================

    Saves ``x`` (``R·C·itemsize(x)`` bytes) and ``probs`` (``R·itemsize(probs)``), each marked
    for the paged stash as the module docstring says. The output is not saved.
    """

    @staticmethod
    def forward(ctx, x_RC, probs_R, act, gated, limit, offset, paged_stash):
        x_saved, p_saved = x_RC.view_as(x_RC), probs_R.view_as(probs_R)
        for source, saved in ((x_RC, x_saved), (probs_R, p_saved)):
            if paged_stash:
                mark_grouped_tensor(saved)
            else:
                propagate_paged_stash_marker(source, saved)
        save_for_backward(ctx, x_saved, p_saved)
        ctx.spec = (act, gated, limit, offset)
        if torch.compiler.is_compiling():  # no inner graph to build: backward takes a vjp
            return _forward(x_RC, probs_R, act, gated, limit, offset)
        # In grad mode, as Megatron calls it (and as backward recomputes it): a compiled
        # activation then runs the same compiled graph in forward and backward, and keeps to one
        # cache entry per input layout (grad mode is part of torch.compile's guards). The
        # graph built here is dropped with the detach; what it saves bypasses the stash.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
            y_RF = _forward(x_RC, probs_R, act, gated, limit, offset)
        return y_RF.detach()

    @staticmethod
    def backward(ctx, dy_RF):
        x_RC, probs_R = saved_tensors(ctx)
        needs = ctx.needs_input_grad[:2]
        if torch.compiler.is_compiling():
            # Dynamo does not trace torch.autograd.grad; torch.func.vjp differentiates the
            # same ops with the same formulas (the compiled graph, ON and OFF alike, uses it).
            spec = ctx.spec
            _, vjp = torch.func.vjp(lambda x, p: _forward(x, p, *spec), x_RC, probs_R)
            dx, dp = vjp(dy_RF)
            return (dx if needs[0] else None, dp if needs[1] else None,
                    None, None, None, None, None)  # fmt: skip
        with torch.enable_grad():
            x = x_RC.detach().requires_grad_(needs[0])
            p = probs_R.detach().requires_grad_(needs[1])
            y = _forward(x, p, *ctx.spec)
            inputs = [t for t, need in zip((x, p), needs) if need]
            grads = iter(torch.autograd.grad(y, inputs, dy_RF) if inputs else ())
        dx = next(grads) if needs[0] else None
        dp = next(grads) if needs[1] else None
        return dx, dp, None, None, None, None, None


def weighted_activation(
    x: torch.Tensor,
    probs: torch.Tensor,
    *,
    activation: str | Callable[[torch.Tensor], torch.Tensor],
    gated: bool,
    limit: float | None = None,
    linear_offset: float = 0.0,
    paged_stash: bool = False,
) -> torch.Tensor:
    """``act(x) · probs`` or, ``gated``, ``act(gate') · (up' + linear_offset) · probs``, in
    Megatron's unfused op order (see the module docstring). ``x`` is ``[..., C]``, ``probs``
    ``[R]`` or ``[R, 1]`` for ``R`` rows; returns ``[..., F]`` in ``x``'s dtype.
    ``activation`` is an elementwise function (a registered activation's ``elementwise``, see
    :mod:`te_paged.grouped.activations`) or names one of :data:`ACTIVATION_FUNCTIONS`;
    ``limit`` clamps the gate from above and ``up`` to ``[-limit, limit]`` (GPT-OSS).
    """
    act = activation if callable(activation) else ACTIVATION_FUNCTIONS.get(activation)
    if act is None:
        raise ValueError(f"activation={activation!r} is not one of {sorted(ACTIVATION_FUNCTIONS)}")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
        raise TypeError(f"x must be a floating-point tensor [..., C], got {x!r:.80}")
    if gated and x.shape[-1] % 2:
        raise ValueError(f"a gated activation needs an even last dim [gate | up], got "
                         f"{tuple(x.shape)}")  # fmt: skip
    x_RC = x.reshape(-1, x.shape[-1])
    rows = x_RC.shape[0]
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) not in ((rows,), (rows, 1)):
        raise ValueError(
            f"probs must have shape [{rows}] or [{rows}, 1] for x of shape {tuple(x.shape)}, "
            f"got {tuple(getattr(probs, 'shape', ()))}"
        )
    y_RF = _WeightedActivation.apply(
        x_RC, probs.reshape(rows), act, bool(gated), limit, float(linear_offset),
        bool(paged_stash),
    )  # fmt: skip
    return y_RF.view(*x.shape[:-1], y_RF.shape[-1])


# ----------------------------------------------------- Megatron's fused weighted squared ReLU


def _wsr_forward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.pow(F.relu(x), 2) * w).to(x.dtype)


def _wsr_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    dx = g * w * 2 * F.relu(x)  # d relu(x)^2 = 2 relu(x), times the incoming g·w
    dw = torch.sum(torch.pow(F.relu(x), 2) * g.to(w.dtype), dim=-1, keepdim=True)
    return dx.to(x.dtype), dw.to(w.dtype)


_compiled_wsr: dict[str, Callable] = {}


def _wsr(name: str) -> Callable:
    """The compiled kernel (Megatron compiles both directions with ``jit_fuser``); inside a
    compiled region the function itself."""
    if torch.compiler.is_compiling():
        return _wsr_forward if name == "fwd" else _wsr_backward
    if name not in _compiled_wsr:
        _compiled_wsr[name] = torch.compile(_wsr_forward if name == "fwd" else _wsr_backward)
    return _compiled_wsr[name]


class _FusedWeightedSquaredReLU(torch.autograd.Function):
    """``y = (relu(x)² · w).to(x.dtype)`` with Megatron's fused kernel's numerics
    (``use_fused_weighted_squared_relu``): one compiled kernel each way, backward
    ``dx = g·w·2·relu(x)``, ``dw = Σ_F relu(x)²·g``. Saves ``x`` ``[R, F]`` and ``w``
    ``[R, 1]``, marked as :class:`_WeightedActivation` marks them."""

    @staticmethod
    def forward(ctx, x_RF, w_R1, paged_stash):
        x_saved, w_saved = x_RF.view_as(x_RF), w_R1.view_as(w_R1)
        for source, saved in ((x_RF, x_saved), (w_R1, w_saved)):
            if paged_stash:
                mark_grouped_tensor(saved)
            else:
                propagate_paged_stash_marker(source, saved)
        save_for_backward(ctx, x_saved, w_saved)
        return _wsr("fwd")(x_RF, w_R1)

    @staticmethod
    def backward(ctx, dy_RF):
        x_RF, w_R1 = saved_tensors(ctx)
        dx, dw = _wsr("bwd")(dy_RF, x_RF, w_R1)
        return dx, dw, None


def fused_weighted_squared_relu(
    x: torch.Tensor, probs: torch.Tensor, *, paged_stash: bool = False
) -> torch.Tensor:
    """``relu(x)² · probs`` as Megatron's ``weighted_squared_relu_impl`` computes it (compiled,
    fp32 inside, rounded once). ``x`` is ``[R, F]``, ``probs`` ``[R]`` or ``[R, 1]``."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() != 2:
        raise TypeError(f"x must be a floating-point tensor [R, F], got {x!r:.80}")
    rows = x.shape[0]
    if not isinstance(probs, torch.Tensor) or tuple(probs.shape) not in ((rows,), (rows, 1)):
        raise ValueError(
            f"probs must have shape [{rows}] or [{rows}, 1] for x of shape {tuple(x.shape)}, "
            f"got {tuple(getattr(probs, 'shape', ()))}"
        )
    return _FusedWeightedSquaredReLU.apply(x, probs.reshape(rows, 1), bool(paged_stash))
