"""CPU stand-ins for Megatron-LM's training loop (``megatron.training``, megatron-core 0.19.2) —
for CPU runs only, on top of :mod:`te_paged.integrations.megatron.cpu_shims`.

``megatron.training.pretrain()`` assumes a GPU in a few more places than megatron-core's
modules do, and a few of its paths without Transformer Engine or Apex (which a CPU never has)
break a resumed run. :func:`te_paged.integrations.megatron.cpu_shims.install` with
``training_loop=True`` applies these, by name, for the releases whose table
(:mod:`~te_paged.integrations.megatron.releases`) lists them; nothing else imports this
module. None of them makes ``torch.cuda.is_available()`` true: te_paged chooses its own device
from it, and ``install`` checks it after. Megatron's own switches are used where one exists
(``--distributed-backend gloo``, ``--transformer-impl local``,
``--no-gradient-accumulation-fusion``, ``--no-persist-layer-norm``; ``--moe-grouped-gemm``
left off, since ``validate_args`` asks the GPU's compute capability for it).

Each shim, what it replaces and why (file:line of megatron-core 0.19.2; docs/megatron.md has
the same list):

* ``typing_override`` — ``typing.override`` on Python < 3.12: ``megatron/training/models/
  gpt.py:5`` imports it (Python 3.12); te_paged's tests run on 3.11, and
  ``typing_extensions.override`` is the same decorator.
* ``initialize_without_cuda`` — ``initialize_megatron`` as ``training.py`` calls it:
  ``pretrain()`` passes no ``allow_no_cuda`` (training.py:1091), whose absence asserts
  "Megatron requires CUDA" (initialize.py:66); the flag is Megatron's own, for CPU runs.
* ``one_device_for_initialization`` — ``torch.cuda.device_count`` and ``set_device`` inside
  ``_initialize_distributed`` and ``_set_random_seed`` only: with no device the first skips
  ``initialize_model_parallel`` (initialize.py:358), the second the RNG tracker's seeding
  (initialize.py:447).
* ``dataset_helpers`` — ``megatron.core.datasets.helpers_cpp`` and ``compile_helpers``: the
  wheel's compiled helpers are for CPython 3.12 only and there is no Makefile to rebuild them
  (rank 0 exits, initialize.py:178); :mod:`.cpu_dataset_helpers` stands in, only when the
  extension does not import.
* ``ddp_wrap_stream`` — ``torch.cuda.Stream`` inside ``dist_utils._ddp_wrap`` and
  ``training.get_model`` (models/dist_utils.py:303, training.py:1876): a placeholder stream.
* ``distributed_optimizer_fresh_state`` — ``DistributedOptimizer.state_dict`` before any step:
  resuming with the distributed optimizer and torch's Adam (no TE, no Apex), it asserts one
  ``step`` over an empty state (distrib_optimizer.py:837); the param groups with step 0 stand
  in (the loaded groups carry the real one).
* ``distributed_optimizer_load`` — ``DistributedOptimizer.load_parameter_state_from_dp_
  reshardable``: it copies into fp32 main params that are views of leaf parameters outside
  ``no_grad`` (distrib_optimizer.py:1225; its siblings are ``no_grad``), and copies the fresh
  template's Adam ``step`` (0) over the loaded one (the step is not saved, :1953): run under
  ``no_grad``, the template's step left out.
* ``distributed_optimizer_own_step`` — ``DistributedOptimizer.load_state_dict``: loading puts
  one ``step`` tensor into every parameter's Adam state (distrib_optimizer.py:1028); Adam
  increments it once per parameter, so a resumed step counts parameters: each gets a copy.
* ``dataloader_generator`` — ``training.build_pretraining_data_loader``: each DataLoader
  iterator draws its seed from the default CPU generator, after the checkpoint's RNG was
  restored; on CPU that generator is the dropout's (``cuda_rng``), so a resumed run would draw
  other masks: each loader gets a generator of its own.
* ``checkpoint_queue_fork`` — ``filesystem_async.get_write_results_queue``: the distributed
  checkpoint's writer starts a multiprocessing manager with ``spawn`` (filesystem_async.py:65),
  safe beside CUDA; without CUDA ``fork`` is, and spares each rank a new interpreter that
  imports torch (the first save: 17 s against 9 s on 2 cores, 4 ranks).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["LOOP_SHIMS", "owners"]


def _wrap(owner: Any, name: str, around: Callable[[], contextlib.AbstractContextManager]) -> None:
    """``owner.name`` runs inside ``around()``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args: object, **kwargs: object) -> object:
        with around():
            return original(*args, **kwargs)

    setattr(owner, name, wrapped)


def _typing_override() -> None:
    import typing

    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override


def _initialize_without_cuda() -> None:
    from megatron.training import initialize
    from megatron.training import training as loop

    original = initialize.initialize_megatron

    @functools.wraps(original)
    def initialize_megatron(*args: object, **kwargs: object) -> object:
        return original(*args, **{**kwargs, "allow_no_cuda": True})

    loop.initialize_megatron = initialize_megatron


@contextlib.contextmanager
def _one_device() -> Iterator[None]:
    count, set_device = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = count, set_device


def _one_device_for_initialization() -> None:
    from megatron.training import initialize

    _wrap(initialize, "_initialize_distributed", _one_device)
    _wrap(initialize, "_set_random_seed", _one_device)


