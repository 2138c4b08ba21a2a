"""CPU stand-ins for the CUDA-only calls of megatron-core 0.16.1 — for CPU runs only.

megatron-core calls CUDA in places even when every tensor is on the CPU. This module is the one
place that replaces those calls, so that Megatron's ``MoELayer``, ``GPTModel``, DDP, optimizer
and ``forward_backward_func`` run on CPU ranks (gloo). Nothing installs it implicitly: importing
te_paged never does, and :func:`install` refuses to run when CUDA is available. Only the CPU
paths call it — te_paged's tests and ``te-paged ab --engine megatron --device cpu`` — and a
user who wants to try the integration on a CPU machine can call it first, as
docs/megatron.md's example does.

Pinned to one megatron-core release (:data:`PINNED_VERSION`): each shim replaces a named function
or attribute of that release, so a different release raises at :func:`install` instead of
silently patching code that has moved. Every shim, with what it replaces (the same list is in
docs/megatron.md):

===============================================  ===============================================
Megatron (0.16.1) calls                          on CPU it gets
===============================================  ===============================================
``torch.cuda.current_device()`` (router weight,  ``torch.device("cpu")``
all-to-all outputs, DDP, embeddings)
``torch.cuda.synchronize()`` (checkpoint         a no-op (everything is on the host already)
writer, DDP buffer moves)
factories with ``device="cuda"`` (schedules'     the CPU: a ``TorchFunctionMode`` rewrites the
``total_num_tokens``, DDP's grad buffers,        ``device`` argument of factory calls that name
the optimizer's flags, ``get_grad_norm_fp32``,   CUDA, and ``Tensor.cuda()`` returns the tensor
``count_zeros_fp32``)
``param.grad.type() == 'torch.cuda.Float         ``Tensor.type()`` names a CPU tensor by its CUDA
Tensor'`` (``clip_grad_by_total_norm_fp32``)     name (the same mode)
``CheckpointFunction.backward`` (full and        the same, run inside the mode: autograd's
``moe`` recompute: the forward runs again in     backward does not carry torch function modes,
backward, e.g. ``get_default_causal_mask``)      so the recomputed forward would escape it
the CUDA generator (``torch.cuda.get_rng_        the CPU generator: ``torch.cuda.get_rng_state``
state``/``manual_seed``, ``random._get_cuda_     / ``manual_seed`` and Megatron's ``_get_cuda_
rng_state``/``_set_cuda_rng_state``: the RNG     rng_state``/``_set_cuda_rng_state`` read and
tracker, ``CheckpointWithoutOutput``)            write ``torch.get_rng_state()``, so the tracker
                                                 forks and restores CPU streams as it would CUDA
                                                 ones (its "CPU RNG state changed within GPU RNG
                                                 context" warning is then expected and silenced)
``moe_utils.te_general_gemm`` (a Transformer     ``None``: the router takes Megatron's own
Engine name left undefined without TE)           ``torch.mm`` branch
``MoEAlltoAllTokenDispatcher``'s CUDA stream and a sentinel stream, and a ``_maybe_dtoh_and_
``_maybe_dtoh_and_synchronize`` (numpy split     synchronize`` that keeps the host tensors and
sizes, CUDA events)                              turns the EP split sizes into the lists gloo
                                                 accepts
``CheckpointWithoutOutput.__init__``             ``self.fp8 = bool(fp8)`` (0.16.1 writes ``fp8
                                                 is not None``, taking TE's undefined FP8 branch)
``jit_fuser = torch.compile`` on the fused       ``torch._dynamo.config.disable = True``: they
activations (inductor: ~30 s per process)        run eagerly
===============================================  ===============================================
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["INSTALL_HINT", "PINNED_VERSION", "install", "installed", "megatron_version"]

PINNED_VERSION = "0.16.1"
PIP_INSTALL = f"pip install --no-deps megatron-core=={PINNED_VERSION} numpy packaging psutil"
INSTALL_HINT = (
    f"te_paged's CPU runs of Megatron need megatron-core=={PINNED_VERSION}; install it next to "
    f"the pinned CPU torch with `{PIP_INSTALL}` (scripts/test.sh does this)"
)

_state: dict[str, Any] = {"installed": False, "mode": None}


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return bool(_state["installed"])


def megatron_version() -> str:
    """The installed megatron-core version; ``RuntimeError`` with the install hint if absent
    or not the pinned release."""
    try:
        package_info = importlib.import_module("megatron.core.package_info")
    except ImportError as e:
        raise RuntimeError(f"megatron-core is not importable ({e}): {INSTALL_HINT}") from e
    version = package_info.__version__
    if version != PINNED_VERSION:
        raise RuntimeError(
            f"megatron-core {version} is installed but the CPU shims in {__name__} are written "
            f"for {PINNED_VERSION}: {INSTALL_HINT}, or port the shims to {version}"
        )
    return version


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


def install() -> None:
    """Apply every shim (idempotent). Call once per process, before building Megatron modules.

    Raises ``RuntimeError`` when CUDA is available (the shims would hide real CUDA calls) or when
    the installed megatron-core is not :data:`PINNED_VERSION`.
    """
    if _state["installed"]:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "te_paged's Megatron CPU shims are for machines without CUDA; on a GPU machine "
            "run Megatron as it is (do not call cpu_shims.install())"
        )
    megatron_version()
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    expected = (
        (moe_utils, "te_general_gemm", False),
        (token_dispatcher.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", True),
        (token_dispatcher.MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", True),
        (mcore_random, "_get_cuda_rng_state", True),
        (mcore_random, "_set_cuda_rng_state", True),
        (mcore_random.CheckpointWithoutOutput, "__init__", True),
        (mcore_random.CheckpointFunction, "backward", True),
    )
    for owner, name, must_exist in expected:
        if must_exist and not hasattr(owner, name):
            raise RuntimeError(
                f"{owner.__name__}.{name} is missing: the shims no longer match megatron-core "
                f"{PINNED_VERSION}"
            )
    from torch import _dynamo

    _dynamo.config.disable = True  # read per frame, so it holds for compiled-at-import fns
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    moe_utils.te_general_gemm = None
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    dispatcher.cuda_dtoh_stream = object()  # non-None: the constructor then creates no stream
    dispatcher._maybe_dtoh_and_synchronize = _host_dtoh_and_synchronize
    mcore_random._get_cuda_rng_state = _cpu_rng_state
    mcore_random._set_cuda_rng_state = _set_cpu_rng_state
    mcore_random.CheckpointWithoutOutput.__init__ = _checkpoint_without_output_init
    # The tracker's fork compares the CPU state before and after: with the CPU generator
    # standing in for the CUDA one it always changes, and every fork would log a warning.
    logging.getLogger(mcore_random.__name__).setLevel(logging.ERROR)
    mode = _CudaAllocationsOnCpu()
    mode.__enter__()  # for the rest of the process, like torch.set_default_device
    recompute = mcore_random.CheckpointFunction.backward

    def backward_in_mode(ctx, *grads):
        with mode:
            return recompute(ctx, *grads)

    mcore_random.CheckpointFunction.backward = staticmethod(backward_in_mode)
    _state.update(installed=True, mode=mode)
