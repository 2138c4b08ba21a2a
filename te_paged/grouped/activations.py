"""Fused probability-weighted GLU activations for the expert MLP (SwiGLU, QuickGeGLU).

Shape suffixes: ``R`` rows (tokens of the static expert buffer, actual rows a prefix), ``F`` FFN
width (output columns), ``C = 2F`` input columns: the gate is ``x[:, :F]``, the up/linear half
``x[:, F:]`` (Transformer Engine's layout; an interleaved GLU is de-interleaved by the caller).

Numerics: 16- and 32-bit inputs are computed in float32 and the result cast to the input dtype,
in forward and backward alike (float64 inputs compute in float64, which lets gradcheck run).
Backward recomputes the activation from the saved input instead of saving it.

Paged stash: the tensors these functions save are exactly the ones marked. Whether to mark is
the caller's ``paged_stash`` argument (driven by ``config.moe_paged_stash``), never inferred from
an attribute on an operand: a recompute wrapper hands in detached inputs that carry no attribute,
and inferring would silently disable the stash there (the review finding on the prior art). With
``paged_stash=False`` an existing producer marker on ``x``/``probs`` is still carried across the
internal view and FP8 cast, so a marked producer output stays marked.

FP8 input store (``fp8_input_store``): the saved input is :func:`~te_paged.grouped.fp8.quantize`-d
and backward dequantises it. The forward output is computed from the *dequantised* input too:
the function computed, and differentiated, is exactly ``f(dequantize(quantize(x)))`` (dequantised
to ``x``'s dtype), so forward and backward agree (Transformer Engine's
``cache_quantized_input`` computes forward from the high-precision input instead; we trade that
small forward accuracy for gradients that are exact for the output actually produced).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable

import torch

from te_paged.grouped.fp8 import Fp8Recipe, Fp8Tensor, dequantize, mark_fp8_saved, quantize
from te_paged.kernels.compiled import save_for_backward, saved_tensors
from te_paged.markers import (
    is_grouped_tensor_marked,
    mark_grouped_tensor,
    propagate_paged_stash_marker,
)
from te_paged.torch_compat import CLAMP_GRAD_AT_LIMIT

__all__ = [
    "ACTIVATIONS",
    "QUICK_GELU_ALPHA",
    "ActivationSpec",
    "WeightedQuickGeGLUFunction",
    "WeightedSwiGLUFunction",
    "activation_for_function",
    "finish_grads",
    "get_activation",
    "load_saved_inputs",
    "register_activation",
    "save_inputs",
    "weighted_quick_geglu",
    "weighted_swiglu",
]

#: ``quick_gelu(g) = g · σ(1.702 g)``.
QUICK_GELU_ALPHA = 1.702


def static_function(cls: type, name: str) -> Callable:
    """``cls``'s static method ``name`` as the plain function it wraps."""
    return inspect.getattr_static(cls, name).__func__


def _mark(paged_stash: bool, source: torch.Tensor, target: torch.Tensor) -> None:
    if paged_stash:
        mark_grouped_tensor(target)
    else:
        propagate_paged_stash_marker(source, target)


def save_inputs(ctx, x, probs, recipe, paged_stash, num_rows) -> tuple[torch.Tensor, ...]:
    """Save (and mark) what backward needs; return ``(x_RC, probs_R)`` in the compute dtype.

    ``x_RC``/``probs_R`` are fresh views: the objects actually saved, so they carry the marker.
    """
    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.probs_shape, ctx.probs_dtype = probs.shape, probs.dtype
    ctx.compute_dtype = torch.promote_types(x.dtype, torch.float32)
    ctx.recipe = recipe
    x_RC = x.reshape(-1, x.shape[-1])
    probs_R = probs.reshape(-1)
    _mark(paged_stash, probs, probs_R)
    if recipe is None:
        _mark(paged_stash, x, x_RC)
        save_for_backward(ctx, x_RC, probs_R)
        return x_RC.to(ctx.compute_dtype), probs_R
    fp8 = quantize(x_RC, recipe, num_rows)
    if paged_stash or is_grouped_tensor_marked(x):
        mark_fp8_saved(fp8)
    save_for_backward(ctx, *fp8.saved(), probs_R)
    return dequantize(fp8).to(ctx.compute_dtype), probs_R


