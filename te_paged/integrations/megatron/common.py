"""What every part of the Megatron integration shares: the lazy import of Megatron-core, reading
a Megatron config into te_paged's :class:`~te_paged.config.MoEConfig`, and Megatron's device
rules. Importing this module does not import Megatron."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import SimpleNamespace

import torch

from te_paged.config import MoEConfig
from te_paged.integrations.megatron.releases import SUPPORTED, install_line
from te_paged.moe import as_moe_config

__all__ = [
    "INSTALL_HINT",
    "PAGED_STASH_FIELDS",
    "compute_device",
    "group_size",
    "import_megatron",
    "megatron_moe_config",
    "param_device",
    "split_paged_stash_fields",
]

INSTALL_HINT = (
    f"{install_line()}  (keeps your torch as it is; te_paged supports megatron-core "
    f"{' and '.join(SUPPORTED)})"
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

    A field the Megatron config has is read from it: on megatron-core 0.19.2 that includes
    ``moe_paged_stash``, ``moe_paged_stash_page_size``, ``moe_paged_stash_buffer_size_factor_
    cuda``/``_cpu`` and ``moe_expert_rank_capacity_factor``. ``overrides`` set the
    :class:`MoEConfig` fields the config has not (0.16.1 has none of those, no release has
    ``moe_paged_stash_kernel_backend``); a paged-stash field, or
    ``use_transformer_engine_op_fuser``, may also be set while the config leaves it at
    Megatron's default (that is how a 0.16.1-style script runs on 0.19.2). Any other override
    that differs from the config's value is a ``ValueError``: one field with two values, which
    Megatron's modules (the router, say) and te_paged's would each follow one of.
    """
    fields = {f.name for f in dataclasses.fields(MoEConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown te_paged config overrides {unknown}; allowed: {sorted(fields)}")
    if isinstance(config, MoEConfig):
        return dataclasses.replace(config, **overrides)
    _check_megatron_config(config)
    _check_overrides(config, overrides)
    return as_moe_config(_MegatronConfigView(config, overrides))


def _megatron_default(config: object, name: str) -> object:
    """The default of dataclass field ``name`` of ``config``'s class (a sentinel if none)."""
    for f in dataclasses.fields(config) if dataclasses.is_dataclass(config) else ():
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return _NO_DEFAULT


_NO_DEFAULT = object()


def _check_overrides(config: object, overrides: Mapping[str, object]) -> None:
    contradictions = []
    for name, value in overrides.items():
        if not hasattr(config, name):
            continue
        set_on_config = getattr(config, name)
        if set_on_config == value:
            continue
        # Only te_paged's experts and dispatcher read these (Megatron's hooks stay inert), so
        # a field the user left at Megatron's default may be given as an override.
        if name in _OVERRIDABLE and set_on_config == _megatron_default(config, name):
            continue
        contradictions.append(f"{name}: the config says {set_on_config!r}, the override {value!r}")
    if contradictions:
        raise ValueError(
            "te_paged's keyword overrides contradict the Megatron config ("
            + "; ".join(contradictions)
            + "): Megatron's modules read the config and te_paged's the override. Set each "
            "field in one place — on the TransformerConfig where it has the field"
        )


#: te_paged's paged-stash fields that megatron-core 0.19.2's ``TransformerConfig`` has too.
PAGED_STASH_FIELDS = (
    "moe_expert_rank_capacity_factor",
    "moe_paged_stash",
    "moe_paged_stash_page_size",
    "moe_paged_stash_buffer_size_factor_cuda",
    "moe_paged_stash_buffer_size_factor_cpu",
)


_OVERRIDABLE = (*PAGED_STASH_FIELDS, "use_transformer_engine_op_fuser")


def split_paged_stash_fields(
    flex_backend: str = "ncclep", **fields: object
) -> tuple[dict[str, object], dict[str, object]]:
    """``(TransformerConfig kwargs, spec overrides)`` for te_paged's ``fields`` on the installed
    megatron-core: the fields its config has go on the config, where its users set them (with
    what 0.19.2's ``TransformerConfig`` requires beside a rank capacity factor: the ``"flex"``
    dispatcher with a backend, ``flex_backend``: ``"ncclep"``, which te_paged's layer replaces
    and never builds, or ``"hybridep"``, which it keeps where ``deep_ep`` imports, with the
    ``use_transformer_engine_op_fuser`` 0.19.2 asks for beside it); the rest are overrides.
    """
    from te_paged.integrations.megatron.releases import installed_release

    if not installed_release().config_has_paged_stash_fields:
        return {}, dict(fields)
    native = {k: v for k, v in fields.items() if k in PAGED_STASH_FIELDS}
    overrides = {k: v for k, v in fields.items() if k not in PAGED_STASH_FIELDS}
    if native.get("moe_expert_rank_capacity_factor") is not None:
        native.update(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=flex_backend)
        if flex_backend == "hybridep":  # 0.19.2 asks for the op fuser beside HybridEP's budget
            native["use_transformer_engine_op_fuser"] = True
    return native, overrides


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
