"""Megatron expert checkpoints (plain state dicts) to and from te_paged's modules.

Megatron writes expert weights in two layouts: ``TEGroupedMLP`` as ``linear_fc1.weight{i}``
and ``SequentialMLP`` as ``local_experts.{i}.linear_fc1.weight`` (``i`` the EP rank's *local*
expert index). Nothing here imports Megatron.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from te_paged.grouped import GroupedLinear

__all__ = [
    "grouped_to_sequential_state_dict",
    "load_megatron_expert_state_dict",
    "sequential_to_grouped_state_dict",
    "to_megatron_grouped_state_dict",
    "to_megatron_sequential_state_dict",
]

# SequentialMLP: "<p>local_experts.<i>.linear_fc1.weight"; TEGroupedMLP: "<p>linear_fc1.weight<i>"
_SEQUENTIAL = re.compile(
    r"^(?P<prefix>.*?)local_experts\.(?P<expert>\d+)\.(?P<linear>linear_fc[12])\."
    r"(?P<param>weight|bias|_extra_state)$"
)
_GROUPED = re.compile(
    r"^(?P<prefix>.*?)(?P<linear>linear_fc[12])\.(?P<param>weight|bias)(?P<expert>\d+)$"
)
_STACKED = re.compile(r"^(?P<prefix>.*?)(?P<linear>linear_fc[12])\.(?P<param>weight|bias)$")
_STACKED_DIM = {"weight": 3, "bias": 2}  # one more than a dense linear's: unambiguous


def _unstack(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One grouped ``linear_fcK.weight [E, O, I]``/``bias [E, O]`` → ``weight{i}``/``bias{i}``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        m = _STACKED.match(key)
        if m and isinstance(value, torch.Tensor) and value.dim() == _STACKED_DIM[m["param"]]:
            out.update((f"{key}{i}", v) for i, v in enumerate(value.unbind(0)))
        else:
            out[key] = value
    return out


def sequential_to_grouped_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Rename ``SequentialMLP`` expert keys to ``TEGroupedMLP``'s, anywhere in a model's dict.

    ``<p>local_experts.<i>.linear_fcK.{weight,bias}`` → ``<p>linear_fcK.{weight,bias}<i>``; the
    per-expert ``_extra_state`` entries become one ``<p>linear_fcK._extra_state`` (the first
    expert's); every other key passes unchanged. Tensors are not copied.
    """
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        m = _SEQUENTIAL.match(key)
        if m is None:
            out[key] = value
        elif m["param"] == "_extra_state":
            out.setdefault(f"{m['prefix']}{m['linear']}._extra_state", value)
        else:
            out[f"{m['prefix']}{m['linear']}.{m['param']}{m['expert']}"] = value
    return out


def grouped_to_sequential_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`sequential_to_grouped_state_dict`; a single grouped
    ``weight [E, O, I]``/``bias [E, O]`` is unstacked first. Expert order is kept, so an
    EP rank's local experts stay local (Megatron numbers ``local_experts`` per rank)."""
    out: dict[str, Any] = {}
    for key, value in _unstack(state_dict).items():
        m = _GROUPED.match(key)
        if m is None:
            out[key] = value
        else:
            out[f"{m['prefix']}local_experts.{m['expert']}.{m['linear']}.{m['param']}"] = value
    return out


def _state_dict_of(source: nn.Module | Mapping[str, Any]) -> dict[str, Any]:
    """A module's state dict with its single grouped ``GroupedLinear`` parameters unstacked
    (found by module, so a bare ``GroupedLinear``'s ``weight`` is recognised too), or a given
    state dict unstacked by key and shape."""
    if not isinstance(source, nn.Module):
        return _unstack(source)
    sd = source.state_dict()
    for name, m in source.named_modules():
        if not isinstance(m, GroupedLinear):
            continue
        for param, grouped in (("weight", m.single_grouped_weight),
                               ("bias", m.use_bias and m.single_grouped_bias)):  # fmt: skip
            key = f"{name}.{param}" if name else param
            if grouped and key in sd:
                sd.update((f"{key}{i}", t) for i, t in enumerate(sd.pop(key).unbind(0)))
    return sd


def to_megatron_sequential_state_dict(source: nn.Module | Mapping[str, Any]) -> dict[str, Any]:
    """A te_paged module's (or state dict's) experts in ``SequentialMLP`` layout."""
    return grouped_to_sequential_state_dict(_state_dict_of(source))


def to_megatron_grouped_state_dict(source: nn.Module | Mapping[str, Any]) -> dict[str, Any]:
    """A te_paged module's (or state dict's) experts in Megatron ``TEGroupedMLP`` layout
    (``linear_fcK.weight{i}``; single grouped weights are unstacked)."""
    return _state_dict_of(source)


def load_megatron_expert_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> Any:
    """Load a Megatron expert checkpoint into te_paged ``module``; returns ``load_state_dict``'s
    missing/unexpected keys.

    ``module`` is a te_paged ``TEGroupedMLP`` (or a :class:`GroupedLinear`), or any module that
    contains them, e.g. an ``MoELayer`` built from :func:`get_te_paged_moe_spec`, with the
    state dict's keys relative to it. The dict may hold ``TEGroupedMLP`` keys
    (``linear_fc1.weight{i}``) or ``SequentialMLP`` keys (``local_experts.{i}.linear_fc1.weight``);
    Transformer Engine's ``_extra_state`` of the expert linears (FP8 metadata te_paged does not
    use) is dropped. Single grouped te_paged weights are stacked by ``GroupedLinear`` itself.
    """
    converted = sequential_to_grouped_state_dict(state_dict)
    linears = {name for name, m in module.named_modules() if isinstance(m, GroupedLinear)}
    for name in linears:
        converted.pop(f"{name}._extra_state" if name else "_extra_state", None)
    return module.load_state_dict(converted, strict=strict)
