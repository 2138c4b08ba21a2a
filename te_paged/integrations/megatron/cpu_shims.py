"""CPU stand-ins for the CUDA-only calls of megatron-core 0.16.1 and 0.19.2 — for CPU runs only.

megatron-core calls CUDA in places even when every tensor is on the CPU. This module is the one
place that replaces those calls, so that Megatron's ``MoELayer``, ``GPTModel``, DDP, optimizer
and ``forward_backward_func`` run on CPU ranks (gloo). Nothing installs it implicitly: importing
te_paged never does, and :func:`install` refuses to run when CUDA is available. Only the CPU
paths call it — te_paged's tests and ``te-paged ab --engine megatron --device cpu`` — and a
user who wants to try the integration on a CPU machine can call it first, as
docs/megatron.md's example does.

Each shim has a name and replaces a named function or attribute; the release table
(:mod:`te_paged.integrations.megatron.releases`) says which shims a release gets, and
:func:`install` checks that every attribute a shim replaces exists in the installed release
before it patches anything, so a release whose code moved raises instead of being patched
silently. Every shim, with what it replaces (the same list is in docs/megatron.md):

===============================================  ===============================================
Megatron calls (shim name; releases)             on CPU it gets
===============================================  ===============================================
``torch.cuda.current_device()`` (router weight,  ``torch.device("cpu")``
all-to-all outputs, DDP, embeddings)
(``current_device``; both)
``torch.cuda.synchronize()`` (checkpoint         a no-op (everything is on the host already)
writer, DDP buffer moves) (``synchronize``;
both)
factories with ``device="cuda"`` (schedules'     the CPU: a ``TorchFunctionMode`` rewrites the
``total_num_tokens``, DDP's grad buffers,        ``device`` argument of factory calls that name
the optimizer's flags, ``get_grad_norm_fp32``,   CUDA, and ``Tensor.cuda()`` returns the tensor
``count_zeros_fp32``, 0.19.2's                   (``Tensor.type()`` names a CPU tensor by its
``check_paged_stash_overflow``);                 CUDA name)
``param.grad.type() == 'torch.cuda.Float
Tensor'`` (``clip_grad_by_total_norm_fp32``)
(``cuda_factories``; both)
``CheckpointFunction.backward`` (full and        the same, run inside the mode: autograd's
``moe`` recompute: the forward runs again in     backward does not carry torch function modes,
backward, e.g. ``get_default_causal_mask``)      so the recomputed forward would escape it
(``checkpoint_backward_in_mode``; both)
the CUDA generator (``torch.cuda.get_rng_        the CPU generator: ``torch.cuda.get_rng_state``
state``/``manual_seed``, ``random._get_cuda_     / ``manual_seed`` and Megatron's ``_get_cuda_
rng_state``/``_set_cuda_rng_state``: the RNG     rng_state``/``_set_cuda_rng_state`` read and
tracker, ``CheckpointWithoutOutput``)            write ``torch.get_rng_state()``, so the tracker
(``cuda_rng``; both)                             forks and restores CPU streams as it would CUDA
                                                 ones (its "CPU RNG state changed within GPU RNG
                                                 context" warning is then expected and silenced)
``moe_utils.te_general_gemm`` (a Transformer     ``None``: the router takes Megatron's own
Engine name left undefined without TE)           ``torch.mm`` branch
(``te_general_gemm``; both)
``MoEAlltoAllTokenDispatcher``'s CUDA stream and a sentinel stream, and a ``_maybe_dtoh_and_
``_maybe_dtoh_and_synchronize`` (numpy split     synchronize`` that keeps the host tensors and
sizes, CUDA events) (``alltoall_dtoh``; both)    turns the EP split sizes into the lists gloo
                                                 accepts
``CheckpointWithoutOutput.__init__``             ``self.fp8 = bool(fp8)`` (both releases write
(``checkpoint_without_output_fp8``; both)        ``fp8 is not None``, taking TE's undefined FP8
                                                 branch for the default ``fp8=False``)
``jit_fuser = torch.compile`` on the fused       ``torch._dynamo.config.disable = True``: they
activations (inductor: ~30 s per process)        run eagerly
(``no_compile``; both)
``paged_stash.PagedStashManager.get_instance``   the global manager made once, at install, with
(0.19.2's built-in stash: its constructor        a placeholder stream that nothing uses (te_paged
makes a ``torch.cuda.Stream()``; the             keeps that manager empty: see docs/megatron.md)
schedules and ``GPTModel.forward`` call it
when ``config.moe_paged_stash``)
(``builtin_stash_manager``; 0.19.2)
``torch.cuda.current_stream()`` (DDP's           a placeholder stream whose waits are no-ops
``start_grad_sync`` waits on CUDA-graph          (on the host every op has finished when it
events) (``current_stream``; 0.19.2)             returns)
``hybrid_block.TENorm`` (``HybridStack``'s final  Megatron's ``WrappedTorchNorm`` (the same
norm, Transformer Engine's whatever the spec      arguments, torch's LayerNorm or RMSNorm as
says; without TE) (``hybrid_final_norm``;         the config says)
0.19.2)
===============================================  ===============================================

``install(training_loop=True)`` adds the stand-ins Megatron-LM's training loop
(``megatron.training.pretrain()``) needs on CPU, 0.19.2 only: see
:mod:`te_paged.integrations.megatron.cpu_loop_shims`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from te_paged.integrations.megatron.cpu_stream import PlaceholderStream
from te_paged.integrations.megatron.releases import (
    RELEASES,
    SUPPORTED,
    install_line,
    installed_bridge_release,
    installed_release,
)

__all__ = ["INSTALL_HINT", "SHIMS", "install", "installed", "installed_shims"]

INSTALL_HINT = (
    f"te_paged's CPU runs of Megatron need megatron-core {' or '.join(SUPPORTED)}; install it "
    f"next to the pinned CPU torch with `{install_line()}` (scripts/test.sh installs both)"
)

_state: dict[str, Any] = {"installed": False, "loop": False, "mode": None, "shims": ()}


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return bool(_state["installed"])


def installed_shims() -> tuple[str, ...]:
    """The names of the shims :func:`install` applied (empty before it ran)."""
    return tuple(_state["shims"])


def _names_cuda(device: object) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaAllocationsOnCpu(TorchFunctionMode):
    """Factories asked for ``device="cuda"`` allocate on the CPU; ``Tensor.cuda()`` is the
    identity; ``Tensor.type()`` answers with the CUDA name Megatron asserts on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _names_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        return func(*args, **kwargs)


