"""FP8 storage of saved activations: per-tensor current scaling and MXFP8; NVFP4 (4-bit).

Shape suffixes: ``R`` rows (tokens; the static ``max_num_tokens``, actual rows a prefix),
``H`` hidden (elements per row), ``B = R / 32`` MXFP8 blocks along the token dimension.

Only the *storage* is FP8 here: :func:`quantize` turns a high-precision ``x_RH`` into an
:class:`Fp8Tensor` (``float8_e4m3fn`` bytes plus a scale-inverse) and :func:`dequantize` turns it
back. On CPU the FP8 compute of the library is emulated by exactly this quantise–dequantise pair;
the stored bytes are real FP8.

Recipes
-------
``TENSORWISE`` (current scaling)
    ``amax = max |x|`` over the *real* rows (``num_rows``), ``scale = 448 / amax`` (1 when amax is
    0 or not finite, capped at float32's max), ``data = sat(x · scale)``, ``scale_inv = 1/scale``
    (float32 ``[1]``). Not a power of two, so ``dequantize`` adds one float32 rounding.
``MXFP8`` (block scaling)
    One power-of-two scale per block of 32 consecutive *tokens* of one column, stored token-major
    as ``float8_e8m0fnu [R/32, H]`` so that the real blocks stay a prefix of the rows (which is
    what lets the paged stash store ``ceil(num_tokens / 32)`` rows of it): Transformer Engine's
    *columnwise* layout, the one its weight-gradient GEMM reads and its backward saves. The
    *rowwise* layout (``quantize(..., rowwise=True)``) scales blocks of 32 consecutive elements
    of a row instead, ``scale_inv`` ``e8m0 [R, ceil(H/32)]`` (a short last block when ``H`` is
    not a multiple of 32): what TE's forward GEMM reads and its FP8 token dispatch sends. Both
    use the same exponent rule. The exponent is

        ``e = ceil(log2(amax_block / 448))``, clamped to e8m0's ``[-127, 127]``

    i.e. the smallest power of two with ``amax_block / 2^e <= 448``; ``scale_inv = 2^e``,
    ``data = sat(x / 2^e)``. This is Transformer Engine's rule (round the scale up so the block
    maximum never saturates). The OCP MX v1.0 rule, ``e = floor(log2(amax)) - 8`` (8 = emax of
    e4m3), is the same or one smaller: it maps the block maximum into ``[256, 512)`` and clips
    values above 448 (up to 12.5 % error), which would break the error bound below. An all-zero
    block gets ``e = -127`` (byte 0x00); a block containing inf/NaN gets the e8m0 NaN (0xFF).

``NVFP4`` (Transformer Engine's 1×16 block scaling)
    Two levels of scale: a float32 per-tensor ``global_scale = 448 · 6 / amax`` (``amax`` over
    the real rows; 1 when 0 or not finite), and per 16 consecutive elements of a row an e4m3
    block scale ``s = e4m3(amax_block / 6 · global_scale)``. Each element is
    ``e2m1(x · global_scale / s)`` (the E2M1 grid ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, round to
    nearest, ties to the even code, saturating at 6), two to a byte: element ``2i`` in the low
    nibble, ``2i + 1`` in the high one (torch's ``float4_e2m1fn_x2`` order). ``data`` is
    ``uint8 [R, H/2]``, ``scale_inv`` the block scales ``float8_e4m3fn [R, H/16]`` — one row per
    token, so both page as ordinary token rows — and ``global_scale_inv = 1 / global_scale``
    float32 ``[1]``, static, kept with the record. ``dequantize`` is ``e2m1 · s ·
    global_scale_inv``. 4 + 8/16 = 4.5 bits an element. A block whose scale rounds to zero
    stores zeros; its values were below e4m3's resolution of the tensor's range.

Error bound (tensorwise and MXFP8): e4m3 has 3 mantissa bits and rounds to nearest, so a value whose
scaled magnitude is normal (``>= 2^-6``) is stored with relative error ``<= 2^-4``; smaller
scaled values (subnormals) have absolute error ``<= 2^-10`` in the scaled domain.

Requantisation (MXFP8, either layout): quantising the dequantised values again gives the same
values. Every block maximum is now at most ``448 · 2^e``, so the new exponent is ``e`` or smaller,
and scaling an e4m3 value up by a power of two stays exact (the scale byte may differ: a block
whose maximum is at most 224 · 2^e gets a smaller exponent). This is what lets a layer consume a
tensor that arrived already quantised as it is, as Transformer Engine's FP8 dispatch does.

Padding rows (``rows >= num_rows``) are masked out of every amax with a static-shape
``torch.where`` and stored as zero bytes; an all-padding MXFP8 block has scale byte 0x00. These
are exactly the bytes the paged stash writes into padding on pop, so a quantised tensor is
bitwise the same with the stash on or off. Nothing here reads a device value on the host.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from te_paged.markers import MXFP8_SCALE_BLOCK, mark_grouped_tensor

__all__ = [
    "FP8_E4M3_MAX",
    "Fp8Recipe",
    "Fp8Tensor",
    "dequantize",
    "fp8_supported",
    "mark_fp8_saved",
    "quantize",
]

#: Largest finite ``float8_e4m3fn`` value (``1.75 · 2^8``).
FP8_E4M3_MAX = 448.0
#: Largest E2M1 (FP4) value, and the elements of a row an NVFP4 block scale covers.
FP4_E2M1_MAX = 6.0
NVFP4_BLOCK = 16

_E8M0_BIAS = 127
_E8M0_NAN = 255


class Fp8Recipe(str, enum.Enum):
    """FP8 recipe for expert GEMM inputs (``fp8=None`` means no FP8)."""

    TENSORWISE = "tensorwise"  # per-tensor current scaling
    MXFP8 = "mxfp8"  # blocks of 32 elements with power-of-two scales
    NVFP4 = "nvfp4"  # 4-bit E2M1, an e4m3 scale per 16 elements of a row, a float32 global scale


@dataclasses.dataclass
class Fp8Tensor:
    """FP8 bytes of a token-major tensor and the scale-inverse that restores it.

    ============= ===================== ============================ =====================
    field         tensorwise            MXFP8                        NVFP4
    ============= ===================== ============================ =====================
    ``data``      ``e4m3 [R, H]``       ``e4m3 [R, H]``              ``uint8 [R, H/2]``
    ``scale_inv`` ``float32 [1]``       ``e8m0 [R/32, H]``           ``e4m3 [R, H/16]``
    ============= ===================== ============================ =====================

    (``e4m3``: ``float8_e4m3fn``, ``e8m0``: ``float8_e8m0fnu``; the tensorwise ``scale_inv``
    is static.) ``rowwise`` MXFP8 has ``scale_inv`` ``e8m0 [R, ceil(H/32)]`` instead.

    ``dtype`` is the high-precision dtype the tensor had before quantisation; NVFP4 adds the
    static per-tensor ``global_scale_inv`` (float32 ``[1]``). :meth:`saved` is what a function
    saves for backward, :meth:`from_saved` rebuilds the tensor from it.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    recipe: Fp8Recipe
    dtype: torch.dtype
    global_scale_inv: torch.Tensor | None = None
    rowwise: bool = False

    def saved(self) -> list[torch.Tensor]:
        extra = [self.global_scale_inv] if self.recipe is Fp8Recipe.NVFP4 else []
        return [self.data, self.scale_inv, *extra]

    @classmethod
    def from_saved(
        cls,
        tensors: list[torch.Tensor],
        recipe: Fp8Recipe,
        dtype: torch.dtype,
        *,
        rowwise: bool = False,
    ) -> tuple[Fp8Tensor, list[torch.Tensor]]:
        """The tensor :meth:`saved` gave, and the tensors after it."""
        n = 3 if recipe is Fp8Recipe.NVFP4 else 2
        extra = tensors[2] if n == 3 else None
        return cls(tensors[0], tensors[1], recipe, dtype, extra, rowwise), list(tensors[n:])


