"""CPU stand-ins for torchtitan 0.3.0's CUDA assumptions on a CPU-only torch — CPU runs only.

torchtitan picks its device when ``torchtitan.tools.utils`` is imported: the available
accelerator, else ``"cuda"``, so on a CPU-only torch its ``Trainer`` calls ``torch.cuda``. This
module is the one place that replaces those calls, so that torchtitan's ``Trainer`` (and
:class:`~te_paged.integrations.torchtitan.PagedStashTrainer`) runs on CPU ranks with gloo.
Nothing installs it implicitly: importing te_paged never does, and :func:`install` refuses to run
where CUDA is available. Only te_paged's tests and ``te-paged ab --engine torchtitan --device
cpu`` call it. Every attribute a shim replaces is checked to exist before anything is patched,
so a torchtitan release whose code moved raises instead of being patched silently.

===============================================  ===============================================
torchtitan 0.3.0 / torch 2.13 calls (shim)       on CPU it gets
===============================================  ===============================================
``torchtitan.tools.utils.device_type`` and       ``"cpu"`` and a small device module
``device_module`` (``"cuda"``, ``torch.cuda``),  (``set_device``, ``current_device``,
and the copies bound by ``components.metrics``,  ``synchronize``, ``get_device_name``,
``distributed.utils``, ``distributed.            ``get_device_properties``, ``memory_stats``,
parallel_dims`` and ``models.common.token_       ``reset_peak_memory_stats``, ``empty_cache``:
dispatcher``; ``get_local_device``               no-ops or fixed answers); ``get_local_device``
(``device``)                                     returns ``torch.device("cpu")``
``torch.distributed.set_timeout`` (called by     ``torch.distributed.distributed_c10d.
``distributed.utils.set_pg_timeouts`` after      _set_pg_timeout``, the function torch 2.13
the first step; absent from torch 2.13)          has under that private name
(``set_timeout``)
``distributed.fsdp.disable_fsdp_gradient_        the same, and ``set_force_sum_reduction_for_
division`` (FSDP2 then reduce-scatters with      comms(True)`` on each FSDP module: a plain SUM,
``PREMUL_SUM``, which gloo lacks)                which with a divide factor of 1 is the same
(``fsdp_sum``)                                   arithmetic
torchtitan's HybridEP custom ops (``hybridep::     CPU kernels: the same Python functions, which
dispatch``, ``combine``, ``dispatch_bwd``,       call whatever ``deep_ep`` is installed (on
``combine_bwd``), registered for CUDA only; the  CPU: a test's stand-in; the real library needs
module imports ``torch._library.opaque_object.   CUDA); ``CustomClassBase`` is torch 2.13's
CustomClassBase``, absent from torch 2.13        ``torch._opaque_base.OpaqueBase``, the base
(``hybridep_ops``)                               ``register_opaque_type`` asks for
===============================================  ===============================================

A CPU run also needs two config choices, not shims: ``training.disable_cuda_graphs=True``
(:class:`PagedStashTrainer` requires it everywhere) and, on more than one rank,
``parallelism.spmd_backend="partial_dtensor"`` (torch 2.13's FSDP2 does not take the default
``spmd_types`` parameters), and an attention other than FlexAttention, which has no CPU backward
(torchtitan's ``ScaledDotProductAttention``).
"""

from __future__ import annotations

import importlib
import os
import types

import torch

from te_paged.torch_compat import OpaqueBase

__all__ = ["SHIMS", "install", "installed"]

#: The shims, in the order :func:`install` applies them.
SHIMS = ("device", "set_timeout", "fsdp_sum", "hybridep_ops")

#: Modules that bind ``device_type``/``device_module`` from ``torchtitan.tools.utils`` at import.
_BINDERS = (
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.models.common.token_dispatcher",
)

#: torchtitan's HybridEP custom ops (``torchtitan.distributed.deepep.hybridep``), CUDA-only.
_HYBRIDEP_OPS = ("_dispatch_impl", "_combine_impl", "_dispatch_bwd_impl", "_combine_bwd_impl")

_installed = False


def _cpu_device_module() -> types.SimpleNamespace:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # the metrics' percentages
    props = types.SimpleNamespace(total_memory=memory, name="cpu")

    def nothing(*args: object, **kwargs: object) -> None:
        return None

    return types.SimpleNamespace(
        set_device=nothing,
        current_device=lambda: 0,
        device_count=lambda: 1,
        synchronize=nothing,
        get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: props,
        reset_peak_memory_stats=nothing,
        empty_cache=nothing,
        memory_stats=lambda *a: {},
        is_available=lambda: True,
    )


def _set_timeout(timeout, group=None) -> None:
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def _disable_division_sum(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def installed() -> bool:
    return _installed


def install() -> None:
    """Install every shim (idempotent). ``RuntimeError`` where CUDA is available."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError(
            "te_paged.integrations.torchtitan.cpu_shims is for CPU-only runs; CUDA is available "
            "here, and torchtitan runs on it as it is"
        )
    utils = importlib.import_module("torchtitan.tools.utils")
    binders = [importlib.import_module(name) for name in _BINDERS]
    fsdp = importlib.import_module("torchtitan.distributed.fsdp")
    opaque = importlib.import_module("torch._library.opaque_object")
    if not hasattr(opaque, "CustomClassBase"):  # torch 2.13's name for it
        opaque.CustomClassBase = OpaqueBase
    hybridep = importlib.import_module("torchtitan.distributed.deepep.hybridep")
    missing = [
        f"{m.__name__}.{attr}"
        for m, attr in [
            (utils, "device_type"),
            (utils, "device_module"),
            (utils, "get_local_device"),
            (fsdp, "disable_fsdp_gradient_division"),
            *((m, "device_type") for m in binders),
            *((hybridep, name) for name in _HYBRIDEP_OPS),
        ]
        if not hasattr(m, attr)
    ]
    if missing:
        raise RuntimeError(
            f"torchtitan's code moved ({', '.join(missing)} missing): these CPU stand-ins are "
            "for torchtitan 0.3.0"
        )
    device_module = _cpu_device_module()
    for module in (utils, *binders):
        module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = device_module
        if hasattr(module, "get_local_device"):
            module.get_local_device = lambda: torch.device("cpu")
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = _set_timeout
    fsdp.disable_fsdp_gradient_division = _disable_division_sum
    for name in _HYBRIDEP_OPS:
        op = getattr(hybridep, name)
        op.register_kernel("cpu")(op._init_fn)
    _installed = True
