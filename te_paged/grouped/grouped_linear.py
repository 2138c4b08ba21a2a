"""``GroupedLinear``: ``E`` linear layers over consecutive row groups of one static buffer.

Shape suffixes: ``T`` rows (the static ``max_num_tokens``; real rows a prefix), ``I``
in_features, ``O`` out_features, ``E`` GEMMs (experts), ``K`` width of the ones matrix that turns
the bias gradient into a GEMM (``16 / itemsize``, the narrowest 16-byte-aligned width).

Two paths, selected by ``use_grouped_tensor`` (Transformer Engine's name):

* **device-initiated** (default): ``m_splits`` stays on the device; one ``torch._grouped_mm``
  per GEMM direction with int32 offsets computed by ``cumsum`` on the device. No ``.item()``,
  ``.tolist()`` or data-dependent shape anywhere in forward or backward, so it is CUDA-graph
  capturable. Its autograd function marks its own saved input, so a paged-stash scope pages it.
* **legacy** (``use_grouped_tensor=False``): ``m_splits`` is read on the host and the buffer is
  ``torch.split`` into per-expert ``F.linear`` calls; the reference the device path is tested
  against (same math, bitwise equal results in fp32 and bf16 on CPU).

Both paths return zeros in the padding rows (``[offsets[-1], T)``), whatever the padding input
holds (NaN included), and give the padding input rows a zero gradient.

On CUDA (checked on an H200 with torch 2.11, not in CI): ``torch._grouped_mm`` is a CUTLASS
kernel for bf16 only; there the path ran sync-free under ``set_sync_debug_mode("error")``, gave
outputs and gradients bitwise equal to the legacy path and was bitwise unchanged by the paged
stash. fp32/fp16 fall back to a per-group loop that reads the offsets on the host (a sync): use
bf16 activations. The kernel also asserts on the device (killing the CUDA context) unless every
group's extent along the *reduction* dimension is a multiple of 16 bytes, which arbitrary token
counts break for ``dW``/``db``; backward therefore regroups ``x`` and ``dy`` to aligned group
starts first (:func:`~te_paged.grouped.grouped_tensor.align_groups`: one gather-and-select pass
each into a ``[T + 7E, I]`` and a ``[T + 7E, O]`` bf16 buffer). CPU needs neither.

FP8 (``fp8_recipe``): the input is quantised (``tensorwise`` or ``mxfp8``, see
:mod:`te_paged.grouped.fp8`); the GEMMs run on the dequantised input with high-precision
weights, a CPU emulation of an FP8 GEMM with FP8 activations. Backward keeps only the FP8 bytes
and scale-inverses (marked for the stash) and dequantises them for the weight gradient.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_paged.grouped.fp8 import Fp8Recipe, Fp8Tensor, dequantize, mark_fp8_saved, quantize
from te_paged.grouped.grouped_tensor import (
    GroupedTensor,
    _check_splits,
    align_groups,
    group_ids_from_offsets,
    offsets_from_splits,
    row_mask_from_offsets,
    splits_are_invalid,
)
from te_paged.markers import MXFP8_SCALE_BLOCK, mark_grouped_tensor
from te_paged.te import te_grouped_linear_class

__all__ = ["GroupedLinear", "make_grouped_linear"]

#: Rows per GEMM: a device tensor (required on the device-initiated path) or host ints.
Splits = torch.Tensor | Sequence[int]
_ALIGN_BYTES = 16  # torch._grouped_mm needs every stride a multiple of 16 bytes


def _gmm(a: torch.Tensor, b: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offsets_E)


def _k_align_rows(t: torch.Tensor) -> int:
    """Row multiple of each group when tokens are the reduction dimension (CUDA only)."""
    return _ALIGN_BYTES // t.element_size() if t.is_cuda else 1


def _stack(tensors: Sequence[torch.Tensor], grouped_dim: int) -> torch.Tensor:
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


class _GroupedLinearFn(torch.autograd.Function):
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
        db  = grouped_mm(dyᵀ, ones[T, K])[..., 0]   # [E, O]: per group Σ_rows dy_g

    ``db`` as a GEMM (not ``index_add_``) is deterministic on every backend (CUDA's
    ``index_add_`` uses atomics) and skips padding rows like the other two GEMMs.

    Saved for backward (``s`` = itemsize of the activation dtype):

    * the input, only when some weight needs a gradient: ``x`` (``T·I·s`` bytes), marked for
      the paged stash (a fresh alias, so the caller's tensor object is left unmarked); with FP8
      its ``data`` (``T·I`` bytes) and ``scale_inv`` (4 bytes tensorwise; ``T/32·I`` bytes MXFP8,
      marked) instead. Inside a stash scope only the ``num_tokens`` real rows occupy the pool;
    * ``offsets`` (``4·E`` bytes, static, unmarked);
    * the weights, only when ``x`` needs a gradient: references to the parameters (no copy
      unless ``forward`` had to cast them to the activation dtype).
    """

    @staticmethod
    def forward(
        ctx,
        x_TI: torch.Tensor,
        offsets_E: torch.Tensor,
        recipe: Fp8Recipe | None,
        num_weights: int,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        weights, biases = params[:num_weights], params[num_weights:]
        rows = x_TI.shape[0]
        w_EOI = _stack(weights, 3)
        fp8 = None
        x_mm = x_TI
        if recipe is not None:
            fp8 = quantize(x_TI, recipe, num_rows=offsets_E[-1])
            x_mm = dequantize(fp8, x_TI.dtype)
        y_TO = _gmm(x_mm, w_EOI.transpose(-2, -1), offsets_E)
        if biases:
            b_EO = _stack(biases, 2)
            # Padding rows get group E; clamp to a real bias, the row is zeroed just below.
            group_T = group_ids_from_offsets(offsets_E, rows).clamp_(max=b_EO.shape[0] - 1)
            y_TO += b_EO.index_select(0, group_T)
        # The grouped-mm padding rows are uninitialised (any bits, NaN included): overwrite them
        # in place, a select that never reads them (multiplying by the mask would keep NaN).
        pad_T1 = ~row_mask_from_offsets(offsets_E, rows).unsqueeze(1)
        y_TO.masked_fill_(pad_T1, 0)

        needs = ctx.needs_input_grad
        ctx.recipe = recipe
        ctx.grouped_weight = w_EOI is weights[0]
        ctx.grouped_bias = bool(biases) and len(biases) == 1 and biases[0].dim() == 2
        ctx.rows, ctx.x_dtype = rows, x_TI.dtype
        ctx.need_dgrad = needs[0]
        ctx.need_wgrad = tuple(needs[4 : 4 + num_weights])
        ctx.need_bgrad = tuple(needs[4 + num_weights :])
        saved: list[torch.Tensor] = [offsets_E]
        if any(ctx.need_wgrad):
            if fp8 is not None:
                mark_fp8_saved(fp8)
                saved += [fp8.data, fp8.scale_inv]
            else:
                x_saved = x_TI.detach()  # own alias: marking it leaves the caller's tensor alone
                mark_grouped_tensor(x_saved)
                saved.append(x_saved)
        if ctx.need_dgrad:
            saved += weights
        ctx.save_for_backward(*saved)
        return y_TO

    @staticmethod
    def backward(ctx, dy_TO: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        offsets_E, *rest = ctx.saved_tensors
        rows, num_groups = ctx.rows, offsets_E.shape[0]
        dy_TO = dy_TO.contiguous()
        dx_TI = None
        grads_w = (None,) * len(ctx.need_wgrad)
        grads_b = (None,) * len(ctx.need_bgrad)
        # dW and db reduce over tokens: on CUDA regroup to aligned group starts first.
        align = _k_align_rows(dy_TO)
        k_offsets_E = offsets_E
        dy_k = dy_TO
        if rows and align > 1 and (any(ctx.need_wgrad) or any(ctx.need_bgrad)):
            dy_k, k_offsets_E = align_groups(dy_TO, offsets_E, align)
        if any(ctx.need_wgrad):
            if ctx.recipe is not None:
                data, scale_inv, *rest = rest
                x_TI = dequantize(Fp8Tensor(data, scale_inv, ctx.recipe, ctx.x_dtype))
            else:
                x_TI, *rest = rest
            if rows == 0:  # static shape: [0, *] operands fail grouped_mm's stride checks
                dw_EOI = x_TI.new_zeros(num_groups, dy_TO.shape[1], x_TI.shape[1])
            else:
                x_k = align_groups(x_TI, offsets_E, align)[0] if align > 1 else x_TI
                dw_EOI = _gmm(dy_k.t(), x_k, k_offsets_E)
            grads_w = _split_grad(dw_EOI, ctx.grouped_weight, ctx.need_wgrad)
        if ctx.need_dgrad:
            w_EOI = _stack(rest, 3)
            if rows == 0:
                dx_TI = dy_TO.new_zeros(0, w_EOI.shape[2])
            else:
                pad_T1 = ~row_mask_from_offsets(offsets_E, rows).unsqueeze(1)
                dx_TI = _gmm(dy_TO, w_EOI, offsets_E).masked_fill_(pad_T1, 0)
        if any(ctx.need_bgrad):
            if rows == 0:
                db_EO = dy_TO.new_zeros(num_groups, dy_TO.shape[1])
            else:
                ones_TK = dy_k.new_ones(dy_k.shape[0], _ALIGN_BYTES // dy_k.element_size())
                db_EO = _gmm(dy_k.t(), ones_TK, k_offsets_E)[..., 0]
            grads_b = _split_grad(db_EO, ctx.grouped_bias, ctx.need_bgrad)
        return (dx_TI, None, None, None, *grads_w, *grads_b)


class _FakeQuant(torch.autograd.Function):
    """Legacy path's FP8 emulation: ``dequantize(quantize(x))`` forward, identity backward."""

    @staticmethod
    def forward(ctx, x_TI: torch.Tensor, recipe: Fp8Recipe, num_rows: torch.Tensor):
        return dequantize(quantize(x_TI, recipe, num_rows=num_rows), x_TI.dtype)

    @staticmethod
    def backward(ctx, dx_TI: torch.Tensor):
        return dx_TI, None, None


def _default_init(weight_OI: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(weight_OI, a=math.sqrt(5))  # what nn.Linear does


class GroupedLinear(nn.Module):
    """``num_gemms`` linear layers applied to consecutive row groups of one input buffer.

    The constructor mirrors Transformer Engine's ``GroupedLinear``. Parameters are
    ``weight{i}`` ``[out, in]`` / ``bias{i}`` ``[out]``, or one ``weight`` ``[num_gemms, out,
    in]`` (``single_grouped_weight``) and one ``bias`` ``[num_gemms, out]``
    (``single_grouped_bias``). ``load_state_dict`` accepts either layout. ``init_method(w)``
    initialises each expert's ``[out, in]`` weight (default: kaiming-uniform like
    ``nn.Linear``); biases start at zero. ``device=None`` is torch's default device (CPU unless
    changed); ``params_dtype=None`` torch's default dtype.

    ``forward(inp, m_splits)`` takes ``inp [max_rows, in]`` (or ``[..., in]``, flattened) and
    the rows per GEMM; returns ``[..., out]`` with zeros in the padding rows, or ``(out, bias)``
    with ``return_bias`` (``bias`` ``[num_gemms, out]`` not added, or ``None`` without bias).
    On the device-initiated path ``m_splits`` must be an integer tensor on ``inp``'s device;
    the legacy path also takes a list. Negative splits or splits summing past the input's rows
    are an error: the legacy path raises, the device path (which cannot look without a sync)
    counts the forward in the device buffer ``invalid_splits`` (TEGroupedMLP reports it to the
    step runners, which refuse the step). ``inp`` may instead be a :class:`GroupedTensor`.
    Weights are cast to ``inp``'s dtype when they differ (gradients flow back through the
    cast, as in TE).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: Callable[[torch.Tensor], object] | None = None,
        use_grouped_tensor: bool = True,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        fp8_recipe: Fp8Recipe | str | None = None,
    ) -> None:
        super().__init__()
        sizes = {"num_gemms": num_gemms, "in_features": in_features, "out_features": out_features}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if single_grouped_bias and not bias:
            raise ValueError("single_grouped_bias=True needs bias=True")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.use_grouped_tensor = use_grouped_tensor
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias
        self.fp8_recipe = None if fp8_recipe is None else Fp8Recipe(fp8_recipe)
        self.init_method = init_method or _default_init
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        layouts = [("weight", single_grouped_weight, (out_features, in_features))]
        layouts += [("bias", single_grouped_bias, (out_features,))] if bias else []
        for name, grouped, shape in layouts:  # "weight" [E, O, I] or "weight{i}" [O, I] ...
            for key, full in (
                [(name, (num_gemms, *shape))]
                if grouped
                else [(f"{name}{i}", shape) for i in range(num_gemms)]
            ):
                self.register_parameter(key, nn.Parameter(torch.empty(full, **kw)))
        # Device counter of forwards whose m_splits were negative or summed past the input's
        # rows (the device path cannot raise without a sync; the legacy path raises).
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self.register_buffer("invalid_splits", zero, persistent=False)
        self.reset_parameters()

    # ----------------------------------------------------------------------------- parameters

    def _params(self, name: str, grouped: bool) -> list[nn.Parameter]:
        if grouped:
            return [getattr(self, name)]
        return [getattr(self, f"{name}{i}") for i in range(self.num_gemms)]

    def weight_params(self) -> list[nn.Parameter]:
        """The weight parameter(s): one grouped ``[E, O, I]`` or ``E`` discrete ``[O, I]``."""
        return self._params("weight", self.single_grouped_weight)

    def bias_params(self) -> list[nn.Parameter]:
        """The bias parameter(s): none, one grouped ``[E, O]`` or ``E`` discrete ``[O]``."""
        return self._params("bias", self.single_grouped_bias) if self.use_bias else []

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w in self.weight_params():
                for w_OI in w.unbind(0) if w.dim() == 3 else (w,):
                    self.init_method(w_OI)
            for b in self.bias_params():
                b.zero_()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # Convert the other layout in place (load_state_dict hands each module its own copy of
        # the dict), then let nn.Module report whatever still does not fit.
        error_msgs = args[-1]
        layouts = [("weight", self.single_grouped_weight)]
        layouts += [("bias", self.single_grouped_bias)] if self.use_bias else []
        for name, grouped in layouts:
            keys = [f"{prefix}{name}{i}" for i in range(self.num_gemms)]
            stacked_key = prefix + name
            present = [k for k in keys if k in state_dict]
            if grouped and stacked_key not in state_dict and present:
                if len(present) < len(keys):
                    missing = [k for k in keys if k not in state_dict]
                    error_msgs.append(f"cannot stack {stacked_key!r}: missing {missing}")
                    continue
                state_dict[stacked_key] = torch.stack([state_dict.pop(k) for k in keys])
            elif not grouped and stacked_key in state_dict and not present:
                stacked = state_dict[stacked_key]
                if stacked.dim() >= 1 and stacked.shape[0] == self.num_gemms:
                    del state_dict[stacked_key]
                    state_dict.update(zip(keys, stacked.unbind(0)))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        recipe = self.fp8_recipe.value if self.fp8_recipe else None
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features="
                f"{self.out_features}, bias={self.use_bias}, use_grouped_tensor="
                f"{self.use_grouped_tensor}, fp8_recipe={recipe}")  # fmt: skip

    # -------------------------------------------------------------------------------- forward

    def forward(
        self, inp: torch.Tensor | GroupedTensor, m_splits: Splits | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        offsets_E = None
        if isinstance(inp, GroupedTensor):
            if m_splits is not None or inp.fp8 is not None:
                raise ValueError("with a GroupedTensor input pass no m_splits (it carries its "
                                 "own) and a high-precision tensor (fp8=None)")  # fmt: skip
            m_splits, offsets_E, inp = inp.split_sizes, inp.offsets, inp.data
        if not isinstance(inp, torch.Tensor) or inp.dim() < 1 or inp.shape[-1] != self.in_features:
            raise ValueError(f"inp must be a [..., {self.in_features}] tensor, got shape "
                             f"{tuple(getattr(inp, 'shape', ()))}")  # fmt: skip
        if not inp.dtype.is_floating_point:
            raise TypeError(f"inp must be a floating-point tensor, got {inp.dtype}")
        x_TI = inp.reshape(-1, self.in_features)
        rows = x_TI.shape[0]
        if self.fp8_recipe is Fp8Recipe.MXFP8 and rows % MXFP8_SCALE_BLOCK:
            raise ValueError(f"MXFP8 scales blocks of {MXFP8_SCALE_BLOCK} rows, but the input has "
                             f"{rows} rows: pad max_num_tokens to a multiple of "
                             f"{MXFP8_SCALE_BLOCK}")  # fmt: skip
        dtype = x_TI.dtype
        weights = [w.to(dtype) for w in self.weight_params()]
        biases = [b.to(dtype) for b in self.bias_params()]
        add_biases = [] if self.return_bias else biases
        if self.use_grouped_tensor:
            if offsets_E is None:
                _check_splits(m_splits, x_TI.device, "m_splits")
                if m_splits.numel() != self.num_gemms:
                    raise ValueError(f"m_splits has {m_splits.numel()} entries, expected "
                                     f"num_gemms={self.num_gemms}")  # fmt: skip
                offsets_E = offsets_from_splits(m_splits, rows)
                bad = splits_are_invalid(m_splits, rows).to(self.invalid_splits.device)
                self.invalid_splits.add_(bad)
            self._check_device_path(dtype)
            y_TO = _GroupedLinearFn.apply(x_TI.contiguous(), offsets_E, self.fp8_recipe,
                                          len(weights), *weights, *add_biases)  # fmt: skip
        else:
            y_TO = self._forward_legacy(x_TI, m_splits, weights, add_biases)
        y = y_TO.view(*inp.shape[:-1], self.out_features)
        if not self.return_bias:
            return y
        return y, (_stack(biases, 2) if biases else None)

    def _check_device_path(self, dtype: torch.dtype) -> None:
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm (torch>=2.8 "
                               "needed); use use_grouped_tensor=False")  # fmt: skip
        itemsize = torch.empty((), dtype=dtype).element_size()
        for name, n in (("in_features", self.in_features), ("out_features", self.out_features)):
            if n * itemsize % _ALIGN_BYTES:
                raise ValueError(
                    f"{name}={n} in {dtype} is {n * itemsize} bytes per row; torch._grouped_mm "
                    f"needs a multiple of {_ALIGN_BYTES} bytes: pad {name} to a multiple of "
                    f"{_ALIGN_BYTES // itemsize} or use use_grouped_tensor=False"
                )

    def _forward_legacy(
        self, x_TI: torch.Tensor, m_splits: Splits, weights: list[Tensor], biases: list[Tensor]
    ) -> torch.Tensor:
        splits = m_splits.tolist() if isinstance(m_splits, torch.Tensor) else list(m_splits)
        rows = x_TI.shape[0]
        if len(splits) != self.num_gemms or any(int(s) < 0 for s in splits):
            raise ValueError(f"m_splits must hold {self.num_gemms} non-negative counts, got "
                             f"{splits}")  # fmt: skip
        splits = [int(s) for s in splits]
        num_rows = sum(splits)
        if num_rows > rows:
            raise ValueError(f"m_splits sums to {num_rows} rows but the input has {rows}")
        if self.fp8_recipe is not None:
            num_rows_t = torch.tensor(num_rows, device=x_TI.device)
            x_TI = _FakeQuant.apply(x_TI, self.fp8_recipe, num_rows_t)
        w_list = list(_stack(weights, 3).unbind(0)) if len(weights) == 1 else weights
        b_list = list(_stack(biases, 2).unbind(0)) if len(biases) == 1 else biases
        outs = []
        for g, x_g in enumerate(torch.split(x_TI[:num_rows], splits)):
            y_g = F.linear(x_g, w_list[g])
            outs.append(y_g + b_list[g] if b_list else y_g)  # same math as the device path
        outs.append(x_TI.new_zeros(rows - num_rows, self.out_features))
        return torch.cat(outs)


def make_grouped_linear(
    num_gemms: int,
    in_features: int,
    out_features: int,
    *,
    bias: bool = True,
    return_bias: bool = False,
    params_dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    init_method: Callable[[torch.Tensor], object] | None = None,
    use_grouped_tensor: bool = True,
    single_grouped_weight: bool = False,
    single_grouped_bias: bool = False,
    fp8_recipe: Fp8Recipe | str | None = None,
) -> nn.Module:
    """Transformer Engine's ``GroupedLinear`` when TE is importable and has the
    device-initiated path (``use_grouped_tensor``), else te_paged's :class:`GroupedLinear`.

    With TE, FP8 is configured by ``te.fp8_autocast``, not by the constructor: passing
    ``fp8_recipe`` then raises. ``None`` arguments are left to TE's own defaults.
    """
    kwargs = {
        "bias": bias, "return_bias": return_bias, "params_dtype": params_dtype, "device": device,
        "init_method": init_method, "use_grouped_tensor": use_grouped_tensor,
        "single_grouped_weight": single_grouped_weight, "single_grouped_bias": single_grouped_bias,
    }  # fmt: skip
    te_cls = te_grouped_linear_class()
    if te_cls is None:
        return GroupedLinear(num_gemms, in_features, out_features, fp8_recipe=fp8_recipe, **kwargs)
    if fp8_recipe is not None:
        raise ValueError(
            "Transformer Engine's GroupedLinear takes FP8 from te.fp8_autocast(fp8_recipe=...), "
            "not from the constructor: pass fp8_recipe=None"
        )
    params = inspect.signature(te_cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    te_kwargs = {}
    for name, value in kwargs.items():
        if value is None:
            continue
        if name not in params and not takes_any:
            if value is False:  # an off switch this TE version does not know yet
                continue
            raise ValueError(f"the installed Transformer Engine's GroupedLinear has no {name!r} "
                             "argument: upgrade it or leave the option at its default")  # fmt: skip
        te_kwargs[name] = value
    return te_cls(num_gemms, in_features, out_features, **te_kwargs)
