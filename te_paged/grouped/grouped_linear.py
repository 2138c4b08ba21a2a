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

Transformer Engine's arguments (docs/configuration.md has the table): every argument of TE 2.x's
constructor and ``forward`` is taken, in TE's order, and either implemented or accepted at its
no-op value (tensor-parallel and userbuffer ones are refused at any other). The grouped GEMMs
themselves are in :mod:`te_paged.grouped.grouped_mm`.

FP8 (``fp8_recipe``): the input is quantised (``tensorwise``, ``mxfp8`` or ``nvfp4``, see
:mod:`te_paged.grouped.fp8`); the GEMMs run on the dequantised operands with high-precision
weights, a CPU emulation of an FP8 GEMM with FP8 activations. Backward keeps only the FP8 bytes
and scale-inverses (marked for the stash) and dequantises them for the weight gradient. MXFP8
follows Transformer Engine's recipe further: each GEMM reads its own layout (the forward GEMM
the input rowwise, blocks of 32 along ``in_features``; the weight gradient the saved columnwise
copy, blocks of 32 tokens), and the gradient is quantised too (rowwise for the input gradient,
columnwise for the weight gradient; the bias gradient sums the high-precision one). Tensorwise
and NVFP4 keep gradients in high precision and use one copy of the input for both GEMMs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from te_paged.grouped.fp8 import Fp8Recipe, Fp8Tensor, dequantize
from te_paged.grouped.grouped_mm import (
    DgradInto,
    FakeQuant,
    FnOptions,
    GradTo,
    GroupedLinearFn,
    LegacyMxfp8Linear,
    MainGradSink,
    Splits,
    stack_params,
)
from te_paged.grouped.grouped_parameter import GroupedParameter
from te_paged.grouped.grouped_tensor import (
    GroupedTensor,
    _check_splits,
    offsets_from_splits,
    splits_are_invalid,
)
from te_paged.markers import MXFP8_SCALE_BLOCK
from te_paged.te import te_grouped_linear_class

__all__ = ["GroupedLinear", "make_grouped_linear"]


def _default_init(weight_OI: torch.Tensor) -> None:
    nn.init.normal_(weight_OI, mean=0.0, std=0.023)  # Transformer Engine's default


_PARALLEL_MODES = (None, "row", "column")


def _check_buffer(
    name: str, buf: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor
) -> None:
    """TE's rules for ``out``/``dgrad_out``: 2-D, contiguous, no grad, the activation dtype."""
    if buf is None:
        return
    ok = (
        isinstance(buf, torch.Tensor)
        and tuple(buf.shape) == shape
        and buf.is_contiguous()
        and not buf.requires_grad
        and buf.dtype == x.dtype
        and buf.device == x.device
    )
    if not ok:
        raise ValueError(
            f"{name} must be a contiguous {list(shape)} {x.dtype} tensor on {x.device} that does "
            f"not require grad (pass buffer.detach()), got "
            f"{getattr(buf, 'shape', type(buf).__name__)}"
        )


def _group_size(group: object) -> int:
    return 1 if group is None else int(group.size())


#: Transformer Engine's switch of the device-initiated path before ``use_grouped_tensor``.
FUSED_GROUPED_GEMM_ENV = "NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM"


def _fused_grouped_gemm_env() -> bool | None:
    """``use_grouped_tensor`` as the deprecated environment variable sets it (None: unset),
    read as TE 2.20 reads it when the argument is None: a ``FutureWarning``, then
    ``bool(int(value))``. te_paged reads it here only, at construction."""
    value = os.environ.get(FUSED_GROUPED_GEMM_ENV)
    if value is None:
        return None
    warnings.warn(
        f"{FUSED_GROUPED_GEMM_ENV} is deprecated (Transformer Engine 2.20) and will go: pass "
        "use_grouped_tensor=True or use_grouped_tensor=False to GroupedLinear instead",
        FutureWarning,
        stacklevel=3,
    )
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(
            f"{FUSED_GROUPED_GEMM_ENV}={value!r} is not an integer (1: the device-initiated "
            "path, 0: the legacy host path); better, pass use_grouped_tensor"
        ) from None


