"""The device-initiated grouped GEMMs behind ``GroupedLinear``: ``_GroupedLinearFn`` and helpers.

Shape suffixes: ``T`` rows (the static ``max_num_tokens``; real rows a prefix), ``I``
in_features, ``O`` out_features, ``E`` GEMMs (experts), ``K`` width of the ones matrix that turns
the bias gradient into a GEMM on CUDA (``16 / itemsize``, the narrowest 16-byte-aligned width).
See :mod:`te_paged.grouped.grouped_linear` for the paths and their numerics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from te_paged.grouped.fp8 import Fp8Recipe, Fp8Tensor, dequantize, mark_fp8_saved, quantize
from te_paged.grouped.grouped_tensor import (
    align_groups,
    group_ids_from_offsets,
    row_mask_from_offsets,
)
from te_paged.kernels.compiled import save_for_backward, saved_tensors
from te_paged.markers import mark_grouped_tensor

__all__ = [
    "DgradInto",
    "FakeQuant",
    "FnOptions",
    "GradTo",
    "GroupedLinearFn",
    "LegacyMxfp8Linear",
    "MainGradSink",
    "Splits",
    "grouped_mm",
    "stack_params",
]

Splits = torch.Tensor | Sequence[int]
_ALIGN_BYTES = 16  # torch._grouped_mm needs every stride a multiple of 16 bytes


def _aligned(t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``t``: every stride a multiple of 16 bytes."""
    step = _ALIGN_BYTES // t.element_size()
    return all(s % step == 0 for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1)