def load_saved_inputs(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_RC, probs_R)`` as a fused function's forward saved them, ``x`` in the compute dtype
    (dequantised from its FP8 store); ``ctx.x_shape``/``x_dtype``/``probs_shape`` restore the
    caller's views."""
    if ctx.recipe is None:
        x_RC, probs_R = saved_tensors(ctx)
        return x_RC.to(ctx.compute_dtype), probs_R
    fp8, (probs_R,) = Fp8Tensor.from_saved(saved_tensors(ctx), ctx.recipe, ctx.x_dtype)
    return dequantize(fp8).to(ctx.compute_dtype), probs_R


def finish_grads(ctx, dgate_RF, dup_RF, dprobs_R) -> tuple[torch.Tensor | None, ...]:
    """``(dx, dprobs)`` in the caller's dtypes and shapes, as ``ctx.needs_input_grad`` asks."""
    dx = None
    if ctx.needs_input_grad[0]:
        dx = torch.cat([dgate_RF, dup_RF], dim=1).to(ctx.x_dtype).view(ctx.x_shape)
    dprobs = None
    if ctx.needs_input_grad[1]:
        dprobs = dprobs_R.to(ctx.probs_dtype).view(ctx.probs_shape)
    return dx, dprobs


class WeightedSwiGLUFunction(torch.autograd.Function):
    """``y = silu(gate) · up · probs`` with ``silu(g) = g·σ(g)``.

    ==========  =============  ==================================================
    tensor      shape          note
    ==========  =============  ==================================================
    ``x``       ``[..., 2F]``  ``R`` = product of the leading dims
    ``probs``   ``[R]|[R,1]``  routing probability of each row
    ``y``       ``[..., F]``   dtype of ``x``
    ==========  =============  ==================================================

    Backward, with ``s = σ(g)``, ``dy`` the incoming gradient::

        d_gate  = dy · probs · up · s·(1 + g·(1 − s))
        d_up    = dy · probs · silu(g)
        d_probs = Σ_F dy · silu(g) · up

    Saves for backward (each marked as described in the module docstring):

    * ``x`` as a ``[R, 2F]`` view: ``2·R·F·itemsize(x)`` bytes (bf16: ``4·R·F``), or with the FP8
      store the e4m3 bytes, ``2·R·F``, plus the scale-inverse (tensorwise: 4 bytes; MXFP8:
      ``2·R·F/32`` bytes of e8m0, one row per 32 tokens);
    * ``probs`` as a ``[R]`` view: ``R·itemsize(probs)`` bytes.

    The output is not saved; backward recomputes ``σ(g)``.
    """

    @staticmethod
    def forward(ctx, x, probs, recipe, paged_stash, num_rows, limit=None, linear_offset=0.0):
        if limit is not None or linear_offset:
            raise ValueError(
                "the fused SwiGLU has no clamp and no linear offset (as Megatron's): use the "
                "unfused activation (bias_activation_fusion=False)"
            )
        x_RC, probs_R = save_inputs(ctx, x, probs, recipe, paged_stash, num_rows)
        ffn = x_RC.shape[1] // 2
        gate_RF, up_RF = x_RC[:, :ffn], x_RC[:, ffn:]
        y_RF = torch.nn.functional.silu(gate_RF) * up_RF * probs_R.to(x_RC.dtype).unsqueeze(1)
        return y_RF.to(x.dtype).view(*x.shape[:-1], ffn)

    @staticmethod
    def backward(ctx, dy):
        x_RC, probs_R = load_saved_inputs(ctx)
        ffn = x_RC.shape[1] // 2
        gate_RF, up_RF = x_RC[:, :ffn], x_RC[:, ffn:]
        dy_RF = dy.reshape(-1, ffn).to(x_RC.dtype)
        sig_RF = torch.sigmoid(gate_RF)
        act_RF = torch.nn.functional.silu(gate_RF)  # as in forward, not gate·σ: same rounding
        dyp_RF = dy_RF * probs_R.to(x_RC.dtype).unsqueeze(1)
        # Megatron's rounding order, so te_paged's experts match its SwiGLU bit for bit.
        dgate_RF = ((dyp_RF * sig_RF) * (1 + gate_RF * (1 - sig_RF))) * up_RF
        dup_RF = dyp_RF * act_RF
        dprobs_R = (dy_RF * (act_RF * up_RF)).sum(dim=1)  # y = (act · up) · probs
        return *finish_grads(ctx, dgate_RF, dup_RF, dprobs_R), None, None, None, None, None


