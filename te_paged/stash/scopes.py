"""The manager's saved-tensor scope: what opens and closes around each expert group's forward
(:meth:`Scopes.scope`), eager (hooks installed: :class:`_EagerScope`) or traced by
``torch.compile`` (``te_paged::scope_enter``: :meth:`Scopes._open_traced_scope`), and the
evidence of which kind ran (:attr:`Scopes.traced_scopes`). A mixin of
:class:`~te_paged.stash.manager.PagedStashManager`, whose state it reads and writes."""

from __future__ import annotations

import contextlib
import warnings

import torch

from te_paged.config.checks import require_int
from te_paged.kernels.compiled import StashSite, TracedScope, pop_scope_port, push_scope_port
from te_paged.kernels.layout import Flag
from te_paged.stash.packing import _Group, _Scope
from te_paged.stash.stats import StashMode
from te_paged.torch_compat import check_compile_release, top_saved_tensors_hooks

__all__ = ["Scopes"]


class Scopes:
    """The scope half of :class:`~te_paged.stash.manager.PagedStashManager`."""

    @property
    def traced_scopes(self) -> int:
        """Scopes with grad enabled that compiled code opened since the last ``reset()``
        (``te_paged::scope_enter`` runs as an op of the graph, at every step): the evidence
        that the step runs compiled code, whatever the user compiled (a module, a function
        that calls the layers, the whole step). A host counter, no read."""
        return self._step_scopes_traced

    def scope(
        self,
        max_num_tokens: int,
        num_tokens: torch.Tensor,
        avg_num_tokens: int,
        *,
        layer: int | StashSite | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Page the marked tensors autograd saves inside this block.

        ``max_num_tokens`` is the static row count of the expert buffers, ``num_tokens`` a
        tensor on the manager's device holding the actual count (a prefix), ``avg_num_tokens``
        the balanced-case estimate used to size the pools. ``layer`` (the expert module's
        ``layer_number``, or a :class:`~te_paged.kernels.compiled.StashSite` that reads it when
        the scope opens) names the NVTX ranges of the stashes and pops
        (``te_paged.stash.layer<N>``).

        Saved tensors that an outer ``saved_tensors_hooks`` already owns are left to it: inside
        torch's non-reentrant checkpoint (its first forward and its recomputation) or
        ``save_on_cpu``, the scope installs nothing (and a step that pages nothing for that
        reason says so: :meth:`paged_nothing`). Otherwise the inner hooks would win, and a
        checkpointed layer would be paged twice, its recomputed tensors never popped (pages
        held to the step's end, the pool sized double). A reentrant checkpoint (Megatron's
        full and ``moe`` recompute) runs its first forward without grad, saving nothing, and
        its recomputation in backward with no outer hooks: that forward is paged and popped
        layer by layer.

        Under ``torch.compile`` the block's autograd functions page their own saved tensors
        and the scope opens and closes as ops of the graph (:mod:`te_paged.kernels.compiled`).
        """
        if self._disabled_depth:
            return contextlib.nullcontext()
        compiling = torch.compiler.is_compiling()
        if compiling:
            check_compile_release()
        self._check_scope_args(max_num_tokens, num_tokens, avg_num_tokens, layer)
        if compiling:
            site, number = (layer, -1) if isinstance(layer, StashSite) else (self._site, layer)
            return TracedScope(
                self._port, site, max_num_tokens, num_tokens.reshape(1), avg_num_tokens,
                -1 if number is None else number,
            )  # fmt: skip
        if type(layer) is StashSite:
            layer = layer.layer
        return _EagerScope(self, (max_num_tokens, num_tokens, avg_num_tokens, layer))

    def _check_scope_args(self, max_num_tokens, num_tokens, avg_num_tokens, layer) -> None:
        if not isinstance(num_tokens, torch.Tensor) or num_tokens.numel() != 1:
            raise TypeError("num_tokens must be a one-element integer tensor on the device")
        if num_tokens.dtype.is_floating_point or num_tokens.dtype == torch.bool:
            raise TypeError(f"num_tokens must be an integer tensor, got {num_tokens.dtype}")
        self._check_device("num_tokens", num_tokens)
        require_int("max_num_tokens", max_num_tokens, minimum=1)
        require_int("avg_num_tokens", avg_num_tokens, minimum=0)
        if layer is not None and not isinstance(layer, StashSite):
            require_int("layer", layer, minimum=0)

    def _open_scope(
        self,
        max_num_tokens: int,
        num_tokens: torch.Tensor,
        avg_num_tokens: int,
        layer: int | None,
        grad_enabled: bool | None = None,
        *,
        traced: bool = False,
    ) -> bool:
        """Open the scope (checked arguments); False where an outer ``saved_tensors_hooks``
        owns what autograd saves. Eager calls it from :meth:`scope`, a compiled graph from
        ``te_paged::scope_enter`` (with the grad mode the block was traced in)."""
        if self._scope is not None:
            raise RuntimeError("paged-stash scopes do not nest: one scope per expert group")
        if grad_enabled is None:
            grad_enabled = torch.is_grad_enabled()
        if grad_enabled:
            self._step_scopes += 1
            self._step_scopes_traced += int(traced)
        if _saved_tensors_owned_outside():
            self._step_scopes_outside += int(grad_enabled)
            self._scope_owned_outside = True
            return False
        index = self._scopes_opened
        skip = False
        # Scopes that cannot save (no grad: evaluation, a reentrant checkpoint's first forward)
        # do not count, so an evaluation forward does not shift the order the capture learned.
        if self.skip_immediate_backward and grad_enabled:
            self._scopes_opened += 1
            if self.mode is StashMode.CAPTURE:
                self._pending = (index, layer)  # immediate if its tensors are popped first
            else:
                if self._pending is not None:  # a kept scope's backward did not come first
                    self._warn_skip_missed(self._pending[1])
                    self._pending = None
                skip = index in self._immediate
                if skip:  # its tensors never reach the copy kernel: its count check, alike
                    n = num_tokens.reshape(1)
                    self.flags[Flag.INVALID] += ((n < 0) | (n > max_num_tokens)).sum()
        group = None
        if self._streams.overlap and self.mode is StashMode.CAPTURED:
            last = self._last_group
            same_pass = last is not None and (
                layer is None or last.layer is None or last.layer < layer
            )  # layer numbers rise through a forward pass; a fall starts a new one
            group = self._last_group = _Group(layer, last if same_pass else None)
        self._scope = _Scope(
            max_num_tokens, num_tokens.reshape(1), avg_num_tokens, layer, index, skip, group
        )
        # Kept (a reference, no copy) for invalid_counts(): which layer an INVALID flag came from.
        self._step_counts.append((layer, self._scope.num_tokens, max_num_tokens))
        return True

    def _close_scope(self) -> None:
        scope = self._scope
        if scope is not None and not scope.paged and not scope.skip:
            # It saved no marked tensor, so no copy kernel checked its count: check it here
            # (a device op, no read), as every scope's is (docs/design.md, "The manager and
            # its scope").
            n = scope.num_tokens
            self.flags[Flag.INVALID] += ((n < 0) | (n > scope.max_num_tokens)).sum()
        self._scope, self._scope_owned_outside = None, False

    def _open_traced_scope(
        self,
        max_num_tokens: int,
        num_tokens: torch.Tensor,
        avg_num_tokens: int,
        layer: int | None,
        grad_enabled: bool,
    ) -> int:
        """``te_paged::scope_enter``'s body: open a scope as :meth:`_open_scope` does, kept by
        its id (what the graph's saves into it carry) until :meth:`reset`, not as the open
        scope: a compiled graph's ops run in the order of their data, not of the program, so a
        traced scope has no close (te_paged.kernels.compiled). An eager scope open around the
        compiled code is left as it is."""
        self._traced_ids += 1
        sid = self._traced_ids
        eager = self._scope, self._scope_owned_outside
        self._scope, self._scope_owned_outside = None, False
        try:
            opened = self._open_scope(
                max_num_tokens, num_tokens, avg_num_tokens, layer, grad_enabled, traced=True
            )
            self._traced_scopes[sid] = self._scope if opened else None  # None: outer hooks'
        finally:
            self._scope, self._scope_owned_outside = eager
        return sid

    def _warn_skip_missed(self, layer: int | None) -> None:
        if self._warned_skip_missed:
            return
        self._warned_skip_missed = True
        where = f"layer {layer}" if layer is not None else "a scope"
        warnings.warn(
            f"PagedStashManager: skip_immediate_backward kept {where}'s saved tensors unpaged, "
            "since in the capture step its backward came right after its forward; in this step "
            "another layer's forward or backward came first (the schedule changed since the "
            "capture step). Gradients are unaffected, but those tensors stay at their static "
            "size until their backward, above what the pools were sized for. Run every step "
            "with the capture step's schedule, or set skip_immediate_backward=False.",
            RuntimeWarning,
            stacklevel=4,
        )


class _EagerScope:
    """:meth:`PagedStashManager.scope` in eager mode: the scope opened, its hooks installed and
    its port pushed (a function compiled inside the block pages through it); a class, not a
    generator: a layer opens one a step, and this is the host path of every one."""

    __slots__ = ("_args", "_hooks", "_manager")

    def __init__(self, manager: Scopes, args: tuple) -> None:
        self._manager, self._args, self._hooks = manager, args, None

    def __enter__(self) -> None:
        manager = self._manager
        if not manager._open_scope(*self._args):
            return
        hooks = torch.autograd.graph.saved_tensors_hooks(manager._pack, manager._unpack)
        hooks.__enter__()
        self._hooks = hooks
        push_scope_port(manager._port)

    def __exit__(self, *exc: object) -> bool:
        try:
            if self._hooks is not None:
                pop_scope_port()
                self._hooks.__exit__(*exc)
        finally:
            self._manager._close_scope()
        return False


def _saved_tensors_owned_outside() -> bool:
    """Whether a ``saved_tensors_hooks`` context is already active (torch keeps one stack)."""
    return top_saved_tensors_hooks() is not None
