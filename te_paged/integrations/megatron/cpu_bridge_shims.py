"""CPU stand-ins for Megatron-Bridge's training loop (``megatron.bridge.training``'s
``pretrain()`` and ``finetune()``) — for CPU runs only, on top of :mod:`.cpu_shims` and
:mod:`.cpu_loop_shims`.

Bridge builds on megatron-core and Megatron-LM's ``megatron.training``: the shims of those
cover the calls Bridge makes into them, provided Bridge is imported after them (it binds their
names at import; :func:`~te_paged.integrations.megatron.cpu_shims.install` refuses to run
after Bridge was imported). These are the shims for Bridge's own code. Bridge binds its own
names at import too, so each is applied to its module right after that module runs
(:class:`~.cpu_import_hooks.ImportHooks`), before any other module can bind the name; each
checks that what it replaces is there, and raises naming itself and the release when it is not.
``install(training_loop=True)`` sets them up for the Bridge release the table
(:mod:`~te_paged.integrations.megatron.releases`) lists, when Bridge is installed; nothing
else imports this module.

Each shim, what it replaces and why (file:line of megatron-bridge 0.6.2; docs/megatron-bridge.md
has the same list):

* ``bridge_import_stand_ins`` — ``import transformer_engine.pytorch`` in ``peft/
  lora_layers.py:20`` (imported by ``import megatron.bridge``) and ``from
  nvidia_resiliency_ext.inprocess import CallWrapper`` in ``training/pretrain.py:19``, where
  they cannot load (no TE on a CPU; on Python 3.11 and glibc < 2.39 pip resolves
  nvidia-resiliency-ext to 0.4.1, whose import breaks megatron-core 0.19.2's): those two
  modules get absent-library stand-ins (:class:`~.cpu_import_hooks.AbsentModule`), no one
  else does. A LoRA layer over TE or an in-process restart then raises ``ImportError``.
* ``bridge_initialize_without_cuda`` — ``initialize_megatron`` as ``training/setup.py:253``
  calls it, without ``allow_no_cuda`` ("Megatron requires CUDA", ``initialize.py:91``).
* ``bridge_rng_seeding`` — ``torch.cuda.device_count`` inside ``training/initialize.py``'s
  ``_set_random_seed``: with no device it skips the RNG tracker's seeding
  (``initialize.py:869``) and the first forward raises "model-parallel-rng is not added".
* ``bridge_flex_backend_check`` — ``validate_flex_dispatcher_backend`` as
  ``training/config.py:1515`` calls it: it asks ``torch.cuda.get_device_properties`` which GPU
  the flex backend (HybridEP, NCCL EP) runs on (``flex_dispatcher_backend.py:105``). On CPU
  there is none to check, and te_paged's MoE layer builds its own dispatcher.
* ``bridge_dataloader_generator`` — ``data/samplers.py``'s ``build_pretraining_data_loader``:
  each DataLoader iterator draws its seed from the default CPU generator, which on CPU is the
  dropout's (``cuda_rng``); the validation loader is cyclic (``data/loaders.py:366``), so an
  evaluation draws inside the runner's data read and the step after an evaluation that reran
  would draw other masks than a run that never overflowed: each loader gets a generator of its
  own, seeded from the sampler's seed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from te_paged.integrations.megatron.cpu_import_hooks import ImportHooks

__all__ = ["BRIDGE_SHIMS", "BridgeShim", "install"]


class BridgeShim:
    """One shim: ``patch`` runs on Bridge's ``module`` right after it ran, once the
    ``owners`` (names in it) are checked; ``stand_ins`` maps modules to the libraries their
    imports get stand-ins for."""

    def __init__(
        self,
        module: str | None = None,
        owners: tuple[str, ...] = (),
        patch: Callable[[types.ModuleType], None] | None = None,
        stand_ins: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self.module, self.owners, self.patch = module, owners, patch
        self.stand_ins = dict(stand_ins or {})

    def modules(self) -> tuple[str, ...]:
        return tuple({*self.stand_ins, *((self.module,) if self.module else ())})


def _wrap(module: types.ModuleType, name: str, wrapper: Callable[[Callable], Callable]) -> None:
    original = getattr(module, name)
    setattr(module, name, functools.wraps(original)(wrapper(original)))


def _initialize_without_cuda(setup: types.ModuleType) -> None:
    _wrap(setup, "initialize_megatron", lambda original: lambda *args, **kwargs: original(
        *args, **{**kwargs, "allow_no_cuda": True}))  # fmt: skip


@contextlib.contextmanager
def _one_device() -> Iterator[None]:
    count = torch.cuda.device_count
    torch.cuda.device_count = lambda: 1
    try:
        yield
    finally:
        torch.cuda.device_count = count


def _rng_seeding(initialize: types.ModuleType) -> None:
    def wrapper(original: Callable) -> Callable:
        def set_random_seed(*args: object, **kwargs: object) -> object:
            with _one_device():
                return original(*args, **kwargs)

        return set_random_seed

    _wrap(initialize, "_set_random_seed", wrapper)


def _flex_backend_check(config: types.ModuleType) -> None:
    _wrap(config, "validate_flex_dispatcher_backend", lambda original: lambda model_config: None)


def _dataloader_generator(samplers: types.ModuleType) -> None:
    def wrapper(original: Callable) -> Callable:
        def build(*args: object, **kwargs: object) -> object:
            loader = original(*args, **kwargs)
            if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
                seed = kwargs.get("seed")
                loader.generator = torch.Generator().manual_seed(0 if seed is None else seed)
            return loader

        return build

    _wrap(samplers, "build_pretraining_data_loader", wrapper)


#: Every Bridge shim by name (see the module's list).
BRIDGE_SHIMS: dict[str, BridgeShim] = {
    "bridge_import_stand_ins": BridgeShim(
        stand_ins={
            "megatron.bridge.peft.lora_layers": ("transformer_engine",),
            "megatron.bridge.training.pretrain": ("nvidia_resiliency_ext",),
        }
    ),
    "bridge_initialize_without_cuda": BridgeShim(
        "megatron.bridge.training.setup", ("initialize_megatron",), _initialize_without_cuda
    ),
    "bridge_rng_seeding": BridgeShim(
        "megatron.bridge.training.initialize", ("_set_random_seed",), _rng_seeding
    ),
    "bridge_flex_backend_check": BridgeShim(
        "megatron.bridge.training.config",
        ("validate_flex_dispatcher_backend",),
        _flex_backend_check,
    ),
    "bridge_dataloader_generator": BridgeShim(
        "megatron.bridge.data.samplers",
        ("build_pretraining_data_loader",),
        _dataloader_generator,
    ),
}

_HOOKS = ImportHooks()


def _checked(name: str, shim: BridgeShim, version: str) -> Callable[[types.ModuleType], None]:
    def patch(module: types.ModuleType) -> None:
        for attr in shim.owners:
            if not hasattr(module, attr):
                raise RuntimeError(
                    f"{module.__name__}.{attr} is missing: the CPU shim {name!r} no longer "
                    f"matches megatron-bridge {version}"
                )
        assert shim.patch is not None
        shim.patch(module)

    return patch


def _bridge_root() -> Path | None:
    """Where ``megatron.bridge`` would be imported from (without importing it)."""
    spec = importlib.util.find_spec("megatron.bridge")  # imports `megatron`, a namespace
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def install(names: tuple[str, ...], version: str) -> None:
    """Set up the shims ``names`` for megatron-bridge ``version``, before Bridge is imported.
    ``RuntimeError`` when Bridge was imported already or a module a shim hooks is missing."""
    if "megatron.bridge" in sys.modules:
        raise RuntimeError(
            "megatron.bridge was imported before te_paged's CPU shims were installed: Bridge "
            "binds megatron-core's names and its own at import, so the shims would miss them. "
            "Call te_paged.integrations.megatron.cpu_shims.install(training_loop=True) first, "
            "before importing anything of megatron.bridge"
        )
    root = _bridge_root()
    assert root is not None, "install() is called only where Bridge is installed"
    for name in names:
        shim = BRIDGE_SHIMS[name]
        for module in shim.modules():
            path = root.joinpath(*module.split(".")[2:])
            if not path.with_suffix(".py").is_file() and not (path / "__init__.py").is_file():
                raise RuntimeError(
                    f"{module} is missing: the CPU shim {name!r} no longer matches "
                    f"megatron-bridge {version}"
                )
        for module, libraries in shim.stand_ins.items():
            _HOOKS.stand_ins[module] = (*_HOOKS.stand_ins.get(module, ()), *libraries)
        if shim.module is not None:
            _HOOKS.patches.setdefault(shim.module, []).append(_checked(name, shim, version))
    _HOOKS.install()
