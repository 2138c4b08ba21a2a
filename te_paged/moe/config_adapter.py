"""Read a Megatron ``TransformerConfig`` (or our :class:`MoEConfig`) into a :class:`MoEConfig`.

Megatron describes the expert activation by a function and a flag (``activation_func=F.silu``
with ``gated_linear_unit=True`` is SwiGLU; ``quick_gelu`` gated is QuickGeGLU) and FP8 by
``fp8`` (a format) plus ``fp8_recipe``. Fields te_paged does not know are ignored; fields Megatron
does not have take :class:`MoEConfig`'s defaults.
"""

from __future__ import annotations

import dataclasses

import torch

from te_paged.config import MoEConfig
from te_paged.grouped.activations import ACTIVATIONS, activation_for_function

__all__ = ["as_moe_config"]


def _activation(func: object, gated: bool) -> str:
    """te_paged's activation for Megatron's ``(activation_func, gated_linear_unit)``: the
    function is recognised by its name (``F.silu``, ``F.gelu``, ``F.relu``, Megatron's
    ``quick_gelu`` and ``squared_relu``, or any registered in
    :mod:`te_paged.grouped.activations`)."""
    name = getattr(func, "__name__", "")
    try:
        return activation_for_function(name, bool(gated)).name
    except ValueError:
        supported = ", ".join(sorted({a.function for a in ACTIVATIONS.values()}))
        raise ValueError(
            f"activation_func={name or func!r} is not supported by te_paged's experts; "
            f"supported (gated or not): {supported}"
        ) from None


def _fp8(config: object) -> str | None:
    if getattr(config, "fp4", None) not in (None, False):  # Megatron's --fp4-format e2m1
        recipe = getattr(config, "fp4_recipe", "nvfp4")
        if recipe != "nvfp4" or getattr(config, "fp8", None) not in (None, False):
            raise ValueError(
                f"fp4={config.fp4!r} with fp4_recipe={recipe!r}, fp8="
                f"{getattr(config, 'fp8', None)!r}: te_paged stores FP4 with the 'nvfp4' recipe "
                "only, and not together with fp8"
            )
        return "nvfp4"
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
    if getattr(config, "use_te_activation_func", False):
        raise ValueError(
            "use_te_activation_func=True (Transformer Engine's activation modules) is not "
            "supported by te_paged's experts; set it to False: te_paged then computes "
            "Megatron's own activation code, bit for bit (see docs/configuration.md)"
        )
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
