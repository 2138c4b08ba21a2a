"""The paged stash under ``torch.compile``: te_paged's autograd functions page their own saved
tensors through ``torch.library`` ops, so that compiled and eager page the same tensors.

Why not the saved-tensor hooks eager uses: Dynamo turns ambient ``saved_tensors_hooks`` off
while it traces (pytorch#123196), and what a compiled region saves are the partitioner's
choice of graph values, not the objects te_paged's producers marked. AOTAutograd can inline
hooks into a graph (pytorch#150032), but only hooks that are themselves fixed graphs of one
saved tensor: they cannot read a scope's token count nor the pool a step grew. So under
compile the producers page explicitly:

``save_for_backward(ctx, *tensors)`` / ``saved_tensors(ctx)``
    What te_paged's autograd functions call instead of ``ctx.save_for_backward`` /
    ``ctx.saved_tensors``. Eager: exactly those (the scope's hooks page the marked ones).
    While Dynamo traces inside a scope: each marked tensor is handed to ``te_paged::save``,
    which returns a *ticket* (an int64 ``[1]`` tensor on the CPU) saved in its place, and
    backward's ``te_paged::load`` turns the ticket back into the tensor.

The ops (effectful: never dropped, never recomputed by the partitioner)::

    scope_enter(num_tokens, port, site, layer, max_num_tokens, avg_num_tokens, grad_enabled)
        -> scope                                          # the scope's id (int64 [1], CPU)
    save(t, scope, port, tokens_per_row) -> ticket      # forward, inside that scope
    load(ticket, port, shape, dtype, device) -> tensor  # backward
    flag_add(value, port, flag)                         # a count into the manager's flags
    host_call(t, call, args)                            # a host-side counter (HostCall)

Their order is carried by data, not by program order: a save takes its scope's id, a load its
ticket. Inductor does not keep effectful ops in program order (it ran a scope's exit before
its saves, and an op with no output before them all), so nothing here relies on it: a traced
scope is never closed, the manager keeps it by id until ``reset()``.

``port`` is the manager as a *symbolic* opaque object (:class:`StashPort`, torch's Note
[Opaque Objects]): a graph input the compiler never looks into. Each op's body runs, at run
time, the very code eager runs from its hooks (:mod:`te_paged.stash.packing`): the capture
step's exact-size copies, the paged steps' one copy and one pop kernel (which read every count
on the device), ``skip_immediate_backward``, the stream overlap, the outer-hooks rule. Nothing
of the manager's state is a graph value: the pools grow and are reallocated between steps, live
across the forward and backward graphs, and are written by kernels the compiler cannot see; as
graph inputs they would be functionalised (copied whole under ``aot_eager``) and saved for
backward as snapshots. So one graph serves the capture step and every paged step; the manager's
mode is not a guard. What is a guard: whether stashing is on (``manager.enabled``: a dropless
rerun compiles once, a graph with no stash ops) and the layer's shapes.

``site`` (:class:`StashSite`) names the layer a scope belongs to at run time (its NVTX ranges,
``skip_immediate_backward``'s warning), so that layers that share compiled code (torchtitan
compiles each block, one code object) share one graph instead of one per layer number.

A ticket's handle is freed by its load; ``reset()`` drops the tickets of a step whose backward
never ran. A load hands out memory no other tensor shares (a tensor kept unpaged whose storage
is still referenced elsewhere, or a reload two tickets share, is copied), since the compiler may
write into an op's output in place.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from te_paged.markers import MarkerKind, grouped_tensor_marker, mark_grouped_tensor
from te_paged.torch_compat import OpaqueBase, check_compile_release, register_symbolic_opaque

__all__ = [
    "HostCall",
    "StashPort",
    "StashSite",
    "compile_used",
    "host_call",
    "open_scope_port",
    "paged_product",
    "save_for_backward",
    "saved_tensors",
]


class StashPort(OpaqueBase):
    """A :class:`~te_paged.stash.PagedStashManager` as a custom op argument (a symbolic
    opaque object: the graph carries it, the op bodies use it). Holds the manager weakly."""

    def __init__(self, manager: Any) -> None:
        self._manager = weakref.ref(manager)

    @property
    def manager(self) -> Any:
        manager = self._manager()
        if manager is None:
            raise RuntimeError("a compiled graph ran a paged-stash op of a manager that is gone")
        return manager


class StashSite(OpaqueBase):
    """Where a scope opens: a layer whose ``layer_number`` is read when the scope opens (so that
    Megatron's ``set_layer_number`` after compiling still names the layer), or a fixed one."""

    def __init__(self, owner: object = None, layer: int | None = None) -> None:
        self._owner = None if owner is None else weakref.ref(owner)
        self._layer = layer

    @property
    def layer(self) -> int | None:
        owner = None if self._owner is None else self._owner()
        return self._layer if owner is None else getattr(owner, "layer_number", None)


class HostCall(OpaqueBase):
    """A host-side update as a custom op argument: ``fn(tensor or None, *ints)`` run when the
    op runs (``te_paged::host_call``). For counters kept on the host (an all-to-all's bytes) that
    a traced region must not turn into guarded constants: an int Dynamo reads and changes
    would be guarded on, and every step would compile again."""

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn


for _cls in (StashPort, StashSite, HostCall):
    register_symbolic_opaque(_cls)
_CALL = f"{HostCall.__module__}.{HostCall.__qualname__}"
_PORT = f"{StashPort.__module__}.{StashPort.__qualname__}"
_SITE = f"{StashSite.__module__}.{StashSite.__qualname__}"

_LIB = torch.library.Library("te_paged", "FRAGMENT")
# Their bodies run Python on the host (the manager's bookkeeping, the tickets): a CUDA graph
# would replay their kernels without it. Inductor's CUDA graphs (mode="reduce-overhead") then
# leave them out: partitioned around them where Inductor partitions, else not captured.
_UNSAFE = (torch.Tag.cudagraph_unsafe,)
for _schema in (
    f"scope_enter(Tensor num_tokens, {_PORT} port, {_SITE} site, int layer, "
    "int max_num_tokens, int avg_num_tokens, bool grad_enabled) -> Tensor",
    f"save(Tensor t, Tensor? scope, {_PORT} port, int tokens_per_row) -> Tensor",
    f"load(Tensor ticket, {_PORT} port, SymInt[] shape, ScalarType dtype, Device device) -> Tensor",
    f"flag_add(Tensor value, {_PORT} port, int flag) -> Tensor",
    f"host_call(Tensor? t, {_CALL} call, int[] args) -> Tensor",
):
    _LIB.define(_schema, tags=_UNSAFE)


def _done() -> torch.Tensor:
    """What the ops that only act return: an effectful op with no output is dropped from
    Inductor's effect chain (it ran after ops that followed it)."""
    return torch.empty(0, dtype=torch.int64)


def _scope_enter(num_tokens, port, site, layer, max_num_tokens, avg_num_tokens, grad_enabled):
    sid = port.manager._open_traced_scope(
        max_num_tokens, num_tokens, avg_num_tokens, site.layer if layer < 0 else layer,
        grad_enabled,
    )  # fmt: skip
    return _number(sid, "te_paged_scope")


def _number(n: int, attr: str) -> torch.Tensor:
    """``n`` as an int64 ``[1]`` CPU tensor, and as an attribute of that tensor object, which
    autograd or the graph hands to the op that reads it: no host read of the tensor (an
    outer hook may have copied it, then the value is read)."""
    out = torch.tensor([n], dtype=torch.int64)
    setattr(out, attr, n)
    return out


def _read(t: torch.Tensor, attr: str) -> int:
    n = getattr(t, attr, None)
    return int(t[0]) if n is None else n


def _save(t, scope, port, tokens_per_row) -> torch.Tensor:
    sid = None if scope is None else _read(scope, "te_paged_scope")
    tid = port.manager._save_ticket(t, MarkerKind(tokens_per_row), sid)
    return _number(tid, "te_paged_ticket")


def _load(ticket, port, shape, dtype, device) -> torch.Tensor:
    return port.manager._load_ticket(_read(ticket, "te_paged_ticket"), tuple(shape), dtype)


def _flag_add(value, port, flag) -> torch.Tensor:
    port.manager.flags[flag] += value.reshape(()).to(torch.int64)
    return _done()


def _host_call(t, call, args) -> torch.Tensor:
    call.fn(t, *args)
    return _done()


for _name, _fn in (
    ("scope_enter", _scope_enter),
    ("save", _save),
    ("load", _load),
    ("flag_add", _flag_add),
    ("host_call", _host_call),
):
    _LIB.impl(_name, _fn, "CompositeExplicitAutograd")
    torch.library._register_effectful_op(f"te_paged::{_name}", torch.library.EffectType.ORDERED)


@torch.library.register_fake("te_paged::scope_enter")
def _(num_tokens, port, site, layer, max_num_tokens, avg_num_tokens, grad_enabled):
    return torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.register_fake("te_paged::save")
def _(t, scope, port, tokens_per_row) -> torch.Tensor:
    return torch.empty(1, dtype=torch.int64, device="cpu")


@torch.library.register_fake("te_paged::load")
def _(ticket, port, shape, dtype, device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


@torch.library.register_fake("te_paged::flag_add")
def _(value, port, flag) -> torch.Tensor:
    return _done()


@torch.library.register_fake("te_paged::host_call")
def _(t, call, args) -> torch.Tensor:
    return _done()


def host_call(call: HostCall, t: torch.Tensor | None, *args: int) -> None:
    """``call.fn(t, *args)``: now in eager; under torch.compile an op of the graph, run in
    program order when the graph runs."""
    if torch.compiler.is_compiling():
        check_compile_release()
        torch.ops.te_paged.host_call(t, call, list(args))
    else:
        call.fn(t, *args)


# The scopes open now, innermost last, as ``(port, scope id tensor or None)``: an eager scope
# pushes its manager's port while its hooks are installed (no id: the manager's open scope), a
# traced scope its port and the id ``te_paged::scope_enter`` returned, while Dynamo traces its
# block. What Dynamo reads here at trace time decides whether a function it traces pages its
# saved tensors; it guards on it, so a function compiled outside any scope and later called
# inside one compiles again (once). Process-wide like torch's own saved-tensor hooks stack,
# and for the same reason: the autograd functions that consult it are not handed the manager.
_OPEN: list[tuple[StashPort, torch.Tensor | None]] = []


def compile_used() -> bool:
    """Whether torch.compile built a graph in this process (Dynamo's own counters; only where
    Dynamo is already imported, which compiling does)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and utils.counters["stats"]["unique_graphs"] > 0


def open_scope_port() -> StashPort | None:
    """The port of the innermost open scope (eager or traced), or None."""
    return _OPEN[-1][0] if _OPEN else None


def push_scope_port(port: StashPort) -> None:
    """An eager scope opened (its hooks installed): functions traced inside it page through
    ``port``. Paired with :func:`pop_scope_port`."""
    _OPEN.append((port, None))


def pop_scope_port() -> None:
    _OPEN.pop()


class TracedScope:
    """``manager.scope(...)`` while Dynamo traces: the scope opens at run time
    (``te_paged::scope_enter``, which returns its id), and the functions traced inside the
    block page their marked saved tensors into it (:func:`save_for_backward`: each save takes
    the id, so it runs after the scope opened whatever order the compiler picks)."""

    def __init__(self, port: StashPort, site: StashSite, max_num_tokens: int,
                 num_tokens: torch.Tensor, avg_num_tokens: int, layer: int) -> None:  # fmt: skip
        self.port, self.site, self.layer = port, site, layer
        self.max_num_tokens, self.num_tokens = max_num_tokens, num_tokens
        self.avg_num_tokens = avg_num_tokens

    def __enter__(self) -> None:
        sid = torch.ops.te_paged.scope_enter(
            self.num_tokens, self.port, self.site, self.layer, self.max_num_tokens,
            self.avg_num_tokens, torch.is_grad_enabled(),
        )  # fmt: skip
        _OPEN.append((self.port, sid))

    def __exit__(self, *exc: object) -> bool:
        _OPEN.pop()
        return False


def save_for_backward(ctx: Any, *tensors: torch.Tensor | None) -> None:
    """``ctx.save_for_backward(*tensors)`` that pages the marked ones under ``torch.compile``
    too (see the module docstring); read them back with :func:`saved_tensors`."""
    port, sid = _OPEN[-1] if _OPEN and torch.compiler.is_compiling() else (None, None)
    # A stand-in ctx of a fused function (te_paged.moe.fused_mlp) only collects: the fused
    # function pages what it keeps of them, once.
    if port is None or getattr(ctx, "defer_paging", False) or not any(ctx.needs_input_grad):
        ctx.save_for_backward(*tensors)
        return
    saved, loads = [], []
    for t in tensors:
        kind = None if t is None else grouped_tensor_marker(t)
        if kind is None or t.numel() == 0:
            saved.append(t)
            loads.append(None)
            continue
        saved.append(torch.ops.te_paged.save(t, sid, port, kind.tokens_per_row))
        loads.append((tuple(t.shape), t.dtype, t.device))
    ctx.te_paged_loads = (port, tuple(loads))
    ctx.save_for_backward(*saved)


class _PagedProduct(torch.autograd.Function):
    """``(a · b).to(dtype)`` that saves what autograd's product saves — ``b`` when ``a`` needs a
    gradient, ``a`` when ``b`` does — itself (paged when ``paged``; both token-major), and
    differentiates it in backward with ``torch.func.vjp``: autograd's own formulas, from the
    same saved values. An operand not saved enters the vjp as a zero of its shape (a stride-0
    view, no memory): the product's gradient for the other one does not read it."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None, paged: bool):
        need_a, need_b = ctx.needs_input_grad[:2]
        saved = [t.view_as(t) if keep else None for t, keep in ((a, need_b), (b, need_a))]
        if paged:
            mark_grouped_tensor(*saved)
        save_for_backward(ctx, *saved)
        ctx.dtype = dtype
        ctx.metas = tuple((t.shape, t.dtype) for t in (a, b))
        return _product(a, b, dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        operands = [
            t if t is not None else dy.new_zeros((), dtype=dtype).expand(shape)
            for t, (shape, dtype) in zip(saved_tensors(ctx), ctx.metas)
        ]
        _, vjp = torch.func.vjp(lambda a, b: _product(a, b, ctx.dtype), *operands)
        da, db = vjp(dy)
        need_a, need_b = ctx.needs_input_grad[:2]
        return (da if need_a else None), (db if need_b else None), None, None


def _product(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    y = a * b
    return y if dtype is None else y.to(dtype)


def paged_product(a: torch.Tensor, b: torch.Tensor, *, dtype: torch.dtype | None = None,
                  paged: bool) -> torch.Tensor:  # fmt: skip
    """``(a · b).to(dtype)`` (``dtype`` None: the promoted one) for a producer whose product's
    token-major operands are marked for the stash (eager: ``mark_grouped_tensor`` on fresh
    aliases of both, then the product, exactly what the producers did). Under torch.compile,
    where the compiler, not the marked objects, decides what a plain op saves, it runs as one
    autograd function that saves (and pages) what autograd's product would have saved."""
    if torch.compiler.is_compiling():
        return _PagedProduct.apply(a, b, dtype, bool(paged))
    if paged:
        a, b = a.view_as(a), b.view_as(b)
        mark_grouped_tensor(a, b)
    return _product(a, b, dtype)


def saved_tensors(ctx: Any) -> tuple[torch.Tensor | None, ...]:
    """``ctx.saved_tensors``, with what :func:`save_for_backward` paged loaded back."""
    saved = ctx.saved_tensors
    loads = getattr(ctx, "te_paged_loads", None)
    if loads is None:
        return saved
    port, metas = loads
    return tuple(
        t if m is None else torch.ops.te_paged.load(t, port, *m) for t, m in zip(saved, metas)
    )
