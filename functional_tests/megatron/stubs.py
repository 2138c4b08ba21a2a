"""CPU stand-ins for the CUDA-only calls of megatron-core's MoE layer — a test fixture only.

Pinned to one megatron-core release (:data:`PINNED_VERSION`): each stub replaces a named
function or attribute of that release, so a different release raises at :func:`install` instead
of silently patching code that has moved. None of this belongs in te_paged: the library never
patches Megatron.

What megatron-core 0.16.1 does on CUDA only, and what stands in for it (process-wide, in the
spawned worker only):

* ``torch.cuda.current_device()`` — the router moves its weight there; the all-to-all and
  all-gather outputs and the global memory buffer are allocated there. Stand-in: it returns
  ``torch.device("cpu")``.
* ``moe_utils.te_general_gemm`` — a Transformer Engine name left undefined when TE is not
  installed (``NameError`` in the router GEMM). Stand-in: ``None``, so the router takes
  Megatron's own ``torch.mm`` branch.
* ``MoEAlltoAllTokenDispatcher`` creates a ``torch.cuda.Stream`` and copies the split sizes to
  the host on it, as numpy arrays, then waits on a CUDA event. Stand-in: a sentinel stream and a
  ``_maybe_dtoh_and_synchronize`` that keeps the host tensors and turns the EP split sizes into
  lists (gloo's ``all_to_all_single`` accepts lists only).
* ``CheckpointWithoutOutput`` (``moe_act`` recompute) saves and restores the CUDA RNG state, and
  its ``self.fp8 = fp8 is not None`` makes ``fp8=False`` true, reaching TE's undefined
  ``FP8GlobalStateManager``. Stand-in: ``_get_cuda_rng_state`` returns ``None`` and
  ``_set_cuda_rng_state`` does nothing (the CPU RNG is still saved and restored), and
  ``fp8 = bool(fp8)``.
* ``dist_checkpointing``'s file writer calls ``torch.cuda.synchronize()`` before copying
  tensors to the host. Stand-in: a no-op (everything is on the host already).
* ``jit_fuser = torch.compile`` on the fused activations: inductor needs ~30 s per process on
  CPU. Stand-in: ``torch._dynamo.config.disable = True``; they run eagerly, the same code in the
  reference and in the te_paged layers.
"""

from __future__ import annotations

import importlib

import torch

PINNED_VERSION = "0.16.1"
PIP_INSTALL = f"pip install --no-deps megatron-core=={PINNED_VERSION} numpy packaging psutil"
INSTALL_HINT = (
    f"the Megatron functional tests need megatron-core=={PINNED_VERSION}; install it next to "
    f"the pinned CPU torch with `{PIP_INSTALL}` (scripts/test.sh does this)"
)

_installed = False


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
            f"megatron-core {version} is installed but the CPU stubs in {__name__} are written "
            f"for {PINNED_VERSION}: {INSTALL_HINT}, or port the stubs to {version}"
        )
    return version


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


def install() -> None:
    """Apply every stub (idempotent). Call once in each worker process before building layers."""
    global _installed
    if _installed:
        return
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
    )
    for owner, name, must_exist in expected:
        if must_exist and not hasattr(owner, name):
            raise RuntimeError(
                f"{owner.__name__}.{name} is missing: the stubs no longer match megatron-core "
                f"{PINNED_VERSION}"
            )
    import torch._dynamo

    torch._dynamo.config.disable = True  # read per frame, so it holds for compiled-at-import fns
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    moe_utils.te_general_gemm = None
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    dispatcher.cuda_dtoh_stream = object()  # non-None: the constructor then creates no stream
    dispatcher._maybe_dtoh_and_synchronize = _host_dtoh_and_synchronize
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random._set_cuda_rng_state = lambda *args, **kwargs: None
    mcore_random.CheckpointWithoutOutput.__init__ = _checkpoint_without_output_init
    _installed = True