class WeightedQuickGeGLUFunction(torch.autograd.Function):
    """``y = quick_gelu(gate') · (up' + linear_offset) · probs``, ``quick_gelu(g) = g·σ(α g)``,
    ``α = 1.702``; with ``limit`` (GPT-OSS style) ``gate' = min(gate, limit)`` and
    ``up' = clamp(up, −limit, limit)``, else ``gate' = gate``, ``up' = up``.

    Shapes as :class:`WeightedSwiGLUFunction`. Backward, with ``s = σ(α gate')``::

        d_gate  = dy · probs · (up' + offset) · (s + α·gate'·s·(1 − s))   [0 where gate ≥ limit]
        d_up    = dy · probs · quick_gelu(gate')                          [0 where |up| ≥ limit]
        d_probs = Σ_F dy · quick_gelu(gate') · (up' + offset)

    (at ``gate == limit`` the gradient follows the running torch's ``torch.clamp``: it passes
    up to torch 2.14 and is 0 from 2.15, :data:`te_paged.torch_compat.CLAMP_GRAD_AT_LIMIT`;
    Megatron's quick-GeGLU clamps with ``torch.clamp`` under autograd). Saves exactly what
    :class:`WeightedSwiGLUFunction` saves, at the same cost: the clamp is recomputed in backward.
    """

    @staticmethod
    def forward(ctx, x, probs, recipe, paged_stash, num_rows, limit, linear_offset):
        x_RC, probs_R = save_inputs(ctx, x, probs, recipe, paged_stash, num_rows)
        ctx.limit, ctx.linear_offset = limit, linear_offset
        ffn = x_RC.shape[1] // 2
        gate_RF, up_RF = _clamp(x_RC[:, :ffn], x_RC[:, ffn:], limit)
        act_RF = gate_RF * torch.sigmoid(QUICK_GELU_ALPHA * gate_RF)
        y_RF = act_RF * (up_RF + linear_offset) * probs_R.to(x_RC.dtype).unsqueeze(1)
        return y_RF.to(x.dtype).view(*x.shape[:-1], ffn)

    @staticmethod
    def backward(ctx, dy):
        x_RC, probs_R = load_saved_inputs(ctx)
        ffn = x_RC.shape[1] // 2
        gate_raw_RF, up_raw_RF = x_RC[:, :ffn], x_RC[:, ffn:]
        gate_RF, up_RF = _clamp(gate_raw_RF, up_raw_RF, ctx.limit)
        up_RF = up_RF + ctx.linear_offset
        dy_RF = dy.reshape(-1, ffn).to(x_RC.dtype)
        sig_RF = torch.sigmoid(QUICK_GELU_ALPHA * gate_RF)
        act_RF = gate_RF * sig_RF
        dyp_RF = dy_RF * probs_R.to(x_RC.dtype).unsqueeze(1)
        dgate_RF = dyp_RF * up_RF * (sig_RF + QUICK_GELU_ALPHA * gate_RF * sig_RF * (1 - sig_RF))
        dup_RF = dyp_RF * act_RF
        if ctx.limit is not None:
            inside_gate_RF, inside_up_RF = _inside(gate_raw_RF, up_raw_RF, ctx.limit)
            dgate_RF = torch.where(inside_gate_RF, dgate_RF, 0.0)
            dup_RF = torch.where(inside_up_RF, dup_RF, 0.0)
        dprobs_R = (dy_RF * (act_RF * up_RF)).sum(dim=1)
        return *finish_grads(ctx, dgate_RF, dup_RF, dprobs_R), None, None, None, None, None