def _dataset_helpers() -> None:
    from megatron.core.datasets import utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401 - the compiled one
    except ImportError:
        from te_paged.integrations.megatron import cpu_dataset_helpers

        name = "megatron.core.datasets.helpers_cpp"
        module = types.ModuleType(name, cpu_dataset_helpers.__doc__)
        for attr in cpu_dataset_helpers.__all__:
            setattr(module, attr, getattr(cpu_dataset_helpers, attr))
        module.__all__ = list(cpu_dataset_helpers.__all__)
        sys.modules[name] = module
        import megatron.core.datasets as datasets

        datasets.helpers_cpp = module
    utils.compile_helpers = lambda: None  # nothing to compile into the installed package


@contextlib.contextmanager
def _placeholder_stream() -> Iterator[None]:
    from te_paged.integrations.megatron.cpu_stream import PlaceholderStream

    stream = torch.cuda.Stream
    torch.cuda.Stream = PlaceholderStream
    try:
        yield
    finally:
        torch.cuda.Stream = stream


def _ddp_wrap_stream() -> None:
    from megatron.training import training as loop
    from megatron.training.models import dist_utils

    _wrap(dist_utils, "_ddp_wrap", _placeholder_stream)
    _wrap(loop, "get_model", _placeholder_stream)


def _distributed_optimizer_fresh_state() -> None:
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    original = dopt.DistributedOptimizer.state_dict

    @functools.wraps(original)
    def state_dict(self):
        if self.optimizer.state or isinstance(self.optimizer, dopt.HybridDeviceOptimizer):
            return original(self)
        inner = self.optimizer.state_dict()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        for group in groups:
            group["step"] = 0  # before any step; the loaded param groups carry the real one
        out: dict[str, Any] = {"optimizer": {"param_groups": groups}}
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    dopt.DistributedOptimizer.state_dict = state_dict


def _distributed_optimizer_load() -> None:
    from megatron.core.optimizer import distrib_optimizer as dopt

    cls = dopt.DistributedOptimizer
    original = cls.load_parameter_state_from_dp_reshardable

    @functools.wraps(original)
    @torch.no_grad()
    def load(self, state_dict):
        if state_dict is not None and not dopt.HAVE_APEX_OR_TE:
            for key, by_dtype in state_dict.items():
                if not isinstance(key, int):
                    continue
                for buckets in by_dtype.values():
                    for bucket in buckets:
                        for entry in bucket:
                            if isinstance(entry, dict) and "step" in entry:
                                entry["step"] = None  # not a tensor: the copy skips it
        return original(self, state_dict)

    cls.load_parameter_state_from_dp_reshardable = load


def _distributed_optimizer_own_step() -> None:
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    cls = dopt.DistributedOptimizer
    original = cls.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].detach().clone()
        return out

    cls.load_state_dict = load_state_dict


def _dataloader_generator() -> None:
    from megatron.training import get_args
    from megatron.training import training as loop

    original = loop.build_pretraining_data_loader

    @functools.wraps(original)
    def build(dataset: object, consumed_samples: int) -> object:
        loader = original(dataset, consumed_samples)
        if isinstance(loader, torch.utils.data.DataLoader) and loader.generator is None:
            loader.generator = torch.Generator().manual_seed(get_args().seed)
        return loader

    loop.build_pretraining_data_loader = build


def _checkpoint_queue_fork() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    original = filesystem_async.get_write_results_queue

    @functools.wraps(original)
    def get_write_results_queue(mp_mode: str = "fork") -> object:
        return original(mp_mode)

    filesystem_async.get_write_results_queue = get_write_results_queue


#: Every training-loop shim by name, in the order :func:`~.cpu_shims.install` applies them
#: (``typing_override`` first: importing ``megatron.training`` needs it).
LOOP_SHIMS: dict[str, Callable[[], None]] = {
    "typing_override": _typing_override,
    "initialize_without_cuda": _initialize_without_cuda,
    "one_device_for_initialization": _one_device_for_initialization,
    "dataset_helpers": _dataset_helpers,
    "ddp_wrap_stream": _ddp_wrap_stream,
    "distributed_optimizer_fresh_state": _distributed_optimizer_fresh_state,
    "distributed_optimizer_load": _distributed_optimizer_load,
    "distributed_optimizer_own_step": _distributed_optimizer_own_step,
    "dataloader_generator": _dataloader_generator,
    "checkpoint_queue_fork": _checkpoint_queue_fork,
}


def owners(name: str) -> list[tuple[Any, str]]:
    """The Megatron attributes shim ``name`` replaces (checked before anything is patched;
    imports ``megatron.training``, so after ``typing_override``)."""
    if name in ("typing_override", "dataset_helpers"):
        return []
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.optimizer import distrib_optimizer as dopt
    from megatron.training import initialize
    from megatron.training import training as loop
    from megatron.training.models import dist_utils

    optimizer = dopt.DistributedOptimizer
    return {
        "initialize_without_cuda": [(loop, "initialize_megatron")],
        "one_device_for_initialization": [
            (initialize, "_initialize_distributed"),
            (initialize, "_set_random_seed"),
        ],
        "ddp_wrap_stream": [(dist_utils, "_ddp_wrap"), (loop, "get_model")],
        "distributed_optimizer_fresh_state": [(optimizer, "state_dict")],
        "distributed_optimizer_load": [(optimizer, "load_parameter_state_from_dp_reshardable")],
        "distributed_optimizer_own_step": [(optimizer, "load_state_dict")],
        "dataloader_generator": [(loop, "build_pretraining_data_loader")],
        "checkpoint_queue_fork": [(filesystem_async, "get_write_results_queue")],
    }[name]
