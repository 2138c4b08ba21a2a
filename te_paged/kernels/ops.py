"""Stash copy/pop as ``torch.library`` custom ops, dispatching to the Triton or torch kernels.

Registering them as ops (with fake implementations) lets ``torch.compile`` see one opaque,
mutating op instead of tracing into kernel launches or host reads.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from te_paged.config import KernelBackend
from te_paged.kernels.reference import torch_stash_copy, torch_stash_pop

__all__ = ["KernelBackend", "resolve_backend", "stash_copy", "stash_pop", "triton_available"]


def triton_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether the Triton kernels can run here."""
    # find_spec, not import: choosing a backend must not pay for (or initialise) Triton.
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'te_paged[triton]')"
    return True, ""


def resolve_backend(backend: KernelBackend | str, device: torch.device) -> KernelBackend:
    """Pick the concrete backend for pools on ``device``.

    ``auto`` is the torch reference on CPU and Triton on CUDA; on CUDA without Triton it raises
    rather than fall back to the reference, which reads every count on the host (a sync per
    stash, no CUDA-graph capture): ask for ``torch`` explicitly to accept that. ``triton`` on a
    CPU device needs Triton's interpreter (``TRITON_INTERPRET=1``, read here and nowhere else).
    """
    backend = KernelBackend(backend)
    ok, reason = triton_available()
    if backend is KernelBackend.AUTO:
        if device.type != "cuda":
            return KernelBackend.TORCH
        if not ok:
            raise ValueError(
                f"moe_paged_stash_kernel_backend='auto' on {device} needs the Triton kernels, "
                f"but {reason}. Install it, or set moe_paged_stash_kernel_backend='torch' to "
                "accept the reference kernels, which read token counts on the host (a "
                "synchronisation per stash; no CUDA-graph capture)"
            )
        return KernelBackend.TRITON
    if backend is KernelBackend.TRITON:
        if not ok:
            raise ValueError(f"moe_paged_stash_kernel_backend='triton' but {reason}")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                f"moe_paged_stash_kernel_backend='triton' on device {device} needs Triton's "
                "interpreter: set TRITON_INTERPRET=1 before importing te_paged, or use 'torch'"
            )
    return backend


# Registered through torch.library.Library rather than torch.library.custom_op: the
# latter's Python-side wrapping costs ~95 µs a call with twelve arguments, the raw
# registration ~10 µs. Alias annotations ``(x!)`` declare what each op writes.
_LIB = torch.library.Library("te_paged", "DEF")
_LIB.define(
    "stash_copy(Tensor src, Tensor num_tokens, int tokens_per_row, int page_size, "
    "Tensor(a!) dev_pool, Tensor(b!) dev_free, Tensor(c!) host_pool, Tensor(d!) host_free, "
    "Tensor(e!) state, Tensor(f!) flags, Tensor(g!) rec_pages, Tensor(h!) rec_meta, "
    "bool use_triton) -> ()"
)
_LIB.define(
    "stash_pop(Tensor(a!) dst, int page_size, Tensor dev_pool, Tensor(b!) dev_free, "
    "Tensor host_pool, Tensor(c!) host_free, Tensor(d!) state, Tensor flags, Tensor rec_pages, "
    "Tensor rec_meta, bool zero_padding, bool use_triton) -> ()"
)


def _impl(name: str):
    """The op body: the Triton or the torch kernel, chosen by the trailing ``use_triton``."""

    def run(*args: object) -> None:
        *kernel_args, use_triton = args
        if use_triton:
            from te_paged.kernels import triton_stash

            getattr(triton_stash, f"triton_stash_{name}")(*kernel_args)
        else:
            (torch_stash_copy if name == "copy" else torch_stash_pop)(*kernel_args)

    return run


_LIB.impl("stash_copy", _impl("copy"), "CompositeExplicitAutograd")
_LIB.impl("stash_pop", _impl("pop"), "CompositeExplicitAutograd")


@torch.library.register_fake("te_paged::stash_copy")
def _(*args: object) -> None:
    return None


@torch.library.register_fake("te_paged::stash_pop")
def _(*args: object) -> None:
    return None


def _direct(backend: KernelBackend, data: torch.Tensor) -> bool:
    """Whether the torch kernel may run as a plain call, skipping the dispatcher (7 µs a call
    on warm caches, up to 40 µs right after a large copy): only with nothing that watches ops.
    Any dispatch or function mode (``MemTracker``, ``FakeTensorMode``, a guard), ``torch.compile``
    tracing or a tensor subclass gets the one opaque op instead of the kernel's internals;
    ``MemTracker``, for one, would otherwise count the preallocated pool as memory the step
    allocated.
    """
    return (
        backend is KernelBackend.TORCH
        and type(data) is torch.Tensor
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._len_torch_function_stack()
        and not torch.compiler.is_compiling()
    )


def stash_copy(backend: KernelBackend, *args: object) -> None:
    """``te_paged::stash_copy`` with the arguments of :func:`torch_stash_copy`."""
    if _direct(backend, args[0]):
        torch_stash_copy(*args)
    else:
        torch.ops.te_paged.stash_copy(*args, backend is KernelBackend.TRITON)


def stash_pop(backend: KernelBackend, *args: object) -> None:
    """``te_paged::stash_pop`` with the arguments of :func:`torch_stash_pop`."""
    if _direct(backend, args[0]):
        torch_stash_pop(*args)
    else:
        torch.ops.te_paged.stash_pop(*args, backend is KernelBackend.TRITON)