def _host_dtoh_and_synchronize(self, point: str, tokens_per_expert=None):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` without CUDA streams.

    The original copies the split sizes to the host on a side stream at ``cuda_dtoh_point``
    (as numpy arrays) and waits on an event at ``cuda_sync_point``. On CPU everything is on the
    host already; only the EP split sizes change type, to the lists gloo accepts.
    """
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.tolist())
    return tokens_per_expert


def _checkpoint_without_output_init(self, fp8=False) -> None:
    # 0.16.1 writes `self.fp8 = fp8 is not None`, so the default fp8=False takes the TE branch.
    self.fp8 = bool(fp8)
    self.run_function = None
    self.fwd_cpu_rng_state = None
    self.fwd_cuda_rng_state = None
    self.fwd_cuda_rng_state_tracker = None
    self.ctx = None
    self.outputs = None


def _cpu_rng_state(*args: object, **kwargs: object) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, *args: object, **kwargs: object) -> None:
    torch.set_rng_state(new_state)


def _patch_current_device(mode: TorchFunctionMode) -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")


def _patch_synchronize(mode: TorchFunctionMode) -> None:
    torch.cuda.synchronize = lambda *args, **kwargs: None


def _patch_cuda_factories(mode: TorchFunctionMode) -> None:
    mode.__enter__()  # for the rest of the process, like torch.set_default_device


def _patch_checkpoint_backward(mode: TorchFunctionMode) -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    recompute = mcore_random.CheckpointFunction.backward

    def backward_in_mode(ctx, *grads):
        with mode:
            return recompute(ctx, *grads)

    mcore_random.CheckpointFunction.backward = staticmethod(backward_in_mode)


def _patch_cuda_rng(mode: TorchFunctionMode) -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    # The tracker's fork compares the CPU state before and after: with the CPU generator
    # standing in for the CUDA one it always changes, and every fork would log a warning.
    logging.getLogger(mcore_random.__name__).setLevel(logging.ERROR)


def _patch_te_general_gemm(mode: TorchFunctionMode) -> None:
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = None


def _patch_alltoall_dtoh(mode: TorchFunctionMode) -> None:
    from megatron.core.transformer.moe import token_dispatcher

    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    dispatcher.cuda_dtoh_stream = object()  # non-None: the constructor then creates no stream
    dispatcher._maybe_dtoh_and_synchronize = _host_dtoh_and_synchronize


def _patch_checkpoint_without_output(mode: TorchFunctionMode) -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.CheckpointWithoutOutput.__init__ = _checkpoint_without_output_init


def _patch_no_compile(mode: TorchFunctionMode) -> None:
    from torch import _dynamo

    _dynamo.config.disable = True  # read per frame, so it holds for compiled-at-import fns


_PlaceholderStream = PlaceholderStream
_HOST_STREAM = _PlaceholderStream()


def _patch_current_stream(mode: TorchFunctionMode) -> None:
    torch.cuda.current_stream = lambda *args, **kwargs: _HOST_STREAM


def _patch_builtin_stash_manager(mode: TorchFunctionMode) -> None:
    from megatron.core.transformer.moe import paged_stash

    manager_cls = paged_stash.PagedStashManager
    if manager_cls.STASH_MGR is None:
        cuda_stream = torch.cuda.Stream
        torch.cuda.Stream = _PlaceholderStream  # only while the one instance is made
        try:
            manager_cls.get_instance()
        finally:
            torch.cuda.Stream = cuda_stream


def _patch_hybrid_final_norm(mode: TorchFunctionMode) -> None:
    from megatron.core.extensions import transformer_engine
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if not transformer_engine.HAVE_TE:
        hybrid_block.TENorm = WrappedTorchNorm


def _owners(name: str) -> list[tuple[Any, str]]:
    """The Megatron attributes shim ``name`` replaces (checked before anything is patched)."""
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import token_dispatcher

    alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
    if name == "builtin_stash_manager":
        from megatron.core.transformer.moe import paged_stash

        return [(paged_stash.PagedStashManager, "get_instance")]
    if name == "hybrid_final_norm":
        from megatron.core.models.hybrid import hybrid_block

        return [(hybrid_block, "TENorm")]
    return {
        "checkpoint_backward_in_mode": [(mcore_random.CheckpointFunction, "backward")],
        "cuda_rng": [(mcore_random, "_get_cuda_rng_state"), (mcore_random, "_set_cuda_rng_state")],
        # te_general_gemm: set whether or not the release defines it (0.16.1 leaves it
        # undefined without TE, 0.19.2 defines it as None): nothing to check.
        "alltoall_dtoh": [
            (alltoall, "_maybe_dtoh_and_synchronize"),
            (alltoall, "cuda_dtoh_stream"),
        ],
        "checkpoint_without_output_fp8": [(mcore_random.CheckpointWithoutOutput, "__init__")],
    }.get(name, [])


#: Every shim by name: what :func:`install` calls for it (see the module's table).
SHIMS: dict[str, Callable[[TorchFunctionMode], None]] = {
    "no_compile": _patch_no_compile,
    "current_device": _patch_current_device,
    "current_stream": _patch_current_stream,
    "synchronize": _patch_synchronize,
    "cuda_rng": _patch_cuda_rng,
    "te_general_gemm": _patch_te_general_gemm,
    "alltoall_dtoh": _patch_alltoall_dtoh,
    "checkpoint_without_output_fp8": _patch_checkpoint_without_output,
    "cuda_factories": _patch_cuda_factories,
    "checkpoint_backward_in_mode": _patch_checkpoint_backward,
    "builtin_stash_manager": _patch_builtin_stash_manager,
    "hybrid_final_norm": _patch_hybrid_final_norm,
}


def install(*, training_loop: bool = False) -> None:
    """Apply the installed release's shims (idempotent). Call once per process, before
    building Megatron modules. ``training_loop``: also those for Megatron-LM's training loop
    (``megatron.training.pretrain()``, :mod:`~te_paged.integrations.megatron.cpu_loop_shims`),
    before importing it; a later call may add them.

    Raises ``RuntimeError`` when CUDA is available (the shims would hide real CUDA calls), when
    the installed megatron-core is not a supported release (naming the supported ones), when
    ``training_loop`` is asked of a release without those shims, or when an attribute a shim
    replaces is missing from it.
    """
    if torch.cuda.is_available():
        raise RuntimeError(
            "te_paged's Megatron CPU shims are for machines without CUDA; on a GPU machine "
            "run Megatron as it is (do not call cpu_shims.install())"
        )
    release = installed_release()
    if not _state["installed"]:
        for name in release.cpu_shims:
            _check_owners(name, _owners(name), release.version)
        mode = _CudaAllocationsOnCpu()
        for name in SHIMS:  # the table's order: the mode is entered after the plain patches
            if name in release.cpu_shims:
                SHIMS[name](mode)
        _state.update(installed=True, mode=mode, shims=release.cpu_shims)
    if training_loop and not _state["loop"]:
        if not release.cpu_loop_shims:
            raise RuntimeError(
                f"te_paged runs Megatron-LM's training loop on CPU with megatron-core "
                f"{', '.join(v for v, r in RELEASES.items() if r.cpu_loop_shims)} only; "
                f"{release.version} is installed"
            )
        from te_paged.integrations.megatron import cpu_loop_shims

        bridge = installed_bridge_release()
        if bridge is not None and "megatron.bridge" in sys.modules:  # before any patch
            from te_paged.integrations.megatron import cpu_bridge_shims

            cpu_bridge_shims.install(bridge.cpu_shims, bridge.version)  # raises, naming it
        for name in release.cpu_loop_shims:  # each checked once the ones before it ran
            cpu_loop_shims.LOOP_SHIMS[name]()
            _check_owners(name, cpu_loop_shims.owners(name), release.version)
        loop_shims = release.cpu_loop_shims
        if bridge is not None:  # Megatron-Bridge's own, applied as its modules are imported
            from te_paged.integrations.megatron import cpu_bridge_shims

            cpu_bridge_shims.install(bridge.cpu_shims, bridge.version)
            loop_shims = (*loop_shims, *bridge.cpu_shims)
        _state.update(loop=True, shims=(*_state["shims"], *loop_shims))
    if torch.cuda.is_available():  # no shim may change te_paged's own device choice
        raise RuntimeError("a CPU shim made torch.cuda.is_available() true")


def _check_owners(name: str, owners: list[tuple[Any, str]], version: str) -> None:
    for owner, attr in owners:
        if not hasattr(owner, attr):
            raise RuntimeError(
                f"{getattr(owner, '__name__', owner)}.{attr} is missing: the CPU shim {name!r} "
                f"no longer matches megatron-core {version}"
            )
