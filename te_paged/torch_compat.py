"""The torch APIs that differ between the releases te_paged runs on, switched in one place: the
newest name where the running torch has it, the older one where it does not. Nothing else in
te_paged imports a renamed torch API or reads a torch version.

=================================  ==================================  ==========================
what                               torch 2.15                          torch 2.13
=================================  ==================================  ==========================
opaque objects (the compiled       ``torch._custom_class_base.         ``torch._opaque_base.
stash ops' arguments)              CustomClassBase``,                  OpaqueBase``,
                                   ``register_custom_class(typ=        ``register_opaque_type(
                                   "symbolic")``                       typ="reference")``
``torch.clamp``'s gradient at the  0 (the limit is outside)            1 (the limit is inside)
limit (:data:`CLAMP_GRAD_AT_LIMIT`)
=================================  ==================================  ==========================

The older names still import on 2.15, each with a deprecation warning (seven at ``import
te_paged``); the newer ones do not exist on 2.13.

The private names below have no public counterpart on either release and behave the same on
both (checked on 2.13.0 and 2.15.0): what saved-tensor hooks are active, whether autograd's
engine is running a backward, how many tensors share a storage. They are read here, one
function each, so that the next rename is one edit. ``torch.library.EffectType`` is public on
both; registering an effectful op is not (``torch.library._register_effectful_op``, called in
:mod:`te_paged.kernels.compiled`). ``torch._dynamo.config.disable`` (the Megatron CPU shims)
exists on both; ``torch.compiler.set_stance("force_eager")``, its public neighbour, still
installs Dynamo's frame hook, which is what the shim keeps away.

``import te_paged`` does not import Dynamo (about 1.2 s of CPU a process; the CLI and ranks that
never compile have no use for it): :func:`assume_constant_result` marks a function as torch's
does, and the compile refusal is built only on a torch that refuses to compile.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

__all__ = [
    "CLAMP_GRAD_AT_LIMIT",
    "COMPILE_RELEASE",
    "TORCH_RELEASE",
    "OpaqueBase",
    "assume_constant_result",
    "backward_running",
    "check_compile_release",
    "register_symbolic_opaque",
    "require_torch",
    "storage_use_count",
    "top_saved_tensors_hooks",
]

#: The running torch's release as ``(major, minor)``.
TORCH_RELEASE: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])

try:  # torch >= 2.15
    from torch._custom_class_base import CustomClassBase as OpaqueBase
    from torch._library.opaque_object import register_custom_class as _register

    _SYMBOLIC = "symbolic"
except ImportError:  # torch 2.10 to 2.14
    from torch._library.opaque_object import register_opaque_type as _register

    try:  # torch 2.11 to 2.14: opaque types derive from it
        from torch._opaque_base import OpaqueBase
    except ImportError:  # torch 2.10: any class
        OpaqueBase = object

    _SYMBOLIC = "reference"


def require_torch(release: tuple[int, int], what: str) -> None:
    """Raise ``ImportError`` naming ``release`` where the running torch is older: for a feature
    that needs a newer torch than te_paged's floor, which must never degrade silently."""
    if TORCH_RELEASE < release:
        raise ImportError(
            f"{what} needs torch >= {release[0]}.{release[1]}; this is torch {torch.__version__}"
        )


#: The oldest release te_paged's code compiles on. Its stash ops take opaque objects (torch's
#: Note [Opaque Objects]): on torch 2.10 a registered class has no opaque base, and Dynamo cannot
#: trace te_paged's checks on one (an ``isinstance``). 2.13 and 2.15 are the releases tested.
COMPILE_RELEASE = (2, 13)
_COMPILE_REFUSED = (
    f"te_paged under torch.compile needs torch >= {COMPILE_RELEASE[0]}.{COMPILE_RELEASE[1]} "
    f"(its paged-stash ops take opaque objects); this is torch {torch.__version__}: run the "
    "MoE layers eagerly or upgrade torch"
)


def _compile_refusal() -> Callable[[], None]:
    """The refusal as a function Dynamo runs and never traces: a compiled region that reaches it
    raises when it runs (Dynamo breaks the graph there; a ``raise`` it traced would instead
    rerun the frame eagerly, where no check runs), and under ``fullgraph=True`` Dynamo's own
    error carries the reason."""

    def refuse() -> None:
        raise RuntimeError(_COMPILE_REFUSED)

    return torch.compiler.disable(refuse, reason=_COMPILE_REFUSED)


#: Built at import only on a torch that refuses: ``torch.compiler.disable`` imports Dynamo.
_refuse_compile_now = _compile_refusal() if TORCH_RELEASE < COMPILE_RELEASE else None


def check_compile_release() -> None:
    """Called where te_paged's code runs under torch.compile: on a torch older than
    :data:`COMPILE_RELEASE` a ``RuntimeError`` naming it, never a silent eager fallback."""
    if TORCH_RELEASE < COMPILE_RELEASE:
        _refuse_compile_now()


def assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result(fn)`` without importing Dynamo: that function
    imports ``torch._dynamo`` (about 1.2 s of CPU) only to set the one attribute Dynamo reads
    when it meets ``fn`` in a trace, and te_paged marks its functions at import, where most
    processes (the CLI, a rank that never compiles) never trace. Where Dynamo is loaded
    already, torch's own function marks it; tests/unit/test_torch_compat.py checks on every
    tested torch that it sets exactly this attribute."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def register_symbolic_opaque(cls: type) -> None:
    """Register ``cls`` as an opaque type the graph carries as an input and never looks into
    (torch's Note [Opaque Objects]: "symbolic", formerly "reference")."""
    _register(cls, typ=_SYMBOLIC)


def _clamp_grad_at_limit() -> bool:
    x = torch.ones(1, requires_grad=True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(x.clamp(max=1.0), x)
    return bool(grad.item() != 0)


#: Whether ``torch.clamp`` passes the gradient of an element exactly at a limit (torch <= 2.14:
#: yes; 2.15: no). te_paged's fused clamped activations follow it, as Megatron's activations
#: do, which clamp with ``torch.clamp`` under autograd (docs/grouped.md, "Clamped activations").
CLAMP_GRAD_AT_LIMIT: bool = _clamp_grad_at_limit()


def top_saved_tensors_hooks() -> tuple[Callable, Callable] | None:
    """The innermost active ``saved_tensors_hooks`` context's ``(pack, unpack)``, or None
    (torch keeps one stack)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def backward_running() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recomputation inside
    backward, say)."""
    return torch._C._current_graph_task_id() != -1


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors (and other holders) reference ``t``'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)
