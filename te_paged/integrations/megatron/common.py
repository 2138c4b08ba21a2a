"""What every part of the Megatron integration shares: the lazy import of Megatron-core, reading
a Megatron config into te_paged's :class:`~te_paged.config.MoEConfig`, and Megatron's device
rules. Importing this module does not import Megatron."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import SimpleNamespace

import torch

from te_paged.config import MoEConfig
from te_paged.moe import as_moe_config

__all__ = [
    "INSTALL_HINT",
    "compute_device",
    "group_size",
    "import_megatron",
    "megatron_moe_config",
    "param_device",
]

INSTALL_HINT = (
    "pip install --no-deps megatron-core numpy packaging psutil  (keeps your torch as it is)"
)


def import_megatron() -> SimpleNamespace:
    """The Megatron-core classes the spec builders need, imported on first use."""
    try:
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import TEGroupedMLP as McoreTEGroupedMLP
        from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
        from megatron.core.transformer.spec_utils import ModuleSpec
    except ImportError as e:
        raise ImportError(
            f"te_paged.integrations.megatron needs megatron-core ({e}); install it with "
            f"`{INSTALL_HINT}`"
        ) from e
    return SimpleNamespace(
        MLPSubmodules=MLPSubmodules,
        McoreTEGroupedMLP=McoreTEGroupedMLP,
        MoELayer=MoELayer,
        MoESubmodules=MoESubmodules,
        ModuleSpec=ModuleSpec,
    )


class _MegatronConfigView:
    """A Megatron config plus te_paged-only overrides (fields the release does not have)."""

    def __init__(self, config: object, overrides: Mapping[str, object]) -> None:
        self._config, self._overrides = config, overrides

    def __getattr__(self, name: str) -> object:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._config, name)


def megatron_moe_config(config: object, **overrides: object) -> MoEConfig:
    """te_paged's :class:`MoEConfig` for a Megatron ``TransformerConfig``.

    ``overrides`` set :class:`MoEConfig` fields that the installed Megatron release does not
    have (megatron-core 0.16.1 has no ``moe_paged_stash``, ``moe_expert_rank_capacity_factor``,
    ``moe_paged_stash_*`` or ``moe_use_grouped_tensor``); a Megatron config that has them is
    read directly.
    """
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown te_paged config overrides {unknown}; allowed: {sorted(fields)}")
    if isinstance(config, MoEConfig):
        return dataclasses.replace(config, **overrides)
    _check_megatron_config(config)
    return as_moe_config(_MegatronConfigView(config, overrides))


def _check_megatron_config(config: object) -> None:
    etp = getattr(config, "expert_tensor_parallel_size", None) or 1
    if etp > 1:
        raise ValueError(
            f"expert_tensor_parallel_size={etp}: te_paged's experts are not tensor-parallel; "
            "set expert_tensor_parallel_size=1 (expert parallelism is supported)"
        )
    if getattr(config, "moe_latent_size", None) is not None:
        raise ValueError(
            f"moe_latent_size={config.moe_latent_size} is not supported by te_paged's experts; "
            "set moe_latent_size=None"
        )
    if getattr(config, "fp4", None):
        raise ValueError(f"fp4={config.fp4!r} is not supported by te_paged's experts; use fp8")


def compute_device() -> torch.device:
    """Where Megatron computes: the current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def param_device(config: object) -> torch.device:
    """Megatron's rule for new parameters: the CPU with ``use_cpu_initialization``."""
    if getattr(config, "use_cpu_initialization", False):
        return torch.device("cpu")
    return compute_device()


def group_size(group: object) -> int:
    return 1 if group is None else int(group.size())
