"""What differs between the megatron-core releases te_paged supports: one table, read here.

Every other module of the integration asks :func:`installed_release` for a
:class:`MegatronRelease` and reads its fields; nothing else compares version strings.

=========================================  ======================  ======================
                                           0.16.1                  0.19.2
=========================================  ======================  ======================
``TransformerConfig`` has ``moe_paged_     no: te_paged's keyword  yes: read from the
stash*`` and ``moe_expert_rank_capacity_   overrides supply them   user's config (the
factor``                                                           overrides still may)
Megatron's own paged stash                 none                    ``transformer/moe/
                                                                   paged_stash.py``: a
                                                                   global manager, hooks
                                                                   in ``GPTModel.forward``
                                                                   and the schedules
``MoELayer`` builds a flex dispatcher      ``moe_token_            with ``moe_expert_rank_
te_paged must not construct                dispatcher_type=        capacity_factor``:
                                           "flex"`` (DeepEP)       ``"flex"`` (HybridEP,
                                                                   NCCL EP)
CPU shims (:mod:`.cpu_shims`)              the 0.16.1 set          the same, plus the
                                                                   global stash manager's
                                                                   CUDA stream, DDP's
                                                                   ``current_stream()``,
                                                                   ``HybridStack``'s TE
                                                                   final norm
CPU shims for Megatron-LM's training loop  none (not supported)    :mod:`.cpu_loop_shims`
(``pretrain()``)
``HybridModel``                            none (``MambaModel``)   ``models/hybrid``
Imports without declaring it               nothing                 ``triton`` (its paged
                                                                   stash kernels, imported
                                                                   by the schedules): a
                                                                   CUDA torch brings it, a
                                                                   CPU torch does not
=========================================  ======================  ======================

Importing this module does not import Megatron.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path

__all__ = [
    "BRIDGE_RELEASES",
    "RELEASES",
    "SUPPORTED",
    "BridgeRelease",
    "MegatronRelease",
    "install_line",
    "installed_bridge_release",
    "installed_release",
    "installed_version",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronRelease:
    """One supported megatron-core release and what te_paged does differently for it."""

    version: str
    #: ``TransformerConfig`` has ``moe_paged_stash``, ``moe_paged_stash_page_size``,
    #: ``moe_paged_stash_buffer_size_factor_cuda``/``_cpu`` and
    #: ``moe_expert_rank_capacity_factor``, so te_paged reads them from the user's config.
    config_has_paged_stash_fields: bool
    #: ``megatron.core.transformer.moe.paged_stash`` exists: a process-global stash manager
    #: whose hooks run whenever ``config.moe_paged_stash`` is set (te_paged keeps them inert).
    builtin_paged_stash: bool
    #: ``megatron.core.models.hybrid.HybridModel`` exists (0.16.1 has the older
    #: ``MambaModel`` only).
    hybrid_model: bool = False
    #: The CPU shims :func:`~te_paged.integrations.megatron.cpu_shims.install` applies, by
    #: name (see that module's table).
    cpu_shims: tuple[str, ...]
    #: The CPU shims ``install(training_loop=True)`` adds for Megatron-LM's training loop
    #: (:mod:`~te_paged.integrations.megatron.cpu_loop_shims`); empty: not supported on CPU.
    cpu_loop_shims: tuple[str, ...] = ()
    #: Python the release's wheel declares (``Requires-Python``); on an older interpreter its
    #: Python files still run (tests only, see docs/megatron.md).
    requires_python: str
    #: Packages the release imports whenever te_paged uses it but does not declare: the
    #: install line names them, since ``--no-deps`` (which keeps pip away from torch) would
    #: leave them out.
    undeclared_imports: tuple[str, ...] = ()


_CPU_SHIMS_0_16 = (
    "current_device",
    "synchronize",
    "cuda_factories",
    "checkpoint_backward_in_mode",
    "cuda_rng",
    "te_general_gemm",
    "alltoall_dtoh",
    "checkpoint_without_output_fp8",
    "no_compile",
)

RELEASES: dict[str, MegatronRelease] = {
    r.version: r
    for r in (
        MegatronRelease(
            version="0.16.1",
            config_has_paged_stash_fields=False,
            builtin_paged_stash=False,
            cpu_shims=_CPU_SHIMS_0_16,
            requires_python=">=3.10",
        ),
        MegatronRelease(
            version="0.19.2",
            config_has_paged_stash_fields=True,
            builtin_paged_stash=True,
            hybrid_model=True,
            cpu_shims=(
                *_CPU_SHIMS_0_16,
                "builtin_stash_manager",
                "current_stream",
                "hybrid_final_norm",
            ),
            cpu_loop_shims=(
                "typing_override",
                "initialize_without_cuda",
                "one_device_for_initialization",
                "dataset_helpers",
                "ddp_wrap_stream",
                "distributed_optimizer_fresh_state",
                "distributed_optimizer_load",
                "distributed_optimizer_own_step",
                "dataloader_generator",
                "checkpoint_queue_fork",
            ),
            requires_python=">=3.12",
            undeclared_imports=("triton",),
        ),
    )
}
#: The supported releases, oldest first.
SUPPORTED: tuple[str, ...] = tuple(RELEASES)


def install_line(version: str = SUPPORTED[-1]) -> str:
    """The pip line that installs ``version`` next to the user's torch: the release without
    its declared dependencies (one of them is torch), then those it needs."""
    needs = ("numpy", "packaging", "psutil", *RELEASES[version].undeclared_imports)
    return f"pip install --no-deps megatron-core=={version} {' '.join(needs)}"


def installed_version() -> str:
    """The installed megatron-core's release, ``major.minor.patch`` (0.19.2 appends the git
    hash of the folder it is installed in to ``__version__``; the release is the first three
    parts). ``RuntimeError`` with the install line when Megatron is missing."""
    try:
        info = _package_info()
    except ImportError as e:
        raise RuntimeError(
            f"megatron-core is not importable ({e}); install a supported release "
            f"({', '.join(SUPPORTED)}) with `{install_line()}` (keeps your torch as it is)"
        ) from e
    return ".".join(str(part) for part in info.VERSION[:3])


def _package_info():
    """megatron-core's ``package_info`` module: the one imported, else its file run on its own.
    Importing it as ``megatron.core.package_info`` runs ``megatron/core/__init__.py`` first,
    6 s of CPU on a 2-core machine, which a version check does not need (``te-paged ab``'s
    parent process checks the release; only its ranks build Megatron models)."""
    loaded = sys.modules.get("megatron.core.package_info")
    if loaded is not None:
        return loaded
    spec = importlib.util.find_spec("megatron.core")  # imports `megatron`, a namespace package
    if spec is None:
        raise ImportError("No module named 'megatron.core'")
    for folder in spec.submodule_search_locations or ():
        path = Path(folder) / "package_info.py"
        if path.is_file():
            file_spec = importlib.util.spec_from_file_location("_megatron_package_info", path)
            module = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(module)
            return module
    return importlib.import_module("megatron.core.package_info")


def installed_release() -> MegatronRelease:
    """The :class:`MegatronRelease` of the installed megatron-core; ``RuntimeError`` naming
    the supported releases when it is another one."""
    version = installed_version()
    release = RELEASES.get(version)
    if release is None:
        raise RuntimeError(
            f"megatron-core {version} is installed; te_paged supports megatron-core "
            f"{' and '.join(SUPPORTED)}: install one with `{install_line()}`"
        )
    return release


@dataclasses.dataclass(frozen=True, kw_only=True)
class BridgeRelease:
    """One supported Megatron-Bridge release (``megatron-bridge``: NeMo's training stack, the
    Megatron backend of NeMo-RL, VeRL, Slime, SkyRL) and what te_paged does for it."""

    version: str
    #: The megatron-core release it runs on (its ``pretrain()`` and ``finetune()`` call
    #: megatron-core's and ``megatron.training``'s code: their shims apply too).
    megatron_core: str
    #: The CPU shims ``cpu_shims.install(training_loop=True)`` adds for Bridge's own code, by
    #: name (:mod:`~te_paged.integrations.megatron.cpu_bridge_shims`).
    cpu_shims: tuple[str, ...]


BRIDGE_RELEASES: dict[str, BridgeRelease] = {
    r.version: r
    for r in (
        BridgeRelease(
            version="0.6.2",
            megatron_core="0.19.2",
            cpu_shims=(
                "bridge_import_stand_ins",
                "bridge_initialize_without_cuda",
                "bridge_rng_seeding",
                "bridge_flex_backend_check",
                "bridge_dataloader_generator",
            ),
        ),
    )
}


def installed_bridge_release() -> BridgeRelease | None:
    """The :class:`BridgeRelease` of the installed Megatron-Bridge, ``None`` where Bridge is not
    installed (without importing it: its ``package_info`` file is run on its own);
    ``RuntimeError`` naming the supported releases when it is another one, or when it does not
    run on the installed megatron-core."""
    spec = importlib.util.find_spec("megatron.bridge")  # imports `megatron`, a namespace package
    if spec is None:
        return None
    info = None
    for folder in spec.submodule_search_locations or ():
        path = Path(folder) / "package_info.py"
        if path.is_file():
            file_spec = importlib.util.spec_from_file_location("_bridge_package_info", path)
            info = importlib.util.module_from_spec(file_spec)
            file_spec.loader.exec_module(info)
            break
    # __shortversion__: __version__ appends the git hash of the folder it is installed in.
    version = getattr(info, "__shortversion__", "unknown")
    release = BRIDGE_RELEASES.get(version)
    if release is None:
        raise RuntimeError(
            f"megatron-bridge {version} is installed; te_paged supports megatron-bridge "
            f"{' and '.join(BRIDGE_RELEASES)}: install it with `pip install --no-deps "
            f"megatron-bridge=={next(reversed(BRIDGE_RELEASES))}` (docs/megatron-bridge.md)"
        )
    core = installed_version()
    if core != release.megatron_core:
        raise RuntimeError(
            f"megatron-bridge {version} runs on megatron-core {release.megatron_core}; "
            f"{core} is installed: install it with `{install_line(release.megatron_core)}`"
        )
    return release
