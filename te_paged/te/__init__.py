"""Adapter to Transformer Engine, imported lazily.

``import te_paged`` never imports Transformer Engine. The helpers here look it up on first use:
a module already in ``sys.modules`` (a real TE, or a stand-in a test injected) is used as is; an
installed but not yet imported TE is imported then. Without TE every helper reports "not handled"
and te_paged uses its built-in implementation.
"""

# ruff: noqa: E402 — the torch check comes before the imports that need torch

from __future__ import annotations

from te_paged._lazy import require_torch

require_torch(__name__)

import functools
import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "te_grouped_linear_class",
    "te_is_available",
    "te_mark_grouped_tensor",
]

_TE = "transformer_engine"
_TE_MARK_MODULES = ("transformer_engine.pytorch.utils", "transformer_engine.pytorch")


@functools.lru_cache(maxsize=1)
def _te_installed() -> bool:
    return importlib.util.find_spec(_TE) is not None


def _import(name: str) -> ModuleType | None:
    if name in sys.modules:
        return sys.modules[name]
    if _TE not in sys.modules and not _te_installed():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def te_is_available() -> bool:
    """True when Transformer Engine's PyTorch package can be used."""
    return _import("transformer_engine.pytorch") is not None


def _te_attr(modules: tuple[str, ...], attr: str) -> Any:
    for name in modules:
        module = _import(name)
        fn = getattr(module, attr, None) if module is not None else None
        if fn is not None:
            return fn
    return None


def te_mark_grouped_tensor(t: torch.Tensor, scale_inv: bool) -> bool:
    """Mark ``t`` with TE's own ``mark_grouped_tensor``; False when TE is absent.

    TE's utility marks row-wise storage (one row per token). Scale-inverses are marked by TE
    inside its own quantised storage; for ours (``scale_inv=True``) te_paged sets the shared
    attribute itself, so this returns False for them.
    """
    if scale_inv:
        return False
    fn = _te_attr(_TE_MARK_MODULES, "mark_grouped_tensor")
    if fn is None:
        return False
    fn(t)
    return True


def te_grouped_linear_class() -> type | None:
    """TE's ``GroupedLinear`` when it supports the device-initiated path, else None."""
    cls = _te_attr(("transformer_engine.pytorch",), "GroupedLinear")
    if cls is None:
        return None
    import inspect

    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    return cls if "use_grouped_tensor" in params else None