def fp8_supported() -> tuple[bool, str]:
    """``(ok, reason)``: whether this torch has the FP8 dtypes both recipes need."""
    missing = [n for n in ("float8_e4m3fn", "float8_e8m0fnu") if not hasattr(torch, n)]
    if missing:
        return False, f"torch {torch.__version__} lacks {', '.join(missing)} (need torch>=2.7)"
    return True, ""


def _row_mask(
    rows: int, num_rows: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """``[R, 1]`` bool, True for real rows; static shape, compared on the device."""
    if num_rows is None:
        return None
    if not isinstance(num_rows, torch.Tensor) or num_rows.numel() != 1:
        raise TypeError("num_rows must be a one-element integer tensor (on the data's device)")
    if num_rows.dtype.is_floating_point or num_rows.dtype == torch.bool:
        raise TypeError(f"num_rows must be an integer tensor, got {num_rows.dtype}")
    if num_rows.device != device:
        raise ValueError(f"num_rows is on {num_rows.device} but the data on {device}: moving it "
                         "would be a host-device copy in the hot path")  # fmt: skip
    return torch.arange(rows, device=device).unsqueeze(1) < num_rows.reshape(1, 1)


def _saturate_to_fp8(v: torch.Tensor) -> torch.Tensor:
    # CUDA casts out-of-range values to NaN (e4m3fn has no inf): saturate first. NaN stays NaN.
    return v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(
    x_RH: torch.Tensor,
    recipe: Fp8Recipe | str,
    num_rows: torch.Tensor | None = None,
    *,
    rowwise: bool = False,
) -> Fp8Tensor:
    """Quantise a 2-D ``x_RH`` to FP8 with ``recipe`` (rules in the module docstring).

    ``num_rows`` (a one-element integer device tensor) is the count of real rows; the others are
    left out of the scales and stored as zeros. ``rowwise`` (MXFP8 only) scales blocks of 32
    elements of a row instead of 32 tokens of a column. Sync-free: no value is read on the host.
    """
    recipe = Fp8Recipe(recipe)
    if rowwise and recipe is not Fp8Recipe.MXFP8:
        raise ValueError(f"rowwise=True is MXFP8's layout, not {recipe.value}'s")
    ok, reason = fp8_supported()
    if not ok:
        raise RuntimeError(reason)
    if not isinstance(x_RH, torch.Tensor) or x_RH.dim() != 2:
        raise ValueError(f"quantize expects a 2-D [rows, hidden] tensor, got shape "
                         f"{tuple(getattr(x_RH, 'shape', ()))}")  # fmt: skip
    if not x_RH.dtype.is_floating_point or x_RH.element_size() < 2:
        raise TypeError(f"quantize expects a high-precision float tensor, got {x_RH.dtype}")
    rows, hidden = x_RH.shape
    if recipe is Fp8Recipe.NVFP4 and hidden % NVFP4_BLOCK:
        raise ValueError(
            f"NVFP4 scales blocks of {NVFP4_BLOCK} elements of a row, but x has {hidden} columns: "
            f"use a hidden size that is a multiple of {NVFP4_BLOCK}"
        )
    if recipe is Fp8Recipe.MXFP8 and not rowwise and rows % MXFP8_SCALE_BLOCK:
        raise ValueError(
            f"MXFP8 scales blocks of {MXFP8_SCALE_BLOCK} tokens, but x has {rows} rows: pad the "
            f"token budget (max_num_tokens) to a multiple of {MXFP8_SCALE_BLOCK}"
        )
    dtype = x_RH.dtype
    mask_R1 = _row_mask(rows, num_rows, x_RH.device)
    x_RH = x_RH.float()
    if mask_R1 is not None:
        # where(), not a multiply: a NaN/inf padding row must not leak into amax or data.
        x_RH = torch.where(mask_R1, x_RH, 0.0)

    if recipe is Fp8Recipe.TENSORWISE:
        amax = x_RH.abs().amax() if x_RH.numel() else x_RH.new_zeros(())
        usable = (amax > 0) & torch.isfinite(amax)
        scale = torch.where(usable, FP8_E4M3_MAX / amax, 1.0)
        scale = scale.clamp(max=torch.finfo(torch.float32).max)  # subnormal amax: 448/amax = inf
        data_RH = _saturate_to_fp8(x_RH * scale)
        return Fp8Tensor(data_RH, scale.reciprocal().reshape(1), recipe, dtype)

    if recipe is Fp8Recipe.NVFP4:
        return _quantize_nvfp4(x_RH, dtype)

    if rowwise:
        return _quantize_mxfp8_rowwise(x_RH, dtype)
    x_BKH = x_RH.view(rows // MXFP8_SCALE_BLOCK, MXFP8_SCALE_BLOCK, hidden)
    scale_inv_BH = _e8m0_scale_inv(x_BKH.abs().amax(dim=1))
    # Division by an exact power of two (e8m0 -> float32 is exact, 2^-127 included): the only
    # rounding is the e4m3 cast.
    data_RH = _saturate_to_fp8((x_BKH / scale_inv_BH.float().unsqueeze(1)).view(rows, hidden))
    return Fp8Tensor(data_RH, scale_inv_BH, recipe, dtype)


def _e8m0_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """The e8m0 scale-inverse ``2^e`` of blocks with maxima ``amax`` (float32)."""
    # Exact integer form of e = ceil(log2(amax / 448)): with amax = m·2^k (m in [0.5, 1)) and
    # 448 = 0.875·2^9, amax <= 448·2^e  <=>  e >= k - 9 when m <= 0.875, else e >= k - 8.
    # Worked example: amax = 500 = 0.977·2^9 -> e = 1, data max 250; amax = 448 -> e = 0.
    mant, exp = torch.frexp(amax)
    e = exp - 9 + (mant > FP8_E4M3_MAX / 512).to(exp.dtype)
    e = torch.where(amax > 0, e, -_E8M0_BIAS).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    biased = torch.where(torch.isfinite(amax), e + _E8M0_BIAS, _E8M0_NAN)
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def _quantize_mxfp8_rowwise(x_RH: torch.Tensor, dtype: torch.dtype) -> Fp8Tensor:
    """Rowwise MXFP8 of the float32 ``x_RH`` (padding rows already zero): blocks of 32 elements
    of a row, the last one short when ``H`` is not a multiple of 32 (zero-padded for its amax)."""
    rows, hidden = x_RH.shape
    blocks = -(-hidden // MXFP8_SCALE_BLOCK)
    x_RBK = torch.nn.functional.pad(x_RH, (0, blocks * MXFP8_SCALE_BLOCK - hidden))
    x_RBK = x_RBK.view(rows, blocks, MXFP8_SCALE_BLOCK)
    scale_inv_RB = _e8m0_scale_inv(x_RBK.abs().amax(dim=-1))
    data_RBK = _saturate_to_fp8(x_RBK / scale_inv_RB.float().unsqueeze(-1))
    data_RH = data_RBK.view(rows, blocks * MXFP8_SCALE_BLOCK)[:, :hidden].contiguous()
    return Fp8Tensor(data_RH, scale_inv_RB, Fp8Recipe.MXFP8, dtype, rowwise=True)


def _quantize_nvfp4(x_RH: torch.Tensor, dtype: torch.dtype) -> Fp8Tensor:
    """NVFP4 of the float32 ``x_RH`` (padding rows already zero): see the module docstring."""
    rows, hidden = x_RH.shape
    amax = x_RH.abs().amax() if x_RH.numel() else x_RH.new_zeros(())
    usable = (amax > 0) & torch.isfinite(amax)
    g = torch.where(usable, FP8_E4M3_MAX * FP4_E2M1_MAX / amax, 1.0)
    g = g.clamp(max=torch.finfo(torch.float32).max)
    x_RBK = x_RH.view(rows, hidden // NVFP4_BLOCK, NVFP4_BLOCK)
    s_RB = _saturate_to_fp8(x_RBK.abs().amax(dim=-1) / FP4_E2M1_MAX * g)
    s = s_RB.float()
    encode_RB = torch.where(s > 0, g / s, 0.0)
    codes_RH = _e2m1_codes(x_RBK * encode_RB.unsqueeze(-1)).view(rows, hidden)
    data_RH2 = codes_RH[:, 0::2] | (codes_RH[:, 1::2] << 4)
    return Fp8Tensor(data_RH2, s_RB, Fp8Recipe.NVFP4, dtype, g.reciprocal().reshape(1))


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (``uint8``, sign in bit 3) of ``v``: round to nearest on the grid, ties to
    the even code, saturating at 6 (NaN stores 0). Device arithmetic only, no table."""
    a = torch.nan_to_num(v.abs(), nan=0.0).clamp(max=FP4_E2M1_MAX)
    # The grid's steps are 0.5 below 2, 1 below 4, 2 up to 6; torch.round halves to even.
    q = torch.where(a < 2, torch.round(a * 2) / 2,
                    torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))  # fmt: skip
    code = torch.where(q < 2, q * 2, torch.where(q < 4, q + 2, q / 2 + 4)).to(torch.uint8)
    return code | (torch.signbit(v) & (code > 0)).to(torch.uint8) << 3


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 ``codes`` (``uint8`` 0–15)."""
    e = ((codes >> 1) & 3).float()
    m = (codes & 1).float()
    value = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1 + 0.5 * m))
    return torch.where((codes & 8) > 0, -value, value)


def dequantize(fp8: Fp8Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data · scale_inv`` in float32, cast to ``dtype`` (default: the original dtype)."""
    dtype = fp8.dtype if dtype is None else dtype
    if fp8.recipe is Fp8Recipe.NVFP4:
        rows, half = fp8.data.shape
        hidden = 2 * half
        if fp8.scale_inv.shape != (rows, hidden // NVFP4_BLOCK) or fp8.global_scale_inv is None:
            raise ValueError(f"NVFP4 scale_inv of shape {tuple(fp8.scale_inv.shape)} (global "
                             f"{fp8.global_scale_inv is not None}) does not match data of shape "
                             f"{(rows, half)}")  # fmt: skip
        codes_RH = torch.stack((fp8.data & 15, fp8.data >> 4), dim=-1).view(rows, hidden)
        v_RBK = _e2m1_values(codes_RH).view(rows, hidden // NVFP4_BLOCK, NVFP4_BLOCK)
        v_RBK = v_RBK * fp8.scale_inv.float().unsqueeze(-1)
        return (v_RBK.view(rows, hidden) * fp8.global_scale_inv.float()).to(dtype)
    data_RH = fp8.data.float()
    if fp8.recipe is Fp8Recipe.TENSORWISE:
        return (data_RH * fp8.scale_inv.float()).to(dtype)
    rows, hidden = data_RH.shape
    if fp8.rowwise:
        blocks = -(-hidden // MXFP8_SCALE_BLOCK)
        if fp8.scale_inv.shape != (rows, blocks):
            raise ValueError(f"rowwise MXFP8 scale_inv of shape {tuple(fp8.scale_inv.shape)} "
                             f"does not match data of shape {(rows, hidden)}")  # fmt: skip
        scale_RH = fp8.scale_inv.float().repeat_interleave(MXFP8_SCALE_BLOCK, dim=1)
        return (data_RH * scale_RH[:, :hidden]).to(dtype)
    if fp8.scale_inv.shape != (rows // MXFP8_SCALE_BLOCK, hidden):
        raise ValueError(f"MXFP8 scale_inv of shape {tuple(fp8.scale_inv.shape)} does not match "
                         f"data of shape {(rows, hidden)}")  # fmt: skip
    data_BKH = data_RH.view(rows // MXFP8_SCALE_BLOCK, MXFP8_SCALE_BLOCK, hidden)
    return (data_BKH * fp8.scale_inv.float().unsqueeze(1)).view(rows, hidden).to(dtype)


def mark_fp8_saved(fp8: Fp8Tensor) -> None:
    """Mark the dynamic parts of ``fp8`` for the paged stash.

    ``data`` has one row per token; an MXFP8 ``scale_inv`` has one row per 32 tokens (marked with
    ``scale_inv=True``), a rowwise MXFP8 or an NVFP4 one one row per token. The tensorwise
    ``scale_inv`` and NVFP4's ``global_scale_inv`` are static ``[1]`` and stay unmarked.
    """
    mark_grouped_tensor(fp8.data)
    if fp8.recipe is Fp8Recipe.MXFP8 and not fp8.rowwise:
        mark_grouped_tensor(fp8.scale_inv, scale_inv=True)
    elif fp8.recipe is not Fp8Recipe.TENSORWISE:  # NVFP4, rowwise MXFP8: a row per token
        mark_grouped_tensor(fp8.scale_inv)
