"""te_paged inside Megatron-core's ``MoELayer``: specs, ``GroupedLinear`` adapters, checkpoints.

Importing this module does not import Megatron; only the spec builders do (with an install
hint when it is missing). Tested against megatron-core 0.16.1 on CPU (see docs/megatron.md).

Three ways in:

* **te_paged's experts** — :func:`get_te_paged_moe_spec` builds Megatron's ``MoELayer`` with
  :class:`MegatronTEGroupedMLP` (te_paged's ``TEGroupedMLP`` reading a Megatron config) as its
  experts; every layer built from one spec shares one :class:`PagedStashManager` when the config
  enables ``moe_paged_stash``.
* **te_paged's linears** — :class:`MegatronGroupedLinear` follows the builder protocol of
  Megatron's own ``TEGroupedMLP`` for ``linear_fc1``/``linear_fc2``;
  :func:`get_te_paged_linear_moe_spec` wires it in. Megatron's activation and recompute are
  used as they are, and nothing is paged (Megatron's expert module opens no stash scope).
* **checkpoints** — :func:`load_megatron_expert_state_dict` loads a Megatron expert state dict
  (``TEGroupedMLP``'s ``linear_fc1.weight{i}`` or ``SequentialMLP``'s
  ``local_experts.{i}.linear_fc1.weight``) into te_paged modules;
  :func:`to_megatron_sequential_state_dict` and :func:`to_megatron_grouped_state_dict` go back;
  both adapters' ``sharded_state_dict`` write Megatron's distributed-checkpoint layout
  (:mod:`te_paged.integrations.megatron_dist_ckpt`).

What the experts receive depends on Megatron's dispatcher (megatron-core 0.16.1):

=====================================  ======================================  =================
dispatcher                             expert input                            stash saves
=====================================  ======================================  =================
``alltoall``/``allgather``, dropless   dynamic ``[sum(tokens), H]``, host      every row (all
(``moe_expert_capacity_factor=None``)  ``tokens_per_expert`` (a D2H sync)      are real)
``alltoall`` + capacity factor,        dynamic ``[kept tokens, H]``, host      every row
no padding                             counts (a D2H sync)
``alltoall``/``flex`` +                static ``[capacity·EP·E_local, H]``,    every row (the
``moe_pad_expert_input_to_capacity``   host counts that *include* the padding  counts say so)
``flex`` + ``hybridep`` + static rank  static ``[max_num_tokens, H]``, device  the real prefix
budget (``moe_expert_rank_capacity_    counts, real tokens a prefix (sync-     only: the saving
factor``, Megatron releases with       free)                                   of DESIGN §1
paged stash)
=====================================  ======================================  =================
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from te_paged.config import MoEConfig
from te_paged.grouped import GroupedLinear
from te_paged.integrations.megatron_dist_ckpt import (
    drop_extra_state_keys,
    expert_sharded_state_dict,
    linear_sharded_state_dict,
)
from te_paged.moe import TEGroupedMLP, as_moe_config
from te_paged.stash import PagedStashManager

__all__ = [
    "MegatronGroupedLinear",
    "MegatronTEGroupedMLP",
    "get_te_paged_experts_spec",
    "get_te_paged_linear_moe_spec",
    "get_te_paged_moe_spec",
    "grouped_to_sequential_state_dict",
    "load_megatron_expert_state_dict",
    "megatron_moe_config",
    "paged_stash_managers",
    "sequential_to_grouped_state_dict",
    "to_megatron_grouped_state_dict",
    "to_megatron_sequential_state_dict",
]

INSTALL_HINT = (
    "pip install --no-deps megatron-core numpy packaging psutil  (keeps your torch as it is)"
)


def _megatron() -> SimpleNamespace:
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


# ------------------------------------------------------------------------------------- config


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


def _compute_device() -> torch.device:
    """Where Megatron computes: the current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _param_device(config: object) -> torch.device:
    """Megatron's rule for new parameters: the CPU with ``use_cpu_initialization``."""
    if getattr(config, "use_cpu_initialization", False):
        return torch.device("cpu")
    return _compute_device()


def _group_size(group: object) -> int:
    return 1 if group is None else int(group.size())


# ------------------------------------------------------------------------ te_paged's experts


