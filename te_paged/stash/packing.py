"""The manager's saved-tensor hooks: what a marked tensor becomes when autograd saves it, and
how it comes back in backward.

* capture step: the actual rows, exactly sized (:class:`_Captured`), the peaks recorded;
* later steps: a :class:`_Paged` handle, its rows copied into pages (``stash_copy``) on the
  pack stream, popped back (``stash_pop``) on first unpack, on the unpack stream, with the
  reload look-ahead prefetching earlier scopes' tensors (:class:`_Group`).

With ``skip_immediate_backward`` the capture step also learns which scopes are *immediate*:
scopes whose tensors are the first popped after the scope opened, before any other scope
opened (the last MoE layer of a plain step; under 1F1B, the last stage's last layer of every
microbatch; every layer of a full recompute). Scopes are named by the order they open in a
step, a host counter. In later steps an immediate scope's tensors stay as they are
(:class:`_Kept`): the copy into pages and the copy straight back are skipped, and the pools are
sized without them (:meth:`Packing._replay_capture`). A step whose order differs from the
capture step's warns once: the kept tensors are then held at their static size for longer.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch

from te_paged.kernels import stash_copy, stash_pop
from te_paged.kernels.layout import META_LEN, Flag
from te_paged.markers import (
    MarkerKind,
    grouped_tensor_marker,
    is_checkpoint_without_output_tensor,
)
from te_paged.stash.buffer import (
    StashKey,
    storage_dtype,
)
from te_paged.stash.pools import _Peak
from te_paged.stash.stats import StashMode
from te_paged.stash.streams import COMPUTE, PACK, UNPACK
from te_paged.telemetry import nvtx_range
from te_paged.torch_compat import storage_use_count, top_saved_tensors_hooks


class _Group:
    """The tensors one scope paged and not yet reloaded, for the reload look-ahead: ``prev``
    is the scope opened just before in the same forward pass (None at its first layer)."""

    __slots__ = ("handles", "layer", "prev")

    def __init__(self, layer: int | None, prev: _Group | None) -> None:
        self.handles: list[_Paged] = []
        self.layer = layer
        self.prev = prev


@dataclasses.dataclass(frozen=True)
class _Scope:
    max_num_tokens: int
    num_tokens: torch.Tensor
    avg_num_tokens: int
    layer: int | None  # names the NVTX ranges of the tensors paged in this scope
    index: int = 0  # the scope's place in the step's order of scopes (skip_immediate_backward)
    skip: bool = False  # an immediate scope in a paged step: its tensors are kept, not paged
    group: _Group | None = None  # with stream overlap: the look-ahead's view of this scope
    #: (storage, offset, shape, strides, dtype) -> (weak reference, version, handle) of what
    #: this scope paged: bytes two ops save (torchtitan's experts feed one input to two
    #: grouped GEMMs) are paged once.
    paged: dict = dataclasses.field(default_factory=dict)


class _Captured:
    """Capture-step stand-in for a paged tensor: the actual rows, exactly sized."""

    __slots__ = (
        "balanced", "dtype", "generation", "key", "max_rows", "reloaded", "rows", "rows_RH",
        "scale", "scope_index", "shape",
    )  # fmt: skip

    def __init__(self, **kw: object) -> None:
        self.reloaded: torch.Tensor | None = None
        for k, v in kw.items():
            setattr(self, k, v)


class _Kept:
    """Handle of a tensor an immediate scope keeps unpaged (``skip_immediate_backward``)."""

    __slots__ = ("scope_index", "tensor")

    def __init__(self, tensor: torch.Tensor, scope_index: int) -> None:
        self.tensor = tensor
        self.scope_index = scope_index


class _Paged:
    """Handle autograd keeps instead of a paged tensor; reloads it once, on first unpack."""

    __slots__ = (
        "buffer", "dtype", "generation", "group", "id", "layer", "max_rows", "meta", "pages_M",
        "reload_event", "reloaded", "shape", "used",
    )  # fmt: skip

    def __init__(self, **kw: object) -> None:
        self.reloaded: torch.Tensor | None = None
        self.group: _Group | None = None
        self.reload_event = None
        self.used = False  # the compute stream has waited for the reload
        for k, v in kw.items():
            setattr(self, k, v)


class Packing:
    """Part of :class:`~te_paged.stash.PagedStashManager` (mixed into it; uses its
    attributes): see the module docstring."""

    def _layout(self, t: torch.Tensor, kind: MarkerKind, scope: _Scope) -> tuple[StashKey, int]:
        per_row = kind.tokens_per_row
        if scope.max_num_tokens % per_row:
            raise ValueError(
                f"an MXFP8 scale-inverse has one row per {per_row} tokens, but "
                f"max_num_tokens={scope.max_num_tokens} is not a multiple of {per_row}: "
                f"pad the budget to a multiple of {per_row}"
            )
        max_rows = scope.max_num_tokens // per_row
        if t.numel() % max_rows:
            raise ValueError(
                f"marked saved tensor of shape {tuple(t.shape)} ({t.numel()} elements) is not "
                f"{max_rows} token rows (max_num_tokens={scope.max_num_tokens}, "
                f"{per_row} token(s) per row): only token-major [max_num_tokens, ...] tensors "
                "may be marked"
            )
        if t.shape[0] != max_rows:  # numel may divide for a transposed or reshaped tensor
            raise ValueError(
                f"marked saved tensor of shape {tuple(t.shape)} is not token-major: its first "
                f"dimension must be the scope's {max_rows} rows (max_num_tokens="
                f"{scope.max_num_tokens}, {per_row} token(s) per row); mark the [rows, ...] "
                "tensor itself, not a transposed or flattened view"
            )
        return StashKey(t.dtype, t.numel() // max_rows), max_rows

    def _pack(self, t: torch.Tensor) -> object:
        scope = self._scope
        kind = grouped_tensor_marker(t)
        if scope is None or kind is None:
            self._step_unmarked += 1
            return t
        return self._pack_kind(t, kind, scope)

    def _pack_kind(
        self, t: torch.Tensor, kind: MarkerKind, scope: _Scope, traced: bool = False
    ) -> object:
        """What autograd (or, ``traced``, a compiled graph's ticket) keeps of ``t``, marked
        ``kind``.

        A compiled graph owns its buffers: once ``t`` is past its last use there (this save),
        Inductor may hand its storage to a later tensor of the graph and write into it, with
        no free and no version bump. So for a traced save nothing may refer to ``t`` after
        the call: no deduplication by storage (a later tensor may wear the same address and
        version), a kept tensor is kept as a copy, and the copy into pages runs on the
        compute stream (a pack-stream copy would race with that write)."""
        if t.dim() == 0 or t.numel() == 0:
            return t
        if is_checkpoint_without_output_tensor(t):
            return t  # recompute owns this storage (and every view of it)
        self._check_device("a marked saved tensor", t)
        if traced:
            return self._pack_new(t, kind, scope, traced=True)
        # The same bytes saved again (the same tensor, or a view with its layout) while the
        # tensor paged first is alive, so its storage is: one copy serves both.
        layout = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        seen = scope.paged.get(layout)
        if seen is not None and seen[0]() is not None and seen[1] == t._version:
            return seen[2]
        handle = self._pack_new(t, kind, scope)
        scope.paged[layout] = (weakref.ref(t), t._version, handle)
        return handle

    def _pack_new(
        self, t: torch.Tensor, kind: MarkerKind, scope: _Scope, traced: bool = False
    ) -> object:
        key, max_rows = self._layout(t, kind, scope)
        self._check_step_boundary()
        if scope.skip:  # its backward comes first: nothing to gain from pages
            self._skipped += 1
            if self._pending is None:
                self._pending = (scope.index, scope.layer)
            return _Kept(t.clone(memory_format=torch.contiguous_format) if traced else t,
                         scope.index)  # fmt: skip
        rows_RH = t.contiguous().view(max_rows, key.hidden).view(storage_dtype(t.dtype))
        self._stashes += 1
        if self.mode is StashMode.CAPTURE:
            return self._capture_pack(t, key, kind, max_rows, rows_RH, scope)
        buffer = self.buffers.get(key)
        if buffer is None and key in self._peaks:
            raise RuntimeError(
                "the pools were freed by release() and not allocated again: call reset() at "
                "the step boundary before the next forward (it reallocates them)"
            )
        if buffer is None:
            raise RuntimeError(
                f"saved tensor with key {key} was not seen during the capture step (keys: "
                f"{sorted(map(str, self._peaks))}): every (dtype, hidden) the layers stash must "
                "appear in the first step, which sizes the pools; use a new manager for a model "
                "whose stashed tensors change"
            )
        self._count_static(key, max_rows, 1)
        pages_M = torch.empty(-(-max_rows // self.page_size), dtype=torch.int32, device=t.device)
        meta = torch.empty(META_LEN, dtype=torch.int64, device=t.device)
        args = (*buffer.kernel_args(), self.flags, pages_M, meta)
        self._tensor_ids += 1

        def copy() -> None:
            with nvtx_range("te_paged.stash", scope.layer):
                stash_copy(self.backend, rows_RH, scope.num_tokens, kind.tokens_per_row,
                           self.page_size, *args)  # fmt: skip

        if self._streams.overlap and not traced:
            self._stash_on_side(copy, self._tensor_ids, key, rows_RH, scope, (pages_M, meta))
        else:
            # On the compute stream (traced: see _pack_kind), after every pop that may have
            # freed the pages it takes.
            self._streams.wait(COMPUTE, self._last_side[UNPACK], "reuse after pop")
            copy()
        self._trace("stash", buffer, meta)
        handle = _Paged(
            id=self._tensor_ids,
            buffer=buffer,
            max_rows=max_rows,
            pages_M=pages_M,
            meta=meta,
            shape=t.shape,
            dtype=t.dtype,
            generation=self._generation,
            layer=scope.layer,
        )
        if scope.group is not None:
            handle.group = scope.group
            scope.group.handles.append(handle)
        return handle

    def _stash_on_side(
        self,
        copy,
        tid: int,
        key: StashKey,
        rows_RH: torch.Tensor,
        scope: _Scope,
        record: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Enqueue a stash copy on the pack stream (rules in :mod:`te_paged.stash.streams`)."""
        s = self._streams
        source, rec = ("source", tid), ("record", tid)
        s.note("produce", writes=[source, rec])  # the layer's output and the record's memory
        produced = s.record(COMPUTE)
        s.wait(PACK, produced, "stash after produce")
        s.wait(PACK, self._last_side[UNPACK], "reuse after pop")
        s.launch(PACK, copy, "stash", reads=[source],
                 writes=[("pages", tid), ("pool", key), rec, "flags"])  # fmt: skip
        self._last_side[PACK] = s.record(PACK)
        # The source (often a temporary .contiguous() copy) and the token count are freed by
        # the caller from now on: their memory must not be reused before the copy read them.
        s.keep_until(rows_RH, source, PACK, "keep source")
        s.keep_until(scope.num_tokens, source, PACK, "keep source")
        for t in record:
            s.keep_until(t, rec, PACK, "keep record")
        s.note("drop source", releases=[source])

    def _capture_pack(
        self,
        t: torch.Tensor,
        key: StashKey,
        kind: MarkerKind,
        max_rows: int,
        rows_RH: torch.Tensor,
        scope: _Scope,
    ) -> object:
        n = int(scope.num_tokens.item())  # the capture step may read counts on the host
        rows = -(-n // kind.tokens_per_row)
        if n < 0 or rows > max_rows:  # invalid input (the kernels flag it the same way)
            self.flags[Flag.INVALID] += 1
            rows = min(max(rows, 0), max_rows)
        self._capture_bytes += rows * key.hidden * rows_RH.element_size()
        balanced = min(max_rows, -(-scope.avg_num_tokens // kind.tokens_per_row))
        # A declared max_tokens_per_rank: this tensor as a microbatch of that many tokens would
        # make it (its rows scale with the tokens; avg_num_tokens is tokens x top-k).
        declared = self._declared_tokens
        scale = (
            max(1.0, declared / scope.avg_num_tokens) if declared and scope.avg_num_tokens else 1.0
        )
        handle = _Captured(
            scale=scale,
            key=key,
            max_rows=max_rows,
            rows=rows,
            rows_RH=rows_RH[:rows].clone(),
            shape=t.shape,
            dtype=t.dtype,
            balanced=balanced,
            generation=self._generation,
            scope_index=scope.index,
        )
        self._count_captured(handle, 1)
        return handle

    def _count_captured(self, h: _Captured, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) a captured tensor from its key's live counts and
        raise the peaks; a tensor of a scope found immediate counts in the every-tensor
        balanced peak only (the pools never hold it)."""
        peak = self._peaks.setdefault(h.key, _Peak())
        peak.max_rows = max(peak.max_rows, h.max_rows)
        peak.live_balanced_all += sign * h.balanced
        peak.peak_balanced_all = max(peak.peak_balanced_all, peak.live_balanced_all)
        if self.skip_immediate_backward:
            self._capture_log.append((h, sign))
        if h.scope_index not in self._immediate:
            self._count_pooled(peak, h, sign)

    def _count_pooled(self, peak: _Peak, h: _Captured, sign: int) -> None:
        peak.live_rows += sign * h.rows
        peak.live_pages += sign * -(-h.rows // self.page_size)
        peak.live_balanced += sign * h.balanced
        peak.live_balanced_pages += sign * -(-h.balanced // self.page_size)
        peak.live_static_pages += sign * -(-h.max_rows // self.page_size)
        peak.peak_rows = max(peak.peak_rows, peak.live_rows)
        peak.peak_pages = max(peak.peak_pages, peak.live_pages)
        peak.peak_balanced = max(peak.peak_balanced, peak.live_balanced)
        peak.peak_balanced_pages = max(peak.peak_balanced_pages, peak.live_balanced_pages)
        peak.peak_static_pages = max(peak.peak_static_pages, peak.live_static_pages)
        scaled = (h.balanced, h.rows, h.max_rows)
        live = tuple(
            was + sign * -(-math.ceil(rows * h.scale) // self.page_size)
            for was, rows in zip(peak.live_declared, scaled)
        )
        peak.live_declared = live
        peak.peak_declared = tuple(map(max, peak.peak_declared, live))

    def _replay_capture(self) -> None:
        """Recount the capture step's pool peaks so far without the immediate scopes' tensors:
        replaying its stashes and pops in order, as the pools will see them."""
        self._peaks = {
            key: _Peak(
                max_rows=p.max_rows,
                live_balanced_all=p.live_balanced_all,
                peak_balanced_all=p.peak_balanced_all,
            )
            for key, p in self._peaks.items()
        }
        for h, sign in self._capture_log:
            if h.scope_index not in self._immediate:
                self._count_pooled(self._peaks[h.key], h, sign)

    def _first_pop(self, scope_index: int | None) -> None:
        """Backward's first use of a tensor of scope ``scope_index`` (None: a paged tensor, in
        a step that pages): the capture step learns which scope is immediate; a paged step
        checks that the scope it kept is popped before any other."""
        if self._pending is None:
            return
        pending, layer = self._pending
        self._pending = None
        if self.mode is StashMode.CAPTURE:
            if scope_index == pending:
                self._immediate.add(pending)
                self._replay_capture()
        elif scope_index != pending:
            self._warn_skip_missed(layer)

    def _unpack(self, handle: object) -> torch.Tensor:
        if isinstance(handle, (_Paged, _Captured)) and handle.reloaded is None:
            if handle.generation != self._generation:
                raise RuntimeError(
                    "backward reached a tensor stashed before the last reset()/release(), "
                    "which handed its pages out again: it cannot be reloaded. Call reset() at "
                    "step boundaries only, after every backward of the step (the runners do)"
                )
        if isinstance(handle, _Kept):
            self._first_pop(handle.scope_index)
            return handle.tensor
        if isinstance(handle, _Paged):
            self._first_pop(None)
        if isinstance(handle, _Paged) and self._streams.overlap:
            return self._unpack_on_side(handle)
        if isinstance(handle, _Paged):
            if handle.reloaded is None:
                buffer = handle.buffer
                out_RH = torch.empty(
                    handle.max_rows,
                    buffer.key.hidden,
                    dtype=buffer.pool_NH.dtype,
                    device=buffer.device,
                )
                args = (*buffer.kernel_args(), self.flags, handle.pages_M, handle.meta)
                with nvtx_range("te_paged.pop", handle.layer):
                    stash_pop(self.backend, out_RH, self.page_size, *args, self.zero_padding)
                self._trace("pop", buffer, handle.meta)
                handle.reloaded = out_RH.view(handle.dtype).view(handle.shape)
                self._count_static(buffer.key, handle.max_rows, -1)
                self._pops += 1
            return handle.reloaded
        if isinstance(handle, _Captured):
            if handle.reloaded is None:
                out_RH = torch.empty(
                    handle.max_rows,
                    handle.key.hidden,
                    dtype=handle.rows_RH.dtype,
                    device=handle.rows_RH.device,
                )
                out_RH[: handle.rows].copy_(handle.rows_RH)
                if self.zero_padding:
                    out_RH[handle.rows :].zero_()
                self._first_pop(handle.scope_index)
                self._count_captured(handle, -1)
                handle.rows_RH = None
                handle.reloaded = out_RH.view(handle.dtype).view(handle.shape)
                self._pops += 1
            return handle.reloaded
        return handle

    def _unpack_on_side(self, handle: _Paged) -> torch.Tensor:
        """Reload ``handle`` (and the rest of its scope) on the unpack stream if not yet done,
        prefetch the ``reload_lookahead`` scopes before it, then make the compute stream wait
        for ``handle``'s reload, once."""
        group = handle.group
        if handle.reloaded is None:
            for h in [handle, *(group.handles if group is not None else ())]:
                if h.reloaded is None:
                    self._reload(h)
        prev = group.prev if group is not None else None
        for _ in range(self.reload_lookahead):
            if prev is None:
                break
            for h in list(prev.handles):
                if h.reloaded is None and h.generation == self._generation:
                    self._reload(h)
            prev = prev.prev
        if not handle.used:
            self._streams.wait(COMPUTE, handle.reload_event, "use after reload")
            handle.used = True
        self._streams.note("use reload", reads=[("reload", handle.id)])
        return handle.reloaded

    def _reload(self, handle: _Paged) -> None:
        """Enqueue ``handle``'s pop on the unpack stream into a buffer allocated on the compute
        stream; its pages go back to the free list when the pop completes."""
        s, buffer = self._streams, handle.buffer
        tid = handle.id
        reload, rec = ("reload", tid), ("record", tid)
        out_RH = torch.empty(
            handle.max_rows, buffer.key.hidden, dtype=buffer.pool_NH.dtype, device=buffer.device
        )
        s.note("allocate reload", writes=[reload])
        allocated = s.record(COMPUTE)
        args = (*buffer.kernel_args(), self.flags, handle.pages_M, handle.meta)

        def pop() -> None:
            with nvtx_range("te_paged.pop", handle.layer):
                stash_pop(self.backend, out_RH, self.page_size, *args, self.zero_padding)

        s.wait(UNPACK, allocated, "reload after alloc")
        s.wait(UNPACK, self._last_side[PACK], "pop after stash")
        s.launch(UNPACK, pop, "pop", reads=[("pages", tid), rec, "flags"],
                 writes=[reload, ("pool", buffer.key)])  # fmt: skip
        handle.reload_event = self._last_side[UNPACK] = s.record(UNPACK)
        # Freed on the compute stream whenever autograd drops them (a prefetched reload that
        # backward never uses included): not reused before the pop completed.
        s.keep_until(out_RH, reload, UNPACK, "keep reload")
        for t in (handle.pages_M, handle.meta):
            s.keep_until(t, rec, UNPACK, "keep record")
        s.note("drop record", releases=[rec])
        s.note("drop reload", releases=[reload])
        handle.reloaded = out_RH.view(handle.dtype).view(handle.shape)
        if handle.group is not None:
            handle.group.handles.remove(handle)  # the look-ahead keeps no reload alive
        self._trace("pop", buffer, handle.meta)
        self._count_static(buffer.key, handle.max_rows, -1)
        self._pops += 1

    # -------------------------------------------------- compiled graphs (te_paged.kernels.compiled)

    def _save_ticket(self, t: torch.Tensor, kind: MarkerKind, sid: int | None) -> int:
        """``te_paged::save``'s body: pack ``t`` as the hooks would, into the traced scope
        ``sid`` (None: the eager scope open around the compiled code), keep the handle under a
        ticket, return the ticket's number."""
        if sid is None:
            scope, outside = self._scope, self._scope_owned_outside
        elif sid in self._traced_scopes:
            scope = self._traced_scopes[sid]
            outside = scope is None
        else:
            raise RuntimeError(
                f"a compiled graph saved into paged-stash scope {sid}, which is gone: reset() "
                "or release() ran between the scope's opening and its saves"
            )
        if scope is not None:
            handle = self._pack_kind(t, kind, scope, traced=True)
        elif outside:  # an outer saved_tensors_hooks context owns it
            hooks = top_saved_tensors_hooks()
            handle = _Outer(hooks[0](t), hooks[1])
        else:
            raise RuntimeError(
                "a compiled graph saved a marked tensor while no paged-stash scope was open: "
                "it was compiled inside an eager scope and runs outside one"
            )
        self._ticket_ids += 1
        self._tickets[self._ticket_ids] = handle
        return self._ticket_ids

    def _load_ticket(self, tid: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``te_paged::load``'s body: the tensor the ticket's handle unpacks to, contiguous (the
        graph was compiled for the fake's strides) and shared with no other tensor (the
        compiler may reuse an op's output in place): copied where either does not hold (a
        tensor an outer hook gave back that it also keeps, a view whose base lives on)."""
        handle = self._tickets.pop(tid, None)
        if handle is None:
            raise RuntimeError(
                "a compiled backward loaded a paged-stash ticket that is gone: reset() or "
                "release() ran between its forward and its backward (call them at step "
                "boundaries only, after every backward of the step), or it was loaded twice"
            )
        if isinstance(handle, _Outer):
            out = handle.unpack(handle.packed)
        elif isinstance(handle, torch.Tensor):
            out = handle
        else:
            out = self._unpack(handle)
        if out.shape != shape or out.dtype != dtype:
            raise RuntimeError(
                f"a paged-stash ticket unpacked to {tuple(out.shape)} {out.dtype}, but the "
                f"compiled graph expects {shape} {dtype}"
            )
        if not out.is_contiguous() or not _exclusive(out):
            out = out.clone(memory_format=torch.contiguous_format)
        return out


class _Outer:
    """Handle of a tensor an outer ``saved_tensors_hooks`` context packed (``save_on_cpu``, a
    non-reentrant checkpoint) for a compiled graph's ticket: its own hooks, as eager's."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed: object, unpack) -> None:
        self.packed = packed
        self.unpack = unpack


def _exclusive(t: torch.Tensor) -> bool:
    """Whether no other tensor shares ``t``'s storage: the count is ``t``'s own reference, the
    temporary storage object this call makes, and a view's base (a reload is a view of the
    buffer the pop wrote, which nothing else holds)."""
    own = 2 + (t._base is not None)
    return storage_use_count(t) <= own