def _clamp(gate, up, limit: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    if limit is None:
        return gate, up
    return gate.clamp(max=limit), up.clamp(-limit, limit)


def _inside(gate, up, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the clamp passes the gradient: the running torch's ``torch.clamp`` rule at the
    limit itself (passed up to torch 2.14, stopped from 2.15), as Megatron's activations,
    which clamp with ``torch.clamp`` under autograd, get it."""
    if CLAMP_GRAD_AT_LIMIT:
        return gate <= limit, (up >= -limit) & (up <= limit)
    return gate < limit, (up > -limit) & (up < limit)


def _check(x, probs, fp8_input_store, num_rows) -> Fp8Recipe | None:
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() < 1:
        raise TypeError(f"x must be a floating-point tensor [..., 2F], got {x!r:.80}")
    if x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's last dim holds [gate | up] and must be even and > 0, got "
                         f"shape {tuple(x.shape)}")  # fmt: skip
    rows = x.numel() // x.shape[-1]
    if not isinstance(probs, torch.Tensor) or not probs.dtype.is_floating_point:
        raise TypeError(f"probs must be a floating-point tensor, got {probs!r:.80}")
    if tuple(probs.shape) not in ((rows,), (rows, 1)):
        raise ValueError(f"probs must have shape [{rows}] or [{rows}, 1] for x of shape "
                         f"{tuple(x.shape)}, got {tuple(probs.shape)}")  # fmt: skip
    if probs.device != x.device:
        raise ValueError(f"probs is on {probs.device} but x on {x.device}")
    if fp8_input_store is None:
        return None
    try:
        recipe = Fp8Recipe(fp8_input_store)
    except ValueError:
        allowed = [r.value for r in Fp8Recipe]
        raise ValueError(f"fp8_input_store must be None or one of {allowed}, got "
                         f"{fp8_input_store!r}") from None  # fmt: skip
    if num_rows is not None and num_rows.device != x.device:
        raise ValueError(f"num_rows is on {num_rows.device} but x on {x.device}")
    return recipe


def weighted_swiglu(
    x: torch.Tensor,
    probs: torch.Tensor,
    *,
    fp8_input_store: Fp8Recipe | str | None = None,
    paged_stash: bool = False,
    num_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(x[..., :F]) · x[..., F:] · probs[:, None]`` → ``[..., F]`` (see
    :class:`WeightedSwiGLUFunction` for shapes, gradients and saved bytes).

    ``fp8_input_store`` stores the saved input as FP8 with that recipe; ``num_rows`` (a
    one-element device tensor, used only then) keeps padding rows out of the FP8 scales and
    stores them as zeros, the bytes the stash restores them as: pass it with ``paged_stash`` for
    bitwise stash-on/off parity. ``paged_stash=True`` marks every saved token-major tensor.
    """
    recipe = _check(x, probs, fp8_input_store, num_rows)
    return WeightedSwiGLUFunction.apply(x, probs, recipe, bool(paged_stash), num_rows, None, 0.0)


def weighted_quick_geglu(
    x: torch.Tensor,
    probs: torch.Tensor,
    *,
    limit: float | None = None,
    linear_offset: float = 0.0,
    fp8_input_store: Fp8Recipe | str | None = None,
    paged_stash: bool = False,
    num_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``quick_gelu(gate') · (up' + linear_offset) · probs[:, None]`` → ``[..., F]``, with the
    optional GPT-OSS clamp ``limit`` (see :class:`WeightedQuickGeGLUFunction`). Other arguments as
    in :func:`weighted_swiglu`.
    """
    recipe = _check(x, probs, fp8_input_store, num_rows)
    if limit is not None and not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"limit must be None or a finite value > 0, got {limit}")
    if not math.isfinite(linear_offset):
        raise ValueError(f"linear_offset must be finite, got {linear_offset}")
    return WeightedQuickGeGLUFunction.apply(
        x, probs, recipe, bool(paged_stash), num_rows,
        None if limit is None else float(limit), float(linear_offset),
    )  # fmt: skip


# ------------------------------------------------------------------------------ the registry


@dataclasses.dataclass(frozen=True)
class ActivationSpec:
    """One expert activation, everything te_paged's experts need to know of it.

    ``name`` is the config's ``activation``; ``function`` the elementwise function's name as
    Megatron's ``activation_func.__name__`` spells it (how a Megatron config is read);
    ``elementwise`` that function; ``gated`` whether it is a GLU (``act(gate) · up``, FC1
    ``2F`` wide). Every activation runs in Megatron's unfused order
    (:func:`~te_paged.grouped.weighted_activation.weighted_activation`), which saves its input
    ``[R, C]`` and the probabilities ``[R]``, marked for the paged stash, and nothing else.

    ``fused``, where there is one, is an autograd function with Megatron's fused kernel's
    numerics (fp32 inside, one rounding) for ``bias_activation_fusion`` and the op-fuser path:
    ``forward(ctx, x, probs, fp8_recipe, paged_stash, num_rows, limit, linear_offset)`` saving
    through ``save_inputs`` (the same two tensors, or the input's FP8 bytes and scale-inverse
    with the FP8 store) and a matching ``backward``; ``fused_clamp`` says whether it takes the
    GPT-OSS clamp and linear offset.
    """

    name: str
    function: str
    gated: bool
    elementwise: Callable[[torch.Tensor], torch.Tensor]
    fused: type[torch.autograd.Function] | None = None
    fused_clamp: bool = False

    def __post_init__(self) -> None:
        # The fused kernel's static forward and backward as plain functions, for the op fuser
        # (te_paged.moe.fused_mlp) to drive with stand-in contexts: resolved here, once, since
        # Dynamo takes a call through the autograd function's class for its own entry point.
        for name in ("forward", "backward"):
            fn = None if self.fused is None else static_function(self.fused, name)
            object.__setattr__(self, f"fused_{name}", fn)

    @property
    def is_gated(self) -> bool:
        return self.gated

    @property
    def has_fused_kernel(self) -> bool:
        return self.fused is not None


ACTIVATIONS: dict[str, ActivationSpec] = {}


def register_activation(spec: ActivationSpec, *, replace: bool = False) -> ActivationSpec:
    """Add ``spec`` under its name (``replace=True`` to override one); returns it."""
    if not isinstance(spec, ActivationSpec):
        raise TypeError(f"register_activation takes an ActivationSpec, got {spec!r}")
    if spec.name in ACTIVATIONS and not replace:
        raise ValueError(f"an activation named {spec.name!r} is already registered; pass "
                         "replace=True to override it")  # fmt: skip
    ACTIVATIONS[spec.name] = spec
    return spec


def get_activation(name: str) -> ActivationSpec:
    """The registered activation ``name``; a ``ValueError`` naming the registered ones."""
    spec = ACTIVATIONS.get(getattr(name, "value", name))
    if spec is None:
        raise ValueError(f"activation={name!r} is not registered; registered: "
                         f"{', '.join(repr(n) for n in ACTIVATIONS)}")  # fmt: skip
    return spec


def activation_for_function(function: str, gated: bool) -> ActivationSpec:
    """The activation Megatron's ``(activation_func.__name__, gated_linear_unit)`` builds."""
    for spec in ACTIVATIONS.values():
        if spec.function == function and spec.gated == bool(gated):
            return spec
    functions = sorted({s.function for s in ACTIVATIONS.values()})
    raise ValueError(
        f"no activation for function {function!r} with gated={bool(gated)}; registered "
        f"functions: {functions}"
    )


def _register_builtins() -> None:
    from te_paged.grouped.weighted_activation import ACTIVATION_FUNCTIONS as fns

    glu = {"silu": "swiglu", "gelu": "geglu", "quick_gelu": "quick_geglu", "relu": "reglu",
           "squared_relu": "squared_reglu"}  # fmt: skip
    fused = {"swiglu": (WeightedSwiGLUFunction, False),
             "quick_geglu": (WeightedQuickGeGLUFunction, True)}  # fmt: skip
    for function, gated_name in glu.items():
        kernel, clamp = fused.get(gated_name, (None, False))
        spec = ActivationSpec(gated_name, function, True, fns[function], kernel, clamp)
        register_activation(spec)
    for function in glu:
        register_activation(ActivationSpec(function, function, False, fns[function]))


_register_builtins()