def _as_mxfp8_storage(fp8: Fp8Tensor) -> Fp8Tensor:
    """A rowwise MXFP8 tensor as te_paged reads it: ``float8_e4m3fn`` data and
    ``float8_e8m0fnu`` scale-inverses ``[R, ceil(H/32)]``. Transformer Engine stores both as
    ``uint8`` bytes (its scale-inverses are the exponent bytes themselves): those are taken as
    the same bits. Any other dtype or shape is refused — read as values, TE's exponent bytes
    would scale the output by up to 2^127."""
    data, scale = fp8.data, fp8.scale_inv
    if data.dtype == torch.uint8:
        data = data.view(torch.float8_e4m3fn)
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    if data.dtype != torch.float8_e4m3fn:
        raise TypeError(f"a rowwise MXFP8 input's data must be float8_e4m3fn (or TE's uint8 "
                        f"bytes), got {fp8.data.dtype}")  # fmt: skip
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"a rowwise MXFP8 input's scale_inv must be float8_e8m0fnu (or TE's "
                        f"uint8 exponent bytes), got {fp8.scale_inv.dtype}")  # fmt: skip
    rows, hidden = data.shape
    blocks = -(-hidden // MXFP8_SCALE_BLOCK)
    if tuple(scale.shape) != (rows, blocks):
        raise ValueError(f"a rowwise MXFP8 input of {tuple(data.shape)} has scale_inv "
                         f"{tuple(scale.shape)}; expected ({rows}, {blocks}), one per "
                         f"{MXFP8_SCALE_BLOCK} elements of a row")  # fmt: skip
    return dataclasses.replace(fp8, data=data, scale_inv=scale)


class GroupedLinear(nn.Module):
    """``num_gemms`` linear layers applied to consecutive row groups of one input buffer.

    The constructor and ``forward`` take Transformer Engine 2.x's ``GroupedLinear`` arguments,
    in its order (docs/configuration.md has the table: implemented, accepted at TE's no-op
    value, or rejected with a ``ValueError``), plus te_paged's ``fp8_recipe``. Parameters are
    registered as TE registers them, ``weight0, bias0, weight1, bias1, ...`` (``weight{i}``
    ``[out, in]``, ``bias{i}`` ``[out]``), or one ``weight`` ``[num_gemms, out, in]``
    (``single_grouped_weight``) and one ``bias`` ``[num_gemms, out]`` (``single_grouped_bias``,
    ignored without ``bias`` as TE ignores it). ``load_state_dict`` accepts either layout.
    ``init_method(w)`` initialises each ``[out, in]`` weight (default, as TE:
    ``normal_(0, 0.023)``), under ``get_rng_state_tracker().fork(rng_tracker_name)`` when given;
    biases start at zero. ``device=None`` is torch's default device (TE's default is
    ``"cuda"``); ``params_dtype=None`` torch's default dtype; ``use_grouped_tensor=None`` the
    device-initiated path.

    ``forward(inp, m_splits, is_first_microbatch=None, out=None, dgrad_out=None)`` takes
    ``inp [max_rows, in]`` (or ``[..., in]``, flattened) and the rows per GEMM; returns
    ``[..., out]`` with zeros in the padding rows, or ``(out, bias)`` with ``return_bias``
    (TE's form: the per-GEMM biases as a list, the single grouped bias as it is, ``None``
    without bias). ``m_splits`` on ``inp``'s device selects the device-initiated path; host
    counts (a list or tuple, or a CPU tensor for a CUDA input) take the legacy path, as in TE.
    Negative splits or splits summing past the input's rows are an error: the legacy path
    raises, the device path (which cannot look without a sync) counts the forward in the
    device buffer ``invalid_splits`` (TEGroupedMLP reports it to the step runners, which refuse
    the step). ``inp`` may instead be a :class:`GroupedTensor`, also one that arrived quantised
    (``fp8`` rowwise MXFP8, the FP8 dispatch wire format; :meth:`_prequantized_values` has the
    rules). Weights are cast to ``inp``'s
    dtype when they differ (gradients flow back through the cast, as in TE).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: object = None,
        tp_size: int = 1,
        get_rng_state_tracker: Callable[[], object] | None = None,
        rng_tracker_name: str | None = None,
        init_method: Callable[[torch.Tensor], object] | None = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device: torch.device | str | None = None,
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        single_grouped_bias: bool = False,
        name: str | None = None,
        use_grouped_tensor: bool | None = None,
        *,
        fp8_recipe: Fp8Recipe | str | None = None,
    ) -> None:
        super().__init__()
        sizes = {"num_gemms": num_gemms, "in_features": in_features, "out_features": out_features}
        for key, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        tp = max(int(tp_size), _group_size(tp_group))
        if tp != 1:
            raise ValueError(
                f"tensor parallelism of {tp} (tp_size/tp_group): te_paged's GroupedLinear is "
                "not tensor-parallel; use expert parallelism (tp_size=1, tp_group=None)"
            )
        if parallel_mode not in _PARALLEL_MODES:
            raise ValueError(
                f"parallel_mode={parallel_mode!r} is not one of {_PARALLEL_MODES} (at "
                "tp_size=1 'row' and 'column' change nothing)"
            )
        if ub_overlap_rs or ub_overlap_ag:
            raise ValueError(
                "ub_overlap_rs/ub_overlap_ag: GroupedLinear has no userbuffer overlap (TE's "
                "raises too); leave them False"
            )
        switches = {
            "sequence_parallel": sequence_parallel, "fuse_wgrad_accumulation":
            fuse_wgrad_accumulation, "bias": bias, "return_bias": return_bias,
            "delay_wgrad_compute": delay_wgrad_compute, "save_original_input":
            save_original_input, "single_grouped_weight": single_grouped_weight,
            "single_grouped_bias": single_grouped_bias,
        }  # fmt: skip
        for key, value in switches.items():  # a string such as "no" would read as True
            if not isinstance(value, bool):
                raise TypeError(f"{key} must be True or False, got {value!r}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        if use_grouped_tensor is not None and not isinstance(use_grouped_tensor, bool):
            raise TypeError(
                f"use_grouped_tensor must be a bool or None, got {use_grouped_tensor!r}"
            )
        if use_grouped_tensor is None:  # TE 2.20: the deprecated variable still decides
            use_grouped_tensor = _fused_grouped_gemm_env()
        self.use_grouped_tensor = True if use_grouped_tensor is None else use_grouped_tensor
        # Asked for by name: host m_splits are then refused, as in TE 2.19, not taken to the
        # legacy path (the implicit fallback that None keeps, TE's None being the legacy path).
        self._grouped_tensor_asked = use_grouped_tensor is True
        self._implicit_fallback_with_delay = False
        self.single_grouped_weight = single_grouped_weight
        self.single_grouped_bias = single_grouped_bias and bias  # TE ignores it without bias
        self.fp8_recipe = None if fp8_recipe is None else Fp8Recipe(fp8_recipe)
        if delay_wgrad_compute and not self.use_grouped_tensor:
            raise ValueError(
                "delay_wgrad_compute=True needs the device-initiated path: set "
                "use_grouped_tensor=True (or leave it None)"
            )
        if save_original_input and self.fp8_recipe is not None and not self.use_grouped_tensor:
            raise ValueError(
                "save_original_input=True with FP8 needs the device-initiated path: set "
                "use_grouped_tensor=True"
            )
        self.sequence_parallel = False  # TE: tp_size > 1 and sequence_parallel
        self.parallel_mode, self.tp_size = parallel_mode, 1
        self.ub_name, self.name = ub_name, name
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        self.save_original_input = save_original_input
        self._wgrad_store: list = []
        self.init_method = init_method or _default_init
        self.get_rng_state_tracker, self.rng_tracker_name = get_rng_state_tracker, rng_tracker_name
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        # TE's order: weight0, bias0, weight1, bias1, ..., then a single grouped ``weight`` and
        # ``bias`` after the per-GEMM ones that remain (TE re-registers them last).
        for i in range(num_gemms):
            if not self.single_grouped_weight:
                weight = nn.Parameter(torch.empty(out_features, in_features, **kw))
                self.register_parameter(f"weight{i}", weight)
            if bias and not self.single_grouped_bias:
                self.register_parameter(f"bias{i}", nn.Parameter(torch.empty(out_features, **kw)))
        if self.single_grouped_weight:
            weight = GroupedParameter(torch.empty(num_gemms, out_features, in_features, **kw))
            self.register_parameter("weight", weight)
        if self.single_grouped_bias:
            self.register_parameter(
                "bias", GroupedParameter(torch.empty(num_gemms, out_features, **kw))
            )
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
        tracker = self.get_rng_state_tracker
        rng = contextlib.nullcontext()
        if tracker is not None:
            fork = tracker().fork
            rng = fork(self.rng_tracker_name) if self.rng_tracker_name else fork()
        with torch.no_grad(), rng:
            for w in self.weight_params():
                for w_OI in w.unbind(0) if w.dim() == 3 else (w,):
                    self.init_method(w_OI)
        with torch.no_grad():
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
        self,
        inp: torch.Tensor | GroupedTensor,
        m_splits: Splits | None = None,
        is_first_microbatch: bool | None = None,
        out: torch.Tensor | None = None,
        dgrad_out: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, object]:
        # is_first_microbatch only lets TE cache FP8 weight copies: te_paged keeps none.
        offsets_E = None
        if isinstance(inp, GroupedTensor):
            if m_splits is not None:
                raise ValueError("with a GroupedTensor input pass no m_splits: it carries its own")
            m_splits, offsets_E = inp.split_sizes, inp.offsets
            inp = inp.data if inp.fp8 is None else self._prequantized_values(inp)
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
        _check_buffer("out", out, (rows, self.out_features), x_TI)
        _check_buffer("dgrad_out", dgrad_out, (rows, self.in_features), x_TI)
        if dgrad_out is not None and x_TI.requires_grad:
            x_TI = DgradInto.apply(x_TI, dgrad_out)
        dtype = x_TI.dtype
        params = self.weight_params()
        if self.fuse_wgrad_accumulation and torch.is_grad_enabled():
            params = [MainGradSink.apply(w) if w.requires_grad else w for w in params]
        weights = [w.to(dtype) for w in params]
        biases = [b.to(dtype) for b in self.bias_params()]
        add_biases = [] if self.return_bias else biases
        # Host counts (a list or tuple, or a CPU tensor for a CUDA input) take the legacy path,
        # as in Transformer Engine: the host already knows them.
        host_splits = isinstance(m_splits, (list, tuple)) or (
            isinstance(m_splits, torch.Tensor) and m_splits.is_cpu and not x_TI.is_cpu
        )
        if self.use_grouped_tensor and host_splits:
            self._check_host_splits()
        if self.use_grouped_tensor and not host_splits:
            # A GroupedTensor's own splits are checked as m_splits are: the group count here,
            # the counts on the device (its offsets clamp silently where the counts overrun).
            name = "m_splits" if offsets_E is None else "the GroupedTensor's split_sizes"
            if offsets_E is None:
                _check_splits(m_splits, x_TI.device, "m_splits")
            if m_splits.numel() != self.num_gemms:
                raise ValueError(f"{name} has {m_splits.numel()} entries, expected "
                                 f"num_gemms={self.num_gemms}")  # fmt: skip
            if offsets_E is None:
                offsets_E = offsets_from_splits(m_splits, rows)
            bad = splits_are_invalid(m_splits, rows).to(self.invalid_splits.device)
            self.invalid_splits.add_(bad)
            self.check_device_path()
            opts = FnOptions(
                self.fp8_recipe,
                self.save_original_input,
                self._wgrad_store if self.delay_wgrad_compute else None,
            )
            y_TO = GroupedLinearFn.apply(x_TI.contiguous(), offsets_E, opts, len(weights),
                                         *weights, *add_biases)  # fmt: skip
        else:
            y_TO = self._forward_legacy(x_TI, m_splits, weights, add_biases)
        y = y_TO.view(*inp.shape[:-1], self.out_features)
        if out is not None:
            out.copy_(y_TO)
            y = out.view(*inp.shape[:-1], self.out_features)
        if not self.return_bias:
            return y
        if not biases:
            return y, None
        # TE 2.19: the single grouped bias is returned as the parameter itself, uncast; the
        # per-GEMM ones as a list in the input's dtype.
        return y, (self.bias if self.single_grouped_bias else biases)

    def _prequantized_values(self, inp: GroupedTensor) -> torch.Tensor:
        """The values of a ``GroupedTensor`` that arrived quantised (``fp8``: rowwise MXFP8, as
        an FP8 token dispatch sends it): dequantised, exactly. The layer then treats them as any
        input; under ``fp8_recipe="mxfp8"`` the forward GEMM's rowwise requantisation gives the
        same values, so the wire feeds it as it is, and the columnwise copy the weight gradient
        needs is made from them, as Transformer Engine 2.19's ``ops.GroupedLinear`` does. The
        input gradient goes to ``inp.data`` when it requires grad (its values are not read)."""
        fp8 = inp.fp8
        if fp8.recipe is not Fp8Recipe.MXFP8 or not fp8.rowwise:
            got = "columnwise mxfp8" if fp8.recipe is Fp8Recipe.MXFP8 else fp8.recipe.value
            raise ValueError("a quantised GroupedTensor input must be rowwise MXFP8 (FP8 "
                             f"dispatch's wire format), got {got}")  # fmt: skip
        if not self.use_grouped_tensor:
            raise NotImplementedError(
                "a quantised GroupedTensor input takes the device-initiated path only: leave "
                "use_grouped_tensor at True or None (TE's legacy split path refuses it too)"
            )
        values = dequantize(_as_mxfp8_storage(fp8))
        if not inp.data.requires_grad:
            return values
        if inp.data.dtype != values.dtype:
            raise TypeError(f"GroupedTensor.data ({inp.data.dtype}) must have the dtype its fp8 "
                            f"copy was quantised from ({values.dtype})")  # fmt: skip
        return GradTo.apply(inp.data, values)

    def _check_host_splits(self) -> None:
        """Host ``m_splits`` on the device-initiated path: TE 2.19's rules. Single grouped
        parameters, or ``use_grouped_tensor=True`` given by name, refuse them (TE: the native
        path requires CUDA ``m_splits``); otherwise they take the legacy path, whose weight
        gradients cannot be delayed (remembered: :meth:`backward_dw` then raises, as TE's)."""
        single = self.single_grouped_weight or (self.use_bias and self.single_grouped_bias)
        if single or self._grouped_tensor_asked:
            why = "single grouped parameters" if single else "use_grouped_tensor=True"
            raise ValueError(
                f"the device-initiated grouped-tensor path ({why}) requires m_splits on the "
                "input's device (CUDA m_splits for a CUDA input): pass an int64 tensor there, "
                "or set use_grouped_tensor=False for the host path"
            )
        if self.delay_wgrad_compute:
            self._implicit_fallback_with_delay = True

    def backward_dw(self) -> None:
        """With ``delay_wgrad_compute``: compute the weight gradients the last backward(s)
        deferred, into ``weight.grad`` (accumulating), or ``weight.main_grad`` with
        ``fuse_wgrad_accumulation``. Otherwise nothing is deferred and this does nothing.
        After a forward whose host ``m_splits`` took the legacy path (which computed the weight
        gradients at once), it raises, as TE 2.19 does."""
        if self._implicit_fallback_with_delay:
            self._implicit_fallback_with_delay = False
            raise RuntimeError(
                "GroupedLinear: a forward with host m_splits took the legacy path, which "
                "computes the weight gradients in backward; this implicit fallback is "
                "unsupported with delay_wgrad_compute=True. Pass m_splits as a tensor on the "
                "input's device"
            )
        weights = self.weight_params()
        while self._wgrad_store:
            grads = self._wgrad_store.pop(0)()
            for w, g in zip(weights, grads):
                if g is None:
                    continue
                g = g.to(w.dtype)
                if self.fuse_wgrad_accumulation:
                    MainGradSink.backward(types.SimpleNamespace(weight=w), g)
                elif w.grad is None:
                    w.grad = g
                else:
                    w.grad += g

    def check_device_path(self) -> None:
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(f"torch {torch.__version__} has no torch._grouped_mm (torch>=2.8 "
                               "needed); use use_grouped_tensor=False")  # fmt: skip

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
        w_list = list(stack_params(weights, 3).unbind(0)) if len(weights) == 1 else weights
        b_list = list(stack_params(biases, 2).unbind(0)) if len(biases) == 1 else biases
        if self.fp8_recipe is not None:
            num_rows_t = torch.tensor(num_rows, device=x_TI.device)
            if self.fp8_recipe is Fp8Recipe.MXFP8:
                return LegacyMxfp8Linear.apply(x_TI, num_rows_t, splits, *w_list, *b_list)
            x_TI = FakeQuant.apply(x_TI, self.fp8_recipe, num_rows_t)
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
    ``fp8_recipe`` then raises. ``None`` arguments are left to TE's own defaults. TE 2.19+
    builds ``single_grouped_weight`` / ``single_grouped_bias`` only with the environment
    variable ``NVTE_GROUPED_LINEAR_SINGLE_PARAM`` set, and otherwise warns and builds
    per-expert parameters: a layer built without the layout asked for raises here.
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
    layer = te_cls(num_gemms, in_features, out_features, **te_kwargs)
    for name in ("single_grouped_weight", "single_grouped_bias"):
        if kwargs[name] and getattr(layer, name, True) is False:
            raise ValueError(
                f"Transformer Engine built per-expert parameters although {name}=True was "
                "asked for: it builds single grouped parameters only with the environment "
                "variable NVTE_GROUPED_LINEAR_SINGLE_PARAM set (TE 2.19+). Set it before "
                f"constructing the layer, or leave {name} off"
            )
    return layer