def _with_aligned_strides(t: torch.Tensor) -> torch.Tensor:
    """The same values in a zero-padded buffer whose last-dim storage is 16-byte aligned (a view
    of the original shape: the GEMM's sizes, and so its arithmetic, are unchanged)."""
    step = _ALIGN_BYTES // t.element_size()
    last = t.shape[-1]
    buf = t.new_zeros(*t.shape[:-1], -(-last // step) * step)
    buf[..., :last] = t
    return buf[..., :last]


def _gmm_per_group(a: torch.Tensor, b: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` as one ``mm`` per group (host offsets: CPU tensors only, where
    reading them is no synchronisation), for operands whose strides it rejects."""
    ends = offsets_E.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:  # a [T, K] x b [E, K, N] -> [T, N]; rows past the last end stay zero
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (r0, r1) in enumerate(zip(starts, ends)):
            out[r0:r1] = a[r0:r1] @ b[g]  # not mm(out=...): that takes another BLAS path
        return out
    out = a.new_empty(len(ends), a.shape[0], b.shape[1])  # a [K, T] x b [T, N] -> [E, K, N]
    for g, (r0, r1) in enumerate(zip(starts, ends)):
        torch.mm(a[:, r0:r1], b[r0:r1], out=out[g])
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Grouped GEMM for any feature sizes. ``torch._grouped_mm`` needs 16-byte aligned strides:
    on CUDA (and under torch.compile) unaligned operands are copied into aligned storage (same
    sizes, no host read); eager on CPU they run one ``mm`` per group, bit for bit what
    ``_grouped_mm`` computes for aligned ones and what the legacy path computes."""
    if not (_aligned(a) and _aligned(b)):
        if not _host_reads_are_free(a):
            a = a if _aligned(a) else _with_aligned_strides(a)
            b = b if _aligned(b) else _with_aligned_strides(b)
        else:
            return _gmm_per_group(a, b, offsets_E)
    if a.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        # torch's fake kernel takes bf16 only, where the CPU kernel also takes fp32.
        return torch.ops.te_paged.grouped_mm(a, b, offsets_E)
    return torch._grouped_mm(a, b, offs=offsets_E)


def _host_reads_are_free(t: torch.Tensor) -> bool:
    """Eager CPU tensors: reading their offsets on the host is no synchronisation. Under
    torch.compile never (a host read there is a graph break): the device paths run."""
    return not t.is_cuda and not torch.compiler.is_compiling()


_LIB = torch.library.Library("te_paged", "FRAGMENT")
_LIB.define("grouped_mm(Tensor a, Tensor b, Tensor offs) -> Tensor")
_LIB.impl(
    "grouped_mm",
    lambda a, b, offs: torch._grouped_mm(a, b, offs=offs).contiguous(),
    "CompositeExplicitAutograd",
)


@torch.library.register_fake("te_paged::grouped_mm")
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm``'s output shape (its meta function's cases), any float dtype."""
    if a.dim() == 2 and b.dim() == 2:
        size = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 2:
        size = (a.shape[0], b.shape[-1])
    elif b.dim() == 2:
        size = (a.shape[1], b.shape[1])
    else:
        size = (a.shape[0], a.shape[1], b.shape[-1])
    return a.new_empty(size)


def _k_align_rows(t: torch.Tensor) -> int:
    """Row multiple of each group when tokens are the reduction dimension (CUDA only)."""
    return _ALIGN_BYTES // t.element_size() if t.is_cuda else 1


def stack_params(tensors: Sequence[torch.Tensor], grouped_dim: int) -> torch.Tensor:
    """One grouped parameter is used as is; ``E`` discrete ones are stacked (a copy)."""
    if len(tensors) == 1 and tensors[0].dim() == grouped_dim:
        return tensors[0]
    return torch.stack(tuple(tensors))


def _split_grad(
    grad_E: torch.Tensor, grouped: bool, needs: Sequence[bool]
) -> tuple[torch.Tensor | None, ...]:
    """Per-parameter gradients: the grouped one as is, or one slice per discrete parameter."""
    grads = (grad_E,) if grouped else grad_E.unbind(0)
    return tuple(g if need else None for g, need in zip(grads, needs))


@dataclasses.dataclass(frozen=True)
class FnOptions:
    """What a ``GroupedLinear`` asks of :class:`GroupedLinearFn` besides the tensors.

    ``recipe``: FP8 storage of the input; ``save_original_input``: with FP8, save the
    high-precision input and quantise it again in backward (same bytes: the quantisation is
    deterministic) instead of saving the FP8 bytes; ``wgrad_store``: when a list, backward
    appends a closure computing the weight gradients instead of computing them
    (``delay_wgrad_compute``; the module's ``backward_dw()`` runs it).
    """

    recipe: Fp8Recipe | None = None
    save_original_input: bool = False
    wgrad_store: list | None = dataclasses.field(default=None, compare=False)


class GroupedLinearFn(torch.autograd.Function):
    """Device-initiated grouped linear: ``y_g = x_g · W_gᵀ (+ b_g)`` for every group ``g``.

    ==============  =====================  ===============================================
    tensor          shape                  note
    ==============  =====================  ===============================================
    ``x_TI``        ``[T, I]``             rows of group g: ``[offsets[g-1], offsets[g])``
    ``offsets_E``   int32 ``[E]``          cumulative ends (device)
    ``W``           ``[E, O, I]``          one grouped or ``E`` discrete ``[O, I]``
    ``b``           ``[E, O]``             optional; one grouped or ``E`` discrete ``[O]``
    ``y_TO``        ``[T, O]``             padding rows are exactly 0
    ==============  =====================  ===============================================

    Forward (``pad = row >= offsets[-1]``, a static-shape device mask; grouped_mm leaves the
    padding rows of its output uninitialised, so they are overwritten with ``masked_fill_``, a
    select: multiplying by the mask would turn garbage or NaN into NaN)::

        y   = (grouped_mm(x, Wᵀ) + b[group(row)]).masked_fill_(pad, 0)   # [T, O]

    Backward (rows of ``x`` and ``dy`` past ``offsets[-1]`` are never read)::

        dx  = grouped_mm(dy, W).masked_fill_(pad, 0)                  # [T, I]
        dW  = grouped_mm(dyᵀ, x)                    # [E, O, I]: per group dy_gᵀ x_g
        db  = grouped_mm(dyᵀ, ones[T, K])[..., 0]   # [E, O]: per group Σ_rows dy_g (CUDA)
        db  = [dy_g.sum(0) for each group]          # CPU: the legacy path's own sums

    On CUDA ``db`` is a GEMM (not ``index_add_``): deterministic (``index_add_`` uses atomics)
    and it skips padding rows like the other two GEMMs. On CPU the offsets are read on the host
    (no synchronisation there) to sum each group as the legacy path does, bit for bit; a GEMM's
    summation order differs from ``sum`` for some shapes. Feature sizes whose rows are not
    16-byte multiples are handled in ``_gmm``.

    Saved for backward (``s`` = itemsize of the activation dtype):

    * the input, only when some weight needs a gradient: ``x`` (``T·I·s`` bytes), marked for
      the paged stash (a fresh alias, so the caller's tensor object is left unmarked); with FP8
      its ``data`` (``T·I`` bytes; ``T·I/2`` NVFP4) and ``scale_inv`` (4 bytes tensorwise;
      ``T/32·I`` bytes MXFP8, ``T·I/16`` NVFP4 plus its 4-byte global scale; marked)
      instead. Inside a stash scope only the ``num_tokens`` real rows occupy the pool;
    * ``offsets`` (``4·E`` bytes, static, unmarked);
    * the weights, only when ``x`` needs a gradient: references to the parameters (no copy
      unless ``forward`` had to cast them to the activation dtype).
    """

    @staticmethod
    def forward(
        ctx,
        x_TI: torch.Tensor,
        offsets_E: torch.Tensor,
        opts: FnOptions,
        num_weights: int,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        recipe = opts.recipe
        weights, biases = params[:num_weights], params[num_weights:]
        rows = x_TI.shape[0]
        w_EOI = stack_params(weights, 3)
        needs = ctx.needs_input_grad
        saves_fp8 = any(needs[4 : 4 + num_weights]) and not opts.save_original_input
        fp8, x_mm = _quantize_input(x_TI, recipe, offsets_E[-1], saves_fp8)
        y_TO = grouped_mm(x_mm, w_EOI.transpose(-2, -1), offsets_E)
        if biases:
            b_EO = stack_params(biases, 2)
            # Padding rows get group E; clamp to a real bias, the row is zeroed just below.
            group_T = group_ids_from_offsets(offsets_E, rows).clamp_(max=b_EO.shape[0] - 1)
            y_TO += b_EO.index_select(0, group_T)
        # The grouped-mm padding rows are uninitialised (any bits, NaN included): overwrite them
        # in place, a select that never reads them (multiplying by the mask would keep NaN).
        pad_T1 = ~row_mask_from_offsets(offsets_E, rows).unsqueeze(1)
        y_TO.masked_fill_(pad_T1, 0)

        ctx.recipe = recipe
        ctx.opts = opts
        ctx.grouped_weight = w_EOI is weights[0]
        ctx.grouped_bias = bool(biases) and len(biases) == 1 and biases[0].dim() == 2
        ctx.rows, ctx.x_dtype = rows, x_TI.dtype
        ctx.need_dgrad = needs[0]
        ctx.need_wgrad = tuple(needs[4 : 4 + num_weights])
        ctx.need_bgrad = tuple(needs[4 + num_weights :])
        saved: list[torch.Tensor] = [offsets_E]
        if any(ctx.need_wgrad):
            if fp8 is not None and not opts.save_original_input:
                mark_fp8_saved(fp8)
                saved += fp8.saved()
            else:
                x_saved = x_TI.detach()  # own alias: marking it leaves the caller's tensor alone
                mark_grouped_tensor(x_saved)
                ctx.input_saved_at = len(saved)  # the op fuser drops it under moe_act recompute
                saved.append(x_saved)
        if ctx.need_dgrad:
            saved += weights
        save_for_backward(ctx, *saved)
        return y_TO

    @staticmethod
    def backward(ctx, dy_TO: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        offsets_E, *rest = saved_tensors(ctx)
        rows, num_groups = ctx.rows, offsets_E.shape[0]
        dy_TO = dy_TO.contiguous()
        dx_TI = None
        grads_w = (None,) * len(ctx.need_wgrad)
        grads_b = (None,) * len(ctx.need_bgrad)
        # MXFP8 quantises the gradient too: rowwise for dgrad, columnwise for wgrad (the bias
        # gradient sums the high-precision one).
        dy_d, dy_w = _quantize_grad(dy_TO, ctx.recipe, offsets_E[-1], ctx.need_dgrad,
                                    any(ctx.need_wgrad))  # fmt: skip
        # dW and db reduce over tokens: on CUDA regroup to aligned group starts first.
        align = _k_align_rows(dy_TO)
        k_offsets_E = offsets_E
        dy_k = dy_w
        if rows and align > 1 and (any(ctx.need_wgrad) or any(ctx.need_bgrad)):
            dy_k, k_offsets_E = align_groups(dy_w, offsets_E, align)
        if any(ctx.need_wgrad):
            if ctx.recipe is not None and not ctx.opts.save_original_input:
                fp8, rest = Fp8Tensor.from_saved(rest, ctx.recipe, ctx.x_dtype)
                x_TI = dequantize(fp8)
            else:
                x_TI, *rest = rest
                if ctx.recipe is not None:  # the original input: the saved bytes again
                    x_TI = dequantize(quantize(x_TI, ctx.recipe, num_rows=offsets_E[-1]))

            def weight_grads() -> tuple[torch.Tensor | None, ...]:
                if rows == 0:  # static shape: [0, *] operands fail grouped_mm's stride checks
                    dw_EOI = x_TI.new_zeros(num_groups, dy_TO.shape[1], x_TI.shape[1])
                else:
                    x_k = align_groups(x_TI, offsets_E, align)[0] if align > 1 else x_TI
                    dw_EOI = grouped_mm(dy_k.t(), x_k, k_offsets_E)
                return _split_grad(dw_EOI, ctx.grouped_weight, ctx.need_wgrad)

            if ctx.opts.wgrad_store is None:
                grads_w = weight_grads()
            else:  # delay_wgrad_compute: the module's backward_dw() computes them
                ctx.opts.wgrad_store.append(weight_grads)
        if ctx.need_dgrad:
            w_EOI = stack_params(rest, 3)
            if rows == 0:
                dx_TI = dy_TO.new_zeros(0, w_EOI.shape[2])
            else:
                pad_T1 = ~row_mask_from_offsets(offsets_E, rows).unsqueeze(1)
                dx_TI = grouped_mm(dy_d, w_EOI, offsets_E).masked_fill_(pad_T1, 0)
        if any(ctx.need_bgrad):
            if rows == 0:
                db_EO = dy_TO.new_zeros(num_groups, dy_TO.shape[1])
            elif _host_reads_are_free(dy_TO):  # the legacy path's own sums, bit for bit
                ends = offsets_E.tolist()
                starts = [0, *ends[:-1]]
                db_EO = torch.stack([dy_TO[r0:r1].sum(0) for r0, r1 in zip(starts, ends)])
            else:
                dy_b, b_offsets_E = dy_k, k_offsets_E  # dy regrouped, unless MXFP8's copy
                if dy_w is not dy_TO:
                    dy_b, b_offsets_E = align_groups(dy_TO, offsets_E, align)
                ones_TK = dy_b.new_ones(dy_b.shape[0], _ALIGN_BYTES // dy_b.element_size())
                db_EO = grouped_mm(dy_b.t(), ones_TK, b_offsets_E)[..., 0]
            grads_b = _split_grad(db_EO, ctx.grouped_bias, ctx.need_bgrad)
        return (dx_TI, None, None, None, *grads_w, *grads_b)


def _quantize_input(
    x_TI: torch.Tensor, recipe: Fp8Recipe | None, num_rows: torch.Tensor, saves: bool
) -> tuple[Fp8Tensor | None, torch.Tensor]:
    """``(saved, forward operand)`` of the input under ``recipe``: the FP8 copy backward keeps
    (when ``saves``) and the dequantised values the forward GEMM reads. MXFP8 quantises each
    for its GEMM, as Transformer Engine does: rowwise (blocks along ``I``, the forward GEMM's
    reduction) for the forward, columnwise (blocks of 32 tokens) for the weight gradient. The
    other recipes use one copy for both."""
    if recipe is None:
        return None, x_TI
    if recipe is Fp8Recipe.MXFP8:
        fwd = dequantize(quantize(x_TI, recipe, num_rows, rowwise=True), x_TI.dtype)
        return (quantize(x_TI, recipe, num_rows) if saves else None), fwd
    fp8 = quantize(x_TI, recipe, num_rows)
    return fp8, dequantize(fp8, x_TI.dtype)


def _quantize_grad(
    dy_TO: torch.Tensor, recipe: Fp8Recipe | None, num_rows: torch.Tensor, dgrad: bool, wgrad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgrad operand, wgrad operand)``: under MXFP8 ``dy`` dequantised from its rowwise
    (blocks along ``O``) and its columnwise copy, as TE's MXFP8 recipe quantises gradients
    (E4M3); the other recipes keep gradients in high precision."""
    if recipe is not Fp8Recipe.MXFP8:
        return dy_TO, dy_TO
    d = dequantize(quantize(dy_TO, recipe, num_rows, rowwise=True)) if dgrad else dy_TO
    w = dequantize(quantize(dy_TO, recipe, num_rows)) if wgrad else dy_TO
    return d, w


class LegacyMxfp8Linear(torch.autograd.Function):
    """The legacy path's MXFP8 emulation over host splits: the device path's arithmetic (input
    and gradient each quantised rowwise for one GEMM and columnwise for the weight gradient)
    with one ``F.linear`` / ``mm`` per group. ``params``: ``E`` weights ``[O, I]`` then ``E``
    biases ``[O]`` or none. A reference path: it saves the dequantised columnwise copy, not
    FP8 bytes for the paged stash."""

    @staticmethod
    def forward(ctx, x_TI, num_rows, splits, *params):
        num = len(splits)
        weights, biases = params[:num], params[num:]
        rows, total = x_TI.shape[0], sum(splits)
        x_row = _quantize_input(x_TI, Fp8Recipe.MXFP8, num_rows, False)[1]
        outs = []
        for g, x_g in enumerate(torch.split(x_row[:total], splits)):
            y_g = torch.nn.functional.linear(x_g, weights[g])
            outs.append(y_g + biases[g] if biases else y_g)
        outs.append(x_TI.new_zeros(rows - total, weights[0].shape[0]))
        x_col = dequantize(quantize(x_TI, Fp8Recipe.MXFP8, num_rows))
        ctx.save_for_backward(x_col, num_rows, *weights)
        ctx.splits, ctx.has_bias = splits, bool(biases)
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, dy_TO):
        x_col, num_rows, *weights = ctx.saved_tensors
        splits, total = ctx.splits, sum(ctx.splits)
        dy_d, dy_w = _quantize_grad(dy_TO.contiguous(), Fp8Recipe.MXFP8, num_rows, True, True)
        dx = [dy_g.mm(w) for dy_g, w in zip(torch.split(dy_d[:total], splits), weights)]
        dx.append(dy_TO.new_zeros(dy_TO.shape[0] - total, x_col.shape[1]))
        groups = zip(torch.split(dy_w[:total], splits), torch.split(x_col[:total], splits))
        dw = [dy_g.t().mm(x_g) for dy_g, x_g in groups]
        db = [dy_g.sum(0) for dy_g in torch.split(dy_TO[:total], splits)] if ctx.has_bias else []
        return (torch.cat(dx), None, None, *dw, *db)


class FakeQuant(torch.autograd.Function):
    """Legacy path's FP8 emulation: ``dequantize(quantize(x))`` forward, identity backward."""

    @staticmethod
    def forward(ctx, x_TI: torch.Tensor, recipe: Fp8Recipe, num_rows: torch.Tensor):
        return dequantize(quantize(x_TI, recipe, num_rows=num_rows), x_TI.dtype)

    @staticmethod
    def backward(ctx, dx_TI: torch.Tensor):
        return dx_TI, None, None


class MainGradSink(torch.autograd.Function):
    """Identity on a weight whose gradient goes to ``weight.main_grad`` (TE's
    ``fuse_wgrad_accumulation``): backward adds it there (or copies, when the weight has
    ``overwrite_main_grad=True``), sets ``weight.grad_added_to_main_grad = True`` and returns no
    gradient, so ``weight.grad`` stays ``None``. Saves nothing for backward."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        weight = ctx.weight
        main_grad = getattr(weight, "main_grad", None)
        if main_grad is None:
            raise RuntimeError(
                "fuse_wgrad_accumulation=True needs weight.main_grad (a preallocated gradient "
                "buffer, e.g. Megatron DDP's) on every weight; it is missing"
            )
        if getattr(weight, "overwrite_main_grad", False):
            main_grad.copy_(grad)
        else:
            main_grad.add_(grad.to(main_grad.dtype))
        weight.grad_added_to_main_grad = True
        return None


class GradTo(torch.autograd.Function):
    """``values`` forward; its gradient goes to ``handle`` (same shape and dtype), whose own
    values are not read: how a tensor that arrived quantised passes its gradient back to the
    autograd graph that produced it. Saves nothing for backward."""

    @staticmethod
    def forward(ctx, handle: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if handle.shape != values.shape:
            raise ValueError(f"the gradient handle has shape {tuple(handle.shape)}, the values "
                             f"{tuple(values.shape)}")  # fmt: skip
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class DgradInto(torch.autograd.Function):
    """Identity on the input whose gradient is written into a caller's buffer (TE's
    ``dgrad_out``) and handed on as that buffer. Saves nothing for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.buffer = buffer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.buffer.copy_(grad.reshape(ctx.buffer.shape))
        return ctx.buffer.view(grad.shape), None
