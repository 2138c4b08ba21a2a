"""FP8 storage of saved inputs: numerics of both recipes, padding, and paging through the stash.

Error bound used throughout: e4m3 keeps 3 mantissa bits and rounds to nearest, so a value whose
*scaled* magnitude is normal (>= 2^-6) comes back with relative error <= 2^-4; a scaled subnormal
has absolute error <= 2^-10 (half the subnormal spacing 2^-9). In the unscaled domain:
``|deq - x| <= max(2^-4·|x|, 2^-10·scale_inv)``, plus float32 slack for the tensorwise
scale-inverse, which is not a power of two.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from te_paged.grouped.fp8 import (
    FP8_E4M3_MAX,
    Fp8Recipe,
    Fp8Tensor,
    dequantize,
    fp8_supported,
    mark_fp8_saved,
    quantize,
)
from te_paged.markers import MarkerKind, grouped_tensor_marker
from te_paged.stash import PagedStashManager, StashKey, StashMode

ok, reason = fp8_supported()
pytestmark = pytest.mark.skipif(not ok, reason=reason)

RECIPES = [Fp8Recipe.TENSORWISE, Fp8Recipe.MXFP8]  # the FP8 ones: NVFP4 in test_nvfp4.py


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _elementwise_scale_inv(fp8: Fp8Tensor) -> torch.Tensor:
    """The scale-inverse of every element, ``[R, H]`` float32."""
    rows, hidden = fp8.data.shape
    if fp8.recipe is Fp8Recipe.TENSORWISE:
        return fp8.scale_inv.float().expand(rows, hidden)
    return fp8.scale_inv.float().repeat_interleave(32, dim=0)


def _assert_within_bound(x: torch.Tensor, fp8: Fp8Tensor, slack: float) -> None:
    err = (dequantize(fp8, torch.float32) - x.float()).abs()
    bound = torch.maximum(2**-4 * x.float().abs(), 2**-10 * _elementwise_scale_inv(fp8))
    assert bool((err <= bound * (1 + slack)).all()), float((err / bound).max())
    # The bound is nearly attained: the test would notice a lossless (i.e. not FP8) store.
    assert float((err / bound).max()) > 0.5


def _sample(rows: int, hidden: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g) * 3


def test_fp8_supported_reports_ok_on_this_torch() -> None:
    assert fp8_supported() == (True, "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensorwise_error_bound_and_layout(dtype: torch.dtype) -> None:
    x = _sample(64, 48).to(dtype)
    fp8 = quantize(x, Fp8Recipe.TENSORWISE)
    assert fp8.data.dtype == torch.float8_e4m3fn and fp8.data.shape == (64, 48)
    assert fp8.scale_inv.dtype == torch.float32 and fp8.scale_inv.shape == (1,)
    assert fp8.dtype == dtype and dequantize(fp8).dtype == dtype
    # amax maps onto 448 exactly (up to the float32 rounding of 448/amax).
    torch.testing.assert_close(fp8.scale_inv[0], x.float().abs().max() / FP8_E4M3_MAX)
    _assert_within_bound(x, fp8, slack=2**-20)


def test_mxfp8_error_bound_holds_per_block_across_a_wide_dynamic_range() -> None:
    # Columns span 1e-4 .. 1e4: one tensorwise scale would flush the small columns to zero, a
    # power-of-two scale per 32 tokens of one column keeps every block within the bound.
    x = _sample(96, 16) * torch.logspace(-4, 4, 16)
    fp8 = quantize(x, "mxfp8")
    assert fp8.scale_inv.dtype == torch.float8_e8m0fnu and fp8.scale_inv.shape == (3, 16)
    _assert_within_bound(x, fp8, slack=0.0)  # power-of-two scales add no rounding
    tensorwise = dequantize(quantize(x, "tensorwise"))
    assert bool((tensorwise[:, 0] == 0).any())  # what MXFP8 avoids


def test_mxfp8_scales_are_the_smallest_powers_of_two_that_avoid_saturation() -> None:
    x = _sample(64, 32, seed=1) * torch.logspace(-30, 30, 32)
    fp8 = quantize(x, Fp8Recipe.MXFP8)
    s = fp8.scale_inv.float()
    mant, _ = torch.frexp(s)
    assert bool((mant == 0.5).all())  # exact powers of two
    amax = x.view(2, 32, 32).abs().amax(dim=1)
    assert bool((amax / s <= FP8_E4M3_MAX).all())  # never saturates...
    assert bool((amax / s > FP8_E4M3_MAX / 2).all())  # ...and is the smallest such power


@pytest.mark.parametrize(
    ("amax", "exponent"),
    [
        (448.0, 0),
        (500.0, 1),
        (448.00004, 1),
        (447.99997, 0),
        (1.0, -8),
        (896.0, 1),
        (2.0**-140, -127),
    ],
)
def test_mxfp8_scale_rule_worked_examples(amax: float, exponent: int) -> None:
    # e = ceil(log2(amax / 448)), clamped to e8m0's [-127, 127] (amax = 500: OCP's
    # floor(log2 amax) - 8 = 0 would clip 500 to 448; this rule picks 2^1 and stores 250).
    x = torch.zeros(32, 1)
    x[3, 0] = amax
    fp8 = quantize(x, "mxfp8")
    assert int(_bytes(fp8.scale_inv)[0, 0]) == exponent + 127
    assert float(fp8.data.float().max()) <= FP8_E4M3_MAX


@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_and_empty_tensors(recipe: Fp8Recipe) -> None:
    x = torch.zeros(64, 8, dtype=torch.bfloat16)
    fp8 = quantize(x, recipe)
    assert torch.equal(_bytes(fp8.data), torch.zeros(64, 8, dtype=torch.uint8))
    if recipe is Fp8Recipe.TENSORWISE:
        assert torch.equal(fp8.scale_inv, torch.ones(1))  # amax == 0: scale 1, not inf
    else:
        assert torch.equal(_bytes(fp8.scale_inv), torch.zeros(2, 8, dtype=torch.uint8))
    assert torch.equal(dequantize(fp8), x)
    empty = quantize(torch.zeros(0, 8), recipe)
    assert empty.data.shape == (0, 8) and dequantize(empty).shape == (0, 8)


def test_tiny_amax_keeps_a_finite_tensorwise_scale() -> None:
    x = torch.full((4, 4), 1e-44)  # 448 / amax overflows float32
    fp8 = quantize(x, "tensorwise")
    assert bool(torch.isfinite(fp8.scale_inv).all()) and bool(fp8.scale_inv > 0)


def test_non_finite_block_gets_the_e8m0_nan_scale() -> None:
    x = torch.ones(64, 2)
    x[40, 1] = float("inf")
    fp8 = quantize(x, "mxfp8")
    assert _bytes(fp8.scale_inv).tolist() == [[127 - 8, 127 - 8], [127 - 8, 255]]
    deq = dequantize(fp8)
    assert bool(deq[32:, 1].isnan().all()) and torch.equal(deq[:, 0], torch.ones(64))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("garbage", [float("nan"), 1e30])
def test_padding_rows_do_not_change_scales_or_real_rows(recipe: Fp8Recipe, garbage: float) -> None:
    n = 40
    x = _sample(64, 24)
    clean = x.clone()
    clean[n:] = 0
    x[n:] = garbage
    fp8 = quantize(x, recipe, num_rows=torch.tensor(n))
    ref = quantize(clean, recipe)
    # Real rows and scales are those of the zero-padded tensor; padding is stored as zero bytes,
    # which is what the paged stash writes into padding on pop.
    assert torch.equal(_bytes(fp8.data), _bytes(ref.data))
    assert torch.equal(fp8.scale_inv.view(torch.uint8), ref.scale_inv.view(torch.uint8))
    assert torch.equal(_bytes(fp8.data[n:]), torch.zeros(64 - n, 24, dtype=torch.uint8))
    if recipe is Fp8Recipe.TENSORWISE:
        torch.testing.assert_close(fp8.scale_inv[0], x[:n].abs().max() / FP8_E4M3_MAX)
    else:
        # Block 1 straddles the boundary (rows 32..63, 8 of them real); its scale ignores the rest.
        amax = x[32:n].abs().amax(dim=0)
        assert bool((amax / fp8.scale_inv[1].float() > FP8_E4M3_MAX / 2).all())


def test_num_rows_zero_masks_everything() -> None:
    fp8 = quantize(_sample(32, 4), "tensorwise", num_rows=torch.tensor([0]))
    assert torch.equal(fp8.scale_inv, torch.ones(1))
    assert not bool(dequantize(fp8).any())


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(48, 4), Fp8Recipe.MXFP8)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.zeros(2, 32, 4), "tensorwise")
    with pytest.raises(TypeError, match="high-precision float"):
        quantize(torch.zeros(32, 4, dtype=torch.int32), "tensorwise")
    with pytest.raises(ValueError, match="not a valid Fp8Recipe"):
        quantize(torch.zeros(32, 4), "fp4")
    with pytest.raises(TypeError, match="integer tensor"):
        quantize(torch.zeros(32, 4), "tensorwise", num_rows=torch.tensor(3.0))
    with pytest.raises(TypeError, match="one-element"):
        quantize(torch.zeros(32, 4), "tensorwise", num_rows=3)  # type: ignore[arg-type]


def test_mark_fp8_saved_marks_dynamic_parts_only() -> None:
    mx = quantize(_sample(64, 4), "mxfp8")
    mark_fp8_saved(mx)
    assert grouped_tensor_marker(mx.data) is MarkerKind.TOKEN_ROWS
    assert grouped_tensor_marker(mx.scale_inv) is MarkerKind.SCALE_INV_ROWS
    tw = quantize(_sample(64, 4), "tensorwise")
    mark_fp8_saved(tw)
    assert grouped_tensor_marker(tw.data) is MarkerKind.TOKEN_ROWS
    assert grouped_tensor_marker(tw.scale_inv) is None  # static [1]


class _SaveFp8(torch.autograd.Function):
    """Quantise, mark and save the FP8 parts; backward hands the unpacked tensors to ``sink``."""

    @staticmethod
    def forward(ctx, x, recipe, num_rows, sink):
        fp8 = quantize(x, recipe, num_rows)
        mark_fp8_saved(fp8)
        ctx.save_for_backward(fp8.data, fp8.scale_inv)
        ctx.sink = sink
        return x.clone()

    @staticmethod
    def backward(ctx, dy):
        ctx.sink.append(ctx.saved_tensors)
        return dy, None, None, None


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_parts_round_trip_through_the_paged_stash(recipe: Fp8Recipe) -> None:
    max_tokens, n, hidden = 64, 40, 48
    x = _sample(max_tokens, hidden)
    x[n:] = 7.0  # padding: excluded by num_rows, and not what comes back either
    num_tokens = torch.tensor([n])
    ref = quantize(x, recipe, num_tokens)
    manager = PagedStashManager(page_size=16, skip_immediate_backward=False)
    data_key = StashKey(torch.float8_e4m3fn, hidden)
    scale_key = StashKey(torch.float8_e8m0fnu, hidden)  # hidden = numel / (64 / 32)
    mx = recipe is Fp8Recipe.MXFP8
    for _step in range(2):  # capture step, then the captured (pooled) step
        manager.reset()
        sink: list[tuple[torch.Tensor, ...]] = []
        xs = x.clone().requires_grad_()
        with manager.scope(max_tokens, num_tokens, n):
            y = _SaveFp8.apply(xs, recipe, num_tokens, sink)
        y.sum().backward()
        data, scale_inv = sink[0]
        # Bitwise: real rows and the straddling scale block are moved as bytes; padding comes
        # back as zero bytes, which is exactly what quantize() stored there.
        assert torch.equal(_bytes(data), _bytes(ref.data))
        assert torch.equal(scale_inv.view(torch.uint8), ref.scale_inv.view(torch.uint8))
        stats = manager.stats()
        assert stats.stashes == stats.pops == (2 if mx else 1)  # tensorwise [1] stays put
        # 40 data rows of 48 bytes, and ceil(40 / 32) = 2 scale rows of 48 bytes.
        assert stats.bytes_stashed == (n + (2 if mx else 0)) * hidden
        assert not stats.overflow
    assert stats.mode is StashMode.CAPTURED
    assert stats.capture_peak_rows[str(data_key)] == n
    assert (str(scale_key) in stats.pool_pages) is mx
    if mx:
        assert scale_key in manager.buffers and manager.buffers[scale_key].key.hidden == hidden
        assert stats.capture_peak_rows[str(scale_key)] == 2
        assert stats.pages_high_water[str(scale_key)] == 1  # 2 rows fit one 16-row page
    assert stats.pages_high_water[str(data_key)] == 3  # 40 rows = 3 pages of 16


# ------------------------------------------------------------------ MXFP8's rowwise layout


def _wide(rows: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """Rows and columns spanning 2^-20..2^20: blocks pick very different exponents."""
    g = torch.Generator().manual_seed(seed)
    row_scale = 2.0 ** torch.randint(-20, 21, (rows, 1), generator=g)
    return _sample(rows, hidden, seed) * row_scale * 2.0 ** torch.randint(-20, 21, (1, hidden))


def test_rowwise_mxfp8_layout_and_error_bound() -> None:
    x = _wide(40, 72)  # rows need not be a multiple of 32; 72 columns: a short last block
    fp8 = quantize(x, "mxfp8", rowwise=True)
    assert fp8.rowwise and fp8.data.shape == (40, 72) and fp8.scale_inv.shape == (40, 3)
    assert fp8.scale_inv.dtype == torch.float8_e8m0fnu
    # Each row's block of 32 columns (the last one 8 wide) is its own power-of-two scale.
    scale = fp8.scale_inv.float().repeat_interleave(32, dim=1)[:, :72]
    amax = torch.nn.functional.pad(x.abs(), (0, 24)).view(40, 3, 32).amax(-1)
    assert bool((amax / fp8.scale_inv.float() <= FP8_E4M3_MAX).all())
    assert bool((amax / fp8.scale_inv.float() > FP8_E4M3_MAX / 2).all())
    err = (dequantize(fp8) - x).abs()
    assert bool((err <= torch.maximum(2**-4 * x.abs(), 2**-10 * scale)).all())
    columnwise = dequantize(quantize(x[:32], "mxfp8"))
    assert not torch.equal(dequantize(fp8)[:32], columnwise)  # the other layout: other values


@pytest.mark.parametrize("rowwise", [True, False])
@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
@settings(max_examples=30, deadline=None)
def test_mxfp8_requantisation_gives_the_same_values(rowwise: bool, seed: int, dtype) -> None:
    """What lets a layer take a tensor that arrived quantised as it is (the module docstring's
    argument): dequantise, quantise again with the same layout, the values do not change."""
    x = _wide(64, 48, seed).to(dtype)
    x[::7] = 0.0  # all-zero rows and blocks too
    once = dequantize(quantize(x, "mxfp8", rowwise=rowwise))
    assert torch.equal(dequantize(quantize(once, "mxfp8", rowwise=rowwise)), once)


def test_rowwise_padding_rows_get_zero_scales_and_are_marked_as_token_rows() -> None:
    x = _wide(32, 64)
    x[20:] = float("nan")
    fp8 = quantize(x, "mxfp8", num_rows=torch.tensor(20), rowwise=True)
    assert not bool(_bytes(fp8.scale_inv)[20:].any()) and not bool(_bytes(fp8.data)[20:].any())
    assert torch.equal(fp8.data[:20].view(torch.uint8),
                       quantize(x[:20], "mxfp8", rowwise=True).data.view(torch.uint8))  # fmt: skip
    mark_fp8_saved(fp8)
    assert grouped_tensor_marker(fp8.data) is MarkerKind.TOKEN_ROWS
    assert grouped_tensor_marker(fp8.scale_inv) is MarkerKind.TOKEN_ROWS  # a scale row a token
    rebuilt, rest = Fp8Tensor.from_saved([*fp8.saved(), x], fp8.recipe, x.dtype, rowwise=True)
    assert torch.equal(dequantize(rebuilt)[:20], dequantize(fp8)[:20]) and len(rest) == 1


def test_rowwise_is_mxfp8_only_and_checks_its_scale_shape() -> None:
    with pytest.raises(ValueError, match="rowwise=True is MXFP8's layout"):
        quantize(torch.zeros(32, 32), "tensorwise", rowwise=True)
    fp8 = quantize(torch.ones(32, 64), "mxfp8", rowwise=True)
    fp8.scale_inv = fp8.scale_inv[:, :1]
    with pytest.raises(ValueError, match="rowwise MXFP8 scale_inv"):
        dequantize(fp8)
