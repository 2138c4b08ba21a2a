"""Read a Megatron ``TransformerConfig`` (or our :class:`MoEConfig`) into a :class:`MoEConfig`.

Megatron describes the expert activation by a function and a flag (``activation_func=F.silu``
with ``gated_linear_unit=True`` is SwiGLU; ``quick_gelu`` gated is QuickGeGLU) and FP8 by
``fp8`` (a format) plus ``fp8_recipe``. Fields te_paged does not know are ignored; fields Megatron
does not have take :class:`MoEConfig`'s defaults.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from te_paged.config import Activation, MoEConfig

__all__ = ["as_moe_config"]

# (Megatron activation function name, gated_linear_unit) -> te_paged activation
_ACTIVATIONS = {
    ("silu", True): Activation.SWIGLU,
    ("quick_gelu", True): Activation.QUICK_GEGLU,
    ("silu", False): Activation.SILU,
    ("gelu", False): Activation.GELU,
}


def _activation(func: object, gated: bool) -> str:
    name = "silu" if func is F.silu else "gelu" if func is F.gelu else getattr(func, "__name__", "")
    activation = _ACTIVATIONS.get((name, gated))
    if activation is None:
        supported = ", ".join(f"{n} (gated_linear_unit={g})" for n, g in _ACTIVATIONS)
        raise ValueError(
            f"activation_func={name or func!r} with gated_linear_unit={gated} is not supported "
            f"by te_paged's experts; supported: {supported}"
        )
    return activation.value


def _fp8(config: object) -> str | None:
    if getattr(config, "fp8", None) in (None, False):
        return None
    recipe = getattr(config, "fp8_recipe", None)
    recipe = getattr(recipe, "value", recipe)
    if recipe in ("tensorwise", "mxfp8"):
        return recipe
    raise ValueError(
        f"fp8={config.fp8!r} with fp8_recipe={recipe!r}: te_paged stores FP8 with the "
        "'tensorwise' (current scaling) or 'mxfp8' recipe only"
    )


def as_moe_config(config: object) -> MoEConfig:
    """``config`` itself when it is a :class:`MoEConfig`, else a new one read field by field."""
    if isinstance(config, MoEConfig):
        return config
    kw: dict[str, object] = {}
    for f in dataclasses.fields(MoEConfig):
        if f.name in ("activation", "fp8"):
            continue
        if hasattr(config, f.name):
            value = getattr(config, f.name)
            if f.name in ("recompute_modules", "offload_modules") and value is None:
                value = []
            # Megatron defaults recompute_modules to ["core_attn"] whatever the granularity;
            # the list only means something with selective recompute.
            if (
                f.name == "recompute_modules"
                and getattr(config, "recompute_granularity", None) != "selective"
            ):
                value = []
            kw[f.name] = value
    gated = bool(getattr(config, "gated_linear_unit", True))
    if hasattr(config, "activation_func"):
        kw["activation"] = _activation(config.activation_func, gated)
    if getattr(config, "moe_ffn_hidden_size", None) is None and hasattr(config, "ffn_hidden_size"):
        kw["moe_ffn_hidden_size"] = config.ffn_hidden_size
    if not isinstance(kw.get("params_dtype", torch.float32), torch.dtype):
        kw.pop("params_dtype")
    kw["fp8"] = _fp8(config)
    return MoEConfig(**kw)
