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

    ``auto`` is Triton on CUDA when Triton imports, else the torch reference. ``triton`` on a CPU
    device needs Triton's interpreter (``TRITON_INTERPRET=1``, read here and nowhere else).
    """
    backend = KernelBackend(backend)
    ok, reason = triton_available()
    if backend is KernelBackend.AUTO:
        return KernelBackend.TRITON if device.type == "cuda" and ok else KernelBackend.TORCH
    if backend is KernelBackend.TRITON:
        if not ok:
            raise ValueError(f"moe_paged_stash_kernel_backend='triton' but {reason}")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                f"moe_paged_stash_kernel_backend='triton' on device {device} needs Triton's "
                "interpreter: set TRITON_INTERPRET=1 before importing te_paged, or use 'torch'"
            )
    return backend


_COPY_MUTATES = (
    "dev_pool",
    "dev_free",
    "host_pool",
    "host_free",
    "state",
    "flags",
    "rec_pages",
    "rec_meta",
)


@torch.library.custom_op("te_paged::stash_copy", mutates_args=_COPY_MUTATES)
def _stash_copy_op(
    src: torch.Tensor,
    num_tokens: torch.Tensor,
    tokens_per_row: int,
    page_size: int,
    dev_pool: torch.Tensor,
    dev_free: torch.Tensor,
    host_pool: torch.Tensor,
    host_free: torch.Tensor,
    state: torch.Tensor,
    flags: torch.Tensor,
    rec_pages: torch.Tensor,
    rec_meta: torch.Tensor,
    use_triton: bool,
) -> None:
    if use_triton:
        from te_paged.kernels.triton_stash import triton_stash_copy as impl
    else:
        impl = torch_stash_copy
    impl(
        src,
        num_tokens,
        tokens_per_row,
        page_size,
        dev_pool,
        dev_free,
        host_pool,
        host_free,
        state,
        flags,
        rec_pages,
        rec_meta,
    )


@_stash_copy_op.register_fake
def _(*args: object) -> None:
    return None


@torch.library.custom_op(
    "te_paged::stash_pop", mutates_args=("dst", "dev_free", "host_free", "state")
)
def _stash_pop_op(
    dst: torch.Tensor,
    page_size: int,
    dev_pool: torch.Tensor,
    dev_free: torch.Tensor,
    host_pool: torch.Tensor,
    host_free: torch.Tensor,
    state: torch.Tensor,
    flags: torch.Tensor,
    rec_pages: torch.Tensor,
    rec_meta: torch.Tensor,
    zero_padding: bool,
    use_triton: bool,
) -> None:
    if use_triton:
        from te_paged.kernels.triton_stash import triton_stash_pop as impl
    else:
        impl = torch_stash_pop
    impl(
        dst,
        page_size,
        dev_pool,
        dev_free,
        host_pool,
        host_free,
        state,
        flags,
        rec_pages,
        rec_meta,
        zero_padding,
    )


@_stash_pop_op.register_fake
def _(*args: object) -> None:
    return None


def stash_copy(backend: KernelBackend, *args: object) -> None:
    """``te_paged::stash_copy`` with the arguments of :func:`torch_stash_copy`.

    Always through the op, in eager mode too: it costs ~20 µs a call, and keeps the pool writes
    opaque to dispatch-based tools (``MemTracker`` would otherwise count the preallocated pool
    as memory the step allocated).
    """
    _stash_copy_op(*args, backend is KernelBackend.TRITON)


def stash_pop(backend: KernelBackend, *args: object) -> None:
    """``te_paged::stash_pop`` with the arguments of :func:`torch_stash_pop`."""
    _stash_pop_op(*args, backend is KernelBackend.TRITON)
