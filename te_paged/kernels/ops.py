"""Stash copy/pop as ``torch.library`` custom ops, dispatching to a registered backend.

Registering them as ops (with fake implementations) lets ``torch.compile`` see one opaque,
mutating op instead of tracing into kernel launches or host reads.
"""

from __future__ import annotations

import torch

from te_paged.kernels.backends import StashBackend, get_backend

__all__ = ["stash_copy", "stash_pop"]


# Registered through torch.library.Library rather than torch.library.custom_op: the
# latter's Python-side wrapping costs ~95 µs a call with twelve arguments, the raw
# registration ~10 µs. Alias annotations ``(x!)`` declare what each op writes.
_LIB = torch.library.Library("te_paged", "DEF")
_LIB.define(
    "stash_copy(Tensor src, Tensor num_tokens, int tokens_per_row, int page_size, "
    "Tensor(a!) dev_pool, Tensor(b!) dev_free, Tensor(c!) host_pool, Tensor(d!) host_free, "
    "Tensor(e!) state, Tensor(f!) flags, Tensor(g!) rec_pages, Tensor(h!) rec_meta, "
    "str backend) -> ()"
)
_LIB.define(
    "stash_pop(Tensor(a!) dst, int page_size, Tensor dev_pool, Tensor(b!) dev_free, "
    "Tensor host_pool, Tensor(c!) host_free, Tensor(d!) state, Tensor flags, Tensor rec_pages, "
    "Tensor rec_meta, bool zero_padding, str backend) -> ()"
)


def _impl(name: str):
    """The op body: the registered backend named by the trailing argument."""

    def run(*args: object) -> None:
        *kernel_args, backend = args
        kernel = get_backend(backend)
        (kernel.copy if name == "copy" else kernel.pop)(*kernel_args)

    return run


_LIB.impl("stash_copy", _impl("copy"), "CompositeExplicitAutograd")
_LIB.impl("stash_pop", _impl("pop"), "CompositeExplicitAutograd")


@torch.library.register_fake("te_paged::stash_copy")
def _(*args: object) -> None:
    return None


@torch.library.register_fake("te_paged::stash_pop")
def _(*args: object) -> None:
    return None


def _direct(backend: StashBackend, data: torch.Tensor) -> bool:
    """Whether the kernel may run as a plain call, skipping the dispatcher (7 µs a call on warm
    caches, up to 40 µs right after a large copy): only a ``direct`` backend (both built-ins),
    and only with nothing that watches ops. Any dispatch or function mode
    (``MemTracker``, ``FakeTensorMode``, a guard), ``torch.compile`` tracing or a tensor
    subclass gets the one opaque op instead of the kernel's internals; ``MemTracker``, for one,
    would otherwise count the preallocated pool as memory the step allocated.
    """
    return (
        backend.direct
        and type(data) is torch.Tensor
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._len_torch_function_stack()
        and not torch.compiler.is_compiling()
    )


def stash_copy(backend: StashBackend | str, *args: object) -> None:
    """``te_paged::stash_copy`` with the arguments of :func:`torch_stash_copy`, run by
    ``backend`` (a registered backend or its name)."""
    backend = get_backend(backend)
    if _direct(backend, args[0]):
        backend.copy(*args)
    else:
        torch.ops.te_paged.stash_copy(*args, backend.name)


def stash_pop(backend: StashBackend | str, *args: object) -> None:
    """``te_paged::stash_pop`` with the arguments of :func:`torch_stash_pop`."""
    backend = get_backend(backend)
    if _direct(backend, args[0]):
        backend.pop(*args)
    else:
        torch.ops.te_paged.stash_pop(*args, backend.name)