class MegatronTEGroupedMLP(TEGroupedMLP):
    """te_paged's :class:`~te_paged.TEGroupedMLP` built by Megatron's ``build_module``.

    Same signature as Megatron's expert modules (``num_local_experts, config, submodules,
    pg_collection``), plus the spec params ``manager`` (the shared :class:`PagedStashManager`),
    ``device`` (default: Megatron's rule, the CPU with ``use_cpu_initialization`` else the
    current device) and ``overrides`` (te_paged-only config fields, see
    :func:`megatron_moe_config`). Parameters are ``linear_fc1.weight{i}``/``linear_fc2.weight{i}``,
    the names of Megatron's ``TEGroupedMLP``; ``sharded_state_dict`` writes Megatron's
    distributed checkpoint layout, interchangeable with ``SequentialMLP``'s and across EP sizes.
    Expert tensor parallelism is rejected.
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
        overrides: Mapping[str, object] | None = None,
    ) -> None:
        # TEGroupedMLP itself rejects an expert tensor-parallel group.
        cfg = megatron_moe_config(config, **dict(overrides or {}))
        if cfg.moe_paged_stash and manager is None:
            manager = PagedStashManager.from_config(cfg, device or _compute_device())
        super().__init__(
            num_local_experts,
            cfg,
            submodules,
            pg_collection,
            name,
            manager=manager,
            device=device if device is not None else _param_device(config),
        )
        self.pg_collection = pg_collection
        drop_extra_state_keys(self)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """Megatron's distributed checkpoint of these experts, with the keys and sharding of
        Megatron's ``SequentialMLP``/``TEGroupedMLP``: see
        :mod:`te_paged.integrations.megatron_dist_ckpt`."""
        return expert_sharded_state_dict(
            self, prefix, sharded_offsets, metadata, self.pg_collection
        )


def get_te_paged_experts_spec(
    config: object,
    *,
    manager: PagedStashManager | None = None,
    device: torch.device | str | None = None,
    **overrides: object,
) -> Any:
    """``ModuleSpec`` of :class:`MegatronTEGroupedMLP`, for ``MoESubmodules(experts=...)``.

    With ``moe_paged_stash`` (on ``config`` or in ``overrides``) and no ``manager``, one
    :class:`PagedStashManager` is made here, on ``device`` (default: the current device), and
    shared by every layer built from this spec. ``device`` also places the experts' parameters
    (default: Megatron's rule, see :class:`MegatronTEGroupedMLP`). The config is validated now,
    not at the first build.
    """
    mc = _megatron()
    cfg = megatron_moe_config(config, **overrides)
    if cfg.moe_paged_stash and manager is None:
        manager = PagedStashManager.from_config(cfg, device or _compute_device())
    params = {"manager": manager, "device": device, "overrides": dict(overrides)}
    return mc.ModuleSpec(module=MegatronTEGroupedMLP, params=params)


def get_te_paged_moe_spec(
    config: object,
    *,
    manager: PagedStashManager | None = None,
    device: torch.device | str | None = None,
    shared_experts: object = None,
    **overrides: object,
) -> Any:
    """``ModuleSpec(MoELayer, MoESubmodules(experts=<te_paged experts>))``.

    Use it where a Megatron layer spec asks for the MoE module (``mlp=...``), or build one
    layer with ``build_module(spec, config=config)``. ``shared_experts`` is passed to
    ``MoESubmodules`` as is. See :func:`get_te_paged_experts_spec` for the other arguments.
    """
    mc = _megatron()
    experts = get_te_paged_experts_spec(config, manager=manager, device=device, **overrides)
    submodules = mc.MoESubmodules(experts=experts, shared_experts=shared_experts)
    return mc.ModuleSpec(
        module=mc.MoELayer, submodules=submodules, metainfo={"fuse_pre_mlp_layernorm": False}
    )


def paged_stash_managers(model: nn.Module) -> list[PagedStashManager]:
    """The distinct paged-stash managers of the te_paged experts in ``model`` (call ``reset()``
    on each at every step boundary)."""
    found: dict[int, PagedStashManager] = {}
    for module in model.modules():
        manager = getattr(module, "manager", None)
        if isinstance(module, TEGroupedMLP) and manager is not None:
            found.setdefault(id(manager), manager)
    return list(found.values())


# ------------------------------------------------------------------------- te_paged's linears


def _no_init(weight: torch.Tensor) -> None:
    """``perform_initialization=False``: leave the weights as allocated (a checkpoint loads)."""


class MegatronGroupedLinear(GroupedLinear):
    """te_paged's :class:`~te_paged.GroupedLinear` as ``linear_fc1``/``linear_fc2`` of
    Megatron's own ``TEGroupedMLP``.

    Constructor: Megatron's grouped-linear builder protocol, ``(num_gemms, input_size,
    output_size, *, config, init_method, bias, skip_bias_add, is_expert, tp_comm_buffer_name,
    pg_collection, name=None)``. ``forward(x, tokens_per_expert) -> (out, bias)``: Megatron
    passes the host counts as a list (it calls ``.tolist()`` first); they are copied to ``x``'s
    device (host→device, no sync) for the device-initiated path. With ``skip_bias_add`` the bias
    is returned as ``[E, out]`` (Megatron zips it per expert), else added and ``None`` returned.
    Parameters are ``weight{i}``/``bias{i}``, as in Transformer Engine. FP8 here would need
    TE's autocast, so ``config.fp8`` is rejected: use te_paged's experts for FP8.
    """

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        config: object,
        init_method: Callable[[torch.Tensor], object] | None,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None = None,
        pg_collection: object = None,
        name: str | None = None,
    ) -> None:
        if not is_expert:
            raise ValueError("MegatronGroupedLinear serves expert layers only (is_expert=True)")
        etp = _group_size(getattr(pg_collection, "expt_tp", None))
        if etp > 1:
            raise ValueError(
                f"the expert tensor-parallel group has {etp} ranks: MegatronGroupedLinear is not "
                "tensor-parallel; set expert_tensor_parallel_size=1"
            )
        for flag in ("fp8", "fp4"):
            if getattr(config, flag, None):
                raise ValueError(
                    f"{flag}={getattr(config, flag)!r}: MegatronGroupedLinear computes in high "
                    "precision; use te_paged's experts (get_te_paged_moe_spec) for FP8 storage"
                )
        if not getattr(config, "perform_initialization", True):
            init_method = _no_init
        super().__init__(
            num_gemms,
            input_size,
            output_size,
            bias=bias,
            return_bias=skip_bias_add and bias,
            params_dtype=getattr(config, "params_dtype", None),
            device=_param_device(config),
            init_method=init_method,
            use_grouped_tensor=getattr(config, "moe_use_grouped_tensor", True),
        )
        self.skip_bias_add = skip_bias_add
        self.tp_comm_buffer_name, self.name = tp_comm_buffer_name, name
        self.pg_collection = pg_collection
        drop_extra_state_keys(self, ("",))

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, tokens_per_expert: torch.Tensor | list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not isinstance(tokens_per_expert, torch.Tensor):
            tokens_per_expert = torch.tensor(list(tokens_per_expert), dtype=torch.int64)
        splits_E = tokens_per_expert.to(x.device, torch.int64, non_blocking=True)
        out = super().forward(x, splits_E)
        return out if self.return_bias else (out, None)

    def backward_dw(self) -> None:
        """Megatron's delayed weight-gradient hook: te_paged computes them in backward."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """What Transformer Engine's grouped linear gives Megatron's ``TEGroupedMLP``: one
        sharded weight per local expert under ``{prefix}weight`` with the global expert axis
        prepended (the module adds the swiglu split and its ``experts.`` prefix)."""
        return linear_sharded_state_dict(
            self,
            prefix,
            "",
            prefix,
            tp_axis=1 if self.tp_comm_buffer_name == "fc2" else 0,
            swiglu=False,
            sharded_offsets=sharded_offsets,
            metadata=metadata,
            pg_collection=self.pg_collection,
        )


def get_te_paged_linear_moe_spec(shared_experts: object = None) -> Any:
    """``MoELayer`` spec with Megatron's own ``TEGroupedMLP`` whose ``linear_fc1``/``linear_fc2``
    are :class:`MegatronGroupedLinear` (no Transformer Engine needed)."""
    mc = _megatron()
    linears = mc.MLPSubmodules(linear_fc1=MegatronGroupedLinear, linear_fc2=MegatronGroupedLinear)
    experts = mc.ModuleSpec(module=mc.McoreTEGroupedMLP, submodules=linears)
    submodules = mc.MoESubmodules(experts=experts, shared_experts=shared_experts)
    return mc.ModuleSpec(
        module=mc.MoELayer, submodules=submodules, metainfo={"fuse_pre_mlp_layernorm": False}
    )


# ----------------------------------------------------------------------------- checkpoints

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
