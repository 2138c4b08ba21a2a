"""The registry of stash kernel backends: one entry per implementation of copy and pop.

A backend is a :class:`StashBackend` — its name, its ``copy``/``pop`` (the signatures of
:func:`~te_paged.kernels.reference.torch_stash_copy` and ``torch_stash_pop``, leaving every
tensor in exactly the state the reference does) and whether it can run on a device. The
built-ins register themselves, one file each: ``torch`` (:mod:`te_paged.kernels.reference`) and
``triton`` (:mod:`te_paged.kernels.triton_backend`). Everything else — the config's
``moe_paged_stash_kernel_backend``, the manager, the ``torch.library`` ops, the CLI — reads the
registry, so a new backend is one :func:`register_backend` call::

    register_backend(StashBackend("mine", copy=my_copy, pop=my_pop))
    MoEConfig(moe_paged_stash_kernel_backend="mine", ...)

``"auto"`` is not a backend but a choice :func:`resolve_backend` makes per device.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch

__all__ = [
    "AUTO",
    "KernelBackend",
    "StashBackend",
    "backend_choices",
    "get_backend",
    "register_backend",
    "resolve_backend",
]

AUTO = "auto"


class KernelBackend(str, enum.Enum):
    """The built-in choices, for convenience; any registered name is valid where one is."""

    AUTO = AUTO  # Triton on CUDA, the torch reference elsewhere
    TRITON = "triton"
    TORCH = "torch"


def _always(device: torch.device) -> tuple[bool, str]:
    return True, ""


@dataclasses.dataclass(frozen=True)
class StashBackend:
    """One implementation of the stash kernels.

    ``available(device) -> (ok, reason)`` says whether it can run for pools on ``device``
    (``reason`` completes "... but <reason>"). ``sync_free`` backends read no count on the host
    (``auto`` picks only those on an accelerator). ``direct`` backends may be called as plain
    functions, skipping the dispatcher, when nothing watches ops (both built-ins: the
    dispatcher costs more than a Triton launch's host work).
    """

    name: str
    copy: Callable[..., None]
    pop: Callable[..., None]
    available: Callable[[torch.device], tuple[bool, str]] = _always
    sync_free: bool = False
    direct: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name == AUTO:
            raise ValueError(f"a backend name must be an identifier other than 'auto', got "
                             f"{self.name!r}")  # fmt: skip


_BACKENDS: dict[str, StashBackend] = {}
_BUILTINS_LOADED = False


def register_backend(backend: StashBackend, *, replace: bool = False) -> StashBackend:
    """Add ``backend`` under its name (``replace=True`` to override one); returns it."""
    if not isinstance(backend, StashBackend):
        raise TypeError(f"register_backend takes a StashBackend, got {backend!r}")
    _builtins()  # first, so that a user's replace=True overrides them, not the reverse
    if backend.name in _BACKENDS and not replace:
        raise ValueError(f"a stash backend named {backend.name!r} is already registered; "
                         "pass replace=True to override it")  # fmt: skip
    _BACKENDS[backend.name] = backend
    return backend


def _builtins() -> dict[str, StashBackend]:
    """The registry, with the built-in backends registered at its first use (their modules
    import torch, which ``import te_paged.kernels`` leaves to first use)."""
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True  # before registering: register_backend calls this
        from te_paged.kernels import reference, triton_backend

        register_backend(StashBackend(
            "torch", reference.torch_stash_copy, reference.torch_stash_pop, direct=True
        ))  # fmt: skip
        register_backend(StashBackend(
            "triton", triton_backend.triton_copy, triton_backend.triton_pop,
            available=triton_backend.triton_usable, sync_free=True, direct=True,
        ))  # fmt: skip
    return _BACKENDS


def backend_choices() -> tuple[str, ...]:
    """Every valid value of ``moe_paged_stash_kernel_backend``: ``auto`` and the registered,
    by name."""
    return (AUTO, *sorted(_builtins()))


def get_backend(name: str | StashBackend) -> StashBackend:
    """The registered backend ``name`` (a name, a :class:`KernelBackend` or a backend)."""
    if isinstance(name, StashBackend):
        return name
    key = name.value if isinstance(name, KernelBackend) else name
    # The op path names its backend on every stash and pop: the registry first, then (once,
    # before any backend exists) the built-ins.
    backend = (_BACKENDS.get(key) or _builtins().get(key)) if isinstance(key, str) else None
    if backend is None:
        allowed = ", ".join(repr(n) for n in _BACKENDS)
        raise ValueError(f"stash kernel backend {name!r} is not registered ({allowed}; or 'auto')")
    return backend


def resolve_backend(name: str | StashBackend, device: torch.device) -> StashBackend:
    """The concrete backend for pools on ``device``.

    ``auto`` is the torch reference on CPU and a sync-free backend (Triton) on CUDA; on CUDA
    without one it raises rather than fall back to the reference, which reads every count on
    the host (a sync per stash, no CUDA-graph capture): ask for ``torch`` explicitly to accept
    that. A named backend that cannot run on ``device`` raises with its reason.
    """
    device = torch.device(device)
    key = name.value if isinstance(name, KernelBackend) else name
    if key == AUTO:
        if device.type != "cuda":
            return get_backend(KernelBackend.TORCH)
        triton = _builtins().get(KernelBackend.TRITON.value)
        ok, reason = triton.available(device) if triton else (False, "it is not registered")
        if not ok:
            raise ValueError(
                f"moe_paged_stash_kernel_backend='auto' on {device} needs the Triton kernels, "
                f"but {reason}. Install it, or set moe_paged_stash_kernel_backend='torch' to "
                "accept the reference kernels, which read token counts on the host (a "
                "synchronisation per stash; no CUDA-graph capture)"
            )
        return triton
    backend = get_backend(name)
    ok, reason = backend.available(device)
    if not ok:
        raise ValueError(f"moe_paged_stash_kernel_backend={backend.name!r} but {reason}")
    return backend
