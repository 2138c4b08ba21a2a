"""Fused probability-weighted SwiGLU/QuickGeGLU: numerics against unfused autograd references,
marker placement on the exact saved tensors, and bitwise parity through the paged stash."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from te_paged.grouped import (
    Fp8Recipe,
    dequantize,
    fp8_supported,
    quantize,
    weighted_quick_geglu,
    weighted_swiglu,
)
from te_paged.markers import (
    MarkerKind,
    grouped_tensor_marker,
    is_grouped_tensor_marked,
    mark_grouped_tensor,
)
from te_paged.stash import PagedStashManager, StashMode

needs_fp8 = pytest.mark.skipif(not fp8_supported()[0], reason=fp8_supported()[1])

ROWS, FFN = 64, 24


# ------------------------------------------------------------------------------ references


def ref_swiglu(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up * probs.reshape(-1, 1)


def ref_quick_geglu(
    x: torch.Tensor, probs: torch.Tensor, limit: float | None = None, linear_offset: float = 0.0
) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(1.702 * gate) * (up + linear_offset) * probs.reshape(-1, 1)


CASES = {
    "swiglu": (weighted_swiglu, ref_swiglu),
    "quick_geglu": (weighted_quick_geglu, ref_quick_geglu),
    "quick_geglu_clamp_offset": (
        functools.partial(weighted_quick_geglu, limit=2.5, linear_offset=1.0),
        functools.partial(ref_quick_geglu, limit=2.5, linear_offset=1.0),
    ),
}


def _inputs(dtype=torch.float32, probs_2d=False, seed=0, rows=ROWS):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * FFN, generator=g) * 2).to(dtype)
    probs = torch.rand(rows, 1 if probs_2d else None, generator=g) if probs_2d else None
    if probs is None:
        probs = torch.rand(rows, generator=g)
    dy = torch.randn(rows, FFN, generator=g).to(dtype)
    return x, probs, dy


def _run(fn, x, probs, dy, **kw):
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    y = fn(x, probs, **kw)
    y.backward(dy)
    return y.detach(), x.grad, probs.grad


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


# ------------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("probs_2d", [False, True])
def test_fp32_matches_unfused_reference(case: str, probs_2d: bool) -> None:
    fused, ref = CASES[case]
    x, probs, dy = _inputs(probs_2d=probs_2d)
    y, dx, dp = _run(fused, x, probs, dy)
    y_ref, dx_ref, dp_ref = _run(ref, x, probs, dy)
    # Forward evaluates the same float32 ops in the same order, and d_probs = Σ_F dy·(act·up)
    # associates its products as autograd's chain does: both bitwise equal.
    assert _bitwise_equal(y, y_ref)
    assert _bitwise_equal(dp, dp_ref)
    assert dp.shape == probs.shape and dp.dtype == probs.dtype
    # d_x uses closed-form derivatives whose products associate differently from autograd's
    # chain rule: 1-2 float32 ulps of values of magnitude <= ~10, within 1e-6 relative/absolute.
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
    assert not _bitwise_equal(dx, torch.zeros_like(dx))


@pytest.mark.parametrize("case", CASES)
def test_float64_gradcheck(case: str) -> None:
    fused, _ = CASES[case]
    x, probs, _ = _inputs(rows=8)
    x = x.double()
    # Keep finite differences off the clamp's kinks at ±2.5.
    x = torch.where((x.abs() - 2.5).abs() < 1e-3, x + 0.01, x).requires_grad_()
    probs = probs.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: fused(a, b), (x, probs))


@pytest.mark.parametrize("case", CASES)
def test_bf16_matches_float32_reference_within_one_bf16_ulp(case: str) -> None:
    fused, ref = CASES[case]
    x, probs, dy = _inputs(dtype=torch.bfloat16)
    probs = probs.bfloat16()
    y, dx, dp = _run(fused, x, probs, dy)
    assert y.dtype == dx.dtype == dp.dtype == torch.bfloat16
    # Reference: the float32 formulas on the same bf16 values, rounded once to bf16. The fused
    # kernel also computes in float32 and rounds once, so results differ only where a float32
    # rounding difference flips the bf16 rounding: at most one bf16 ulp (2^-7 relative).
    y_ref, dx_ref, dp_ref = _run(ref, x.float(), probs.float(), dy.float())
    for got, want in ((y, y_ref), (dx, dx_ref), (dp, dp_ref)):
        torch.testing.assert_close(got, want.bfloat16(), rtol=2**-7, atol=1e-5)


def test_three_dim_input_and_output_shape() -> None:
    x, probs, dy = _inputs()
    x3 = x.view(4, ROWS // 4, 2 * FFN)
    y, dx, _ = _run(weighted_swiglu, x3, probs, dy.view(4, ROWS // 4, FFN))
    assert y.shape == (4, ROWS // 4, FFN) and dx.shape == x3.shape
    assert _bitwise_equal(y.view(ROWS, FFN), _run(weighted_swiglu, x, probs, dy)[0])


def test_quick_geglu_clamp_gradients_are_zero_where_clamped() -> None:
    limit = 1.5
    x, probs, dy = _inputs()
    x[:4, :FFN] = limit  # exactly at the limit: the gradient follows the running torch.clamp
    x[:4, FFN:] = -limit
    fused = functools.partial(weighted_quick_geglu, limit=limit, linear_offset=1.0)
    ref = functools.partial(ref_quick_geglu, limit=limit, linear_offset=1.0)
    y, dx, dp = _run(fused, x, probs, dy)
    y_ref, dx_ref, dp_ref = _run(ref, x, probs, dy)
    assert _bitwise_equal(y, y_ref)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dp, dp_ref, rtol=1e-6, atol=1e-6)
    gate, up = x[:, :FFN], x[:, FFN:]
    dgate, dup = dx[:, :FFN], dx[:, FFN:]
    assert bool((gate > limit).any()) and bool((up.abs() > limit).any())
    assert not bool(dgate[gate > limit].any())
    assert not bool(dup[up.abs() > limit].any())
    at_limit = torch.tensor([limit, -limit], requires_grad=True)
    at_limit.clamp(-limit, limit).sum().backward()
    passes = bool(at_limit.grad.all())  # torch <= 2.14: passes; 2.15: stops
    on_limit = torch.cat([dgate[:4], dup[:4]])
    assert bool(on_limit.all()) if passes else not bool(on_limit.any()), (
        f"torch {torch.__version__}'s clamp {'passes' if passes else 'stops'} the gradient at "
        "the limit; the fused QuickGeGLU does not"
    )
    # The clamp matters: without it the outputs differ.
    assert not torch.equal(y, _run(weighted_quick_geglu, x, probs, dy, linear_offset=1.0)[0])


@needs_fp8
@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "nvfp4"])
def test_fp8_store_forward_and_backward_use_the_dequantised_input(recipe: str) -> None:
    x, probs, dy = _inputs(dtype=torch.bfloat16)
    y, dx, dp = _run(weighted_swiglu, x, probs, dy, fp8_input_store=recipe)
    x_q = dequantize(quantize(x, recipe))
    y_ref, dx_ref, dp_ref = _run(weighted_swiglu, x_q, probs, dy)
    assert _bitwise_equal(y, y_ref)
    assert _bitwise_equal(dx, dx_ref) and _bitwise_equal(dp, dp_ref)
    assert not torch.equal(y, _run(weighted_swiglu, x, probs, dy)[0])  # FP8 really was used


def test_invalid_arguments_are_rejected() -> None:
    x, probs, _ = _inputs()
    with pytest.raises(ValueError, match="even"):
        weighted_swiglu(x[:, :-1], probs)
    with pytest.raises(ValueError, match=r"probs must have shape \[64\] or \[64, 1\]"):
        weighted_swiglu(x, probs[:-1])
    with pytest.raises(TypeError, match="floating-point"):
        weighted_swiglu(x.int(), probs)
    with pytest.raises(ValueError, match="fp8_input_store must be None or one of"):
        weighted_swiglu(x, probs, fp8_input_store="fp4")
    with pytest.raises(ValueError, match="limit must be None or a finite value > 0"):
        weighted_quick_geglu(x, probs, limit=0.0)
    with pytest.raises(ValueError, match="multiple of 32"):
        weighted_swiglu(x[:48], probs[:48], fp8_input_store=Fp8Recipe.MXFP8)


# -------------------------------------------------------------------------------- markers


def _saved_markers(fn, x, probs, **kw) -> list[tuple[tuple[int, ...], MarkerKind | None]]:
    """``(shape, marker kind)`` of every tensor saved for backward while ``fn`` runs."""
    seen = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        assert is_grouped_tensor_marked(t) == (grouped_tensor_marker(t) is not None)
        seen.append((tuple(t.shape), grouped_tensor_marker(t)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, probs, **kw)
    return seen


TOKEN, SCALE = MarkerKind.TOKEN_ROWS, MarkerKind.SCALE_INV_ROWS
XV = (ROWS, 2 * FFN)
FP8_SAVED = {
    None: lambda kind: [(XV, kind)],
    "tensorwise": lambda kind: [(XV, kind), ((1,), None)],
    "mxfp8": lambda kind: [(XV, kind), ((ROWS // 32, 2 * FFN), kind and SCALE)],
}
STORES = [None, pytest.param("tensorwise", marks=needs_fp8), pytest.param("mxfp8", marks=needs_fp8)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("store", STORES)
def test_paged_stash_marks_every_saved_token_tensor(case: str, store: str | None) -> None:
    x, probs, _ = _inputs()
    x3 = x.view(2, ROWS // 2, 2 * FFN).requires_grad_()  # the saved tensor is the [R, 2F] view
    probs = probs.view(ROWS, 1).requires_grad_()
    seen = _saved_markers(CASES[case][0], x3, probs, paged_stash=True, fp8_input_store=store)
    assert seen == [*FP8_SAVED[store](TOKEN), ((ROWS,), TOKEN)]
    # The caller's tensors are not mutated: only the fresh views/FP8 parts carry the marker.
    assert not is_grouped_tensor_marked(x3) and not is_grouped_tensor_marked(probs)


@pytest.mark.parametrize("store", STORES)
def test_without_paged_stash_an_unmarked_input_saves_nothing_marked(store: str | None) -> None:
    x, probs, _ = _inputs()
    seen = _saved_markers(weighted_swiglu, x.requires_grad_(), probs, fp8_input_store=store)
    assert seen == [*FP8_SAVED[store](None), ((ROWS,), None)]


@pytest.mark.parametrize("store", STORES)
def test_without_paged_stash_a_marked_producer_output_stays_marked(store: str | None) -> None:
    x, probs, _ = _inputs()
    x = x.requires_grad_() * 1.0  # a producer's output, marked by the producer
    mark_grouped_tensor(x)
    seen = _saved_markers(weighted_quick_geglu, x, probs, fp8_input_store=store)
    assert seen == [*FP8_SAVED[store](TOKEN), ((ROWS,), None)]  # probs was never marked


@pytest.mark.parametrize("store", STORES)
def test_detached_input_from_a_recompute_wrapper_is_still_marked(store: str | None) -> None:
    # Selective recompute re-runs the activation on detach()-ed copies of its inputs: the
    # producer's marker does not survive, so marking must follow the paged_stash argument.
    x, probs, _ = _inputs()
    produced = x.requires_grad_() * 1.0
    mark_grouped_tensor(produced)
    detached = produced.detach().requires_grad_()
    assert not is_grouped_tensor_marked(detached)
    seen = _saved_markers(weighted_swiglu, detached, probs.detach(), paged_stash=True,
                          fp8_input_store=store)  # fmt: skip
    assert seen == [*FP8_SAVED[store](TOKEN), ((ROWS,), TOKEN)]


# --------------------------------------------------------------------- paged stash end-to-end


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("store", STORES)
def test_paged_stash_is_bitwise_invisible(case: str, store: str | None) -> None:
    fused = CASES[case][0]
    n = 40  # actual tokens; rows 40..63 are padding (zero inputs and probs, as dispatched)
    x, probs, dy = _inputs(dtype=torch.bfloat16)
    x[n:], probs[n:] = 0, 0
    num_tokens = torch.tensor([n])
    kw = dict(paged_stash=True, fp8_input_store=store, num_rows=num_tokens)
    ref = _run(fused, x, probs, dy, **kw)  # no scope: nothing is paged
    manager = PagedStashManager(page_size=16, skip_immediate_backward=False)
    for _step in range(2):  # capture step, then the captured (pooled) step
        manager.reset()
        xs, ps = x.clone().requires_grad_(), probs.clone().requires_grad_()
        with manager.scope(ROWS, num_tokens, n):
            y = fused(xs, ps, **kw)
        y.backward(dy)
        for got, want in zip((y, xs.grad, ps.grad), ref):
            assert _bitwise_equal(got.detach(), want)
        stats = manager.stats()
        saved = 2 + (store == "mxfp8")  # x (or FP8 data), probs, MXFP8 scale-inverse
        assert stats.stashes == stats.pops == saved
        assert stats.bytes_stashed > 0 and not stats.overflow
    assert stats.mode is StashMode.CAPTURED
