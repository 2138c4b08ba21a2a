"""GroupedLinear against a loop of F.linear per expert, on CPU.

Bitwise expectations (checked on torch 2.13's CPU ``_grouped_mm``, which runs one ``mm`` per
group on the same operand layouts ``F.linear`` and its backward use): forward, input gradient and
weight gradient are ``torch.equal`` to the per-expert loop in fp32 *and* bf16, with the bias added
after the GEMM (``F.linear(x, w) + b``). On CPU the bias gradient sums each group's rows as the
loop does (``sum(0)``), so it is bitwise equal too; on CUDA it is a GEMM against ones, another
summation order. ``F.linear(x, w, b)`` itself (``addmm``) is not the same math: the bias enters
the GEMM's accumulator.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from te_paged import PagedStashManager, is_grouped_tensor_marked
from te_paged.grouped import (
    GroupedLinear,
    GroupedTensor,
    dequantize,
    make_grouped_linear,
    quantize,
)
from te_paged.markers import GROUPED_TENSOR_ATTR
from tests.host_reads import NoHostReads

E8M0 = torch.float8_e8m0fnu
E, IN, OUT, T = 4, 32, 48, 64
SPLITS = [5, 0, 17, 9]  # a zero-token expert and 33 padding rows


def _module(dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    return GroupedLinear(E, IN, OUT, params_dtype=dtype, **kw)


def _weights(mod):
    ws = mod.weight_params()
    return list(ws[0].unbind(0)) if mod.single_grouped_weight else ws


def _biases(mod):
    bs = mod.bias_params()
    return list(bs[0].unbind(0)) if mod.single_grouped_bias else bs


def _grads(params):
    return [p.grad for p in params]


def _inputs(dtype=torch.float32, rows=T, seed=1, pad=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g).to(dtype)
    dy = torch.randn(rows, OUT, generator=g).to(dtype)
    x[sum(SPLITS) :] = pad
    return x, dy


def _run(mod, x, dy, splits):
    x = x.detach().clone().requires_grad_()
    for p in mod.parameters():
        p.grad = None
    out = mod(x, splits)
    out.backward(dy)
    return out.detach(), x.grad, [p.grad for p in mod.parameters()]


def _reference(mod, x, dy, splits, fused_bias=False):
    """Loop of F.linear over leaf copies of the module's per-expert weights/biases."""
    ws = [w.detach().clone().requires_grad_() for w in _weights(mod)]
    bs = [b.detach().clone().requires_grad_() for b in _biases(mod)]
    x = x.detach().clone().requires_grad_()
    n = sum(splits)
    outs = []
    for g, x_g in enumerate(torch.split(x[:n], splits)):
        if fused_bias:
            outs.append(F.linear(x_g, ws[g], bs[g]))
        else:
            outs.append(F.linear(x_g, ws[g]) + bs[g] if bs else F.linear(x_g, ws[g]))
    out = torch.cat([*outs, x.new_zeros(x.shape[0] - n, OUT)])
    out.backward(dy)
    return out.detach(), x.grad, _grads(ws), _grads(bs)


def _module_grads(mod):
    """Per-expert weight and bias grads of ``mod`` (slices of the grouped grads when single)."""
    w = [p.grad for p in mod.weight_params()]
    b = [p.grad for p in mod.bias_params()]
    w = list(w[0].unbind(0)) if mod.single_grouped_weight else w
    b = list(b[0].unbind(0)) if mod.single_grouped_bias else b
    return w, b


def _assert_matches_reference(mod, x, dy, splits, dtype):
    out, dx, _ = _run(mod, x, dy, torch.tensor(splits))
    r_out, r_dx, r_dw, r_db = _reference(mod, x, dy, splits)
    dw, db = _module_grads(mod)
    assert torch.equal(out, r_out)
    assert torch.equal(dx, r_dx)
    assert all(torch.equal(a, b) for a, b in zip(dw, r_dw))
    assert all(torch.equal(a, b) for a, b in zip(db, r_db))  # on CPU: the same sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("single", [False, True])
def test_matches_per_expert_linear(dtype, bias, single):
    mod = _module(
        dtype, bias=bias, single_grouped_weight=single, single_grouped_bias=single and bias
    )
    if bias:  # zero-initialised biases would hide a wrong bias row
        with torch.no_grad():
            for b in mod.bias_params():
                b.normal_()
    x, dy = _inputs(dtype)
    _assert_matches_reference(mod, x, dy, SPLITS, dtype)


@pytest.mark.parametrize("splits", [[0, 0, T, 0], [T, 0, 0, 0], [0, 0, 0, 0], [0, 3, 0, 0]])
def test_skewed_and_empty_routing(splits):
    mod = _module(bias=True)
    x, dy = torch.randn(T, IN), torch.randn(T, OUT)
    _assert_matches_reference(mod, x, dy, splits, torch.float32)
    if sum(splits) == 0:
        out, dx, grads = _run(mod, x, dy, torch.tensor(splits))
        assert not out.any() and not dx.any() and not any(g.any() for g in grads)


def test_empty_buffer():
    mod = _module(bias=True, single_grouped_weight=True)
    x = torch.randn(0, IN, requires_grad=True)
    out = mod(x, torch.zeros(E, dtype=torch.int64))
    out.sum().backward()
    assert out.shape == (0, OUT) and x.grad.shape == (0, IN)
    assert not mod.weight.grad.any() and not mod.bias0.grad.any()


def test_fused_addmm_reference_within_tolerance():
    # F.linear(x, w, b) is addmm: the bias enters the accumulator, so it rounds differently.
    mod = _module(bias=True)
    with torch.no_grad():
        for b in mod.bias_params():
            b.normal_()
    x, dy = _inputs()
    out, _, _ = _run(mod, x, dy, torch.tensor(SPLITS))
    r_out, _, _, _ = _reference(mod, x, dy, SPLITS, fused_bias=True)
    torch.testing.assert_close(out, r_out, rtol=1e-5, atol=1e-5)


def test_nan_padding_changes_nothing():
    mod = _module(bias=True)
    x, dy = _inputs()
    clean = _run(mod, x, dy, torch.tensor(SPLITS))
    x_nan, dy_nan = x.clone(), dy.clone()
    x_nan[sum(SPLITS) :] = float("nan")
    dy_nan[sum(SPLITS) :] = float("nan")  # the padding output is constant: its grad is ignored
    dirty = _run(mod, x_nan, dy_nan, torch.tensor(SPLITS))
    assert torch.equal(dirty[0], clean[0]) and torch.equal(dirty[1], clean[1])
    assert all(torch.equal(a, b) for a, b in zip(dirty[2], clean[2]))
    assert not dirty[0][sum(SPLITS) :].any() and not dirty[1][sum(SPLITS) :].any()


def test_single_and_discrete_layouts_agree_and_state_dicts_convert():
    discrete = _module(bias=True)
    single = _module(bias=True, single_grouped_weight=True, single_grouped_bias=True, seed=5)
    single.load_state_dict(discrete.state_dict())  # discrete -> stacked
    assert set(single.state_dict()) == {"weight", "bias"}
    x, dy = _inputs()
    a, b = _run(discrete, x, dy, torch.tensor(SPLITS)), _run(single, x, dy, torch.tensor(SPLITS))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(torch.stack(a[2][0::2]), b[2][0])  # weight0..3 vs weight
    assert torch.equal(torch.stack(a[2][1::2]), b[2][1])  # (TE's order: weight{i}, bias{i})
    back = _module(bias=True, seed=7)
    back.load_state_dict(single.state_dict())  # stacked -> discrete
    assert all(torch.equal(p, q) for p, q in zip(back.state_dict().values(),
                                                 discrete.state_dict().values()))  # fmt: skip
    mixed = _module(bias=True, single_grouped_weight=True, seed=9)  # stacked weight, bias{i}
    mixed.load_state_dict(discrete.state_dict())
    assert set(mixed.state_dict()) == {"weight"} | {f"bias{i}" for i in range(E)}
    with pytest.raises(RuntimeError, match="weight3"):
        missing = {k: v for k, v in discrete.state_dict().items() if k != "weight3"}
        single.load_state_dict(missing)


@pytest.mark.parametrize("fp8_recipe", [None, "tensorwise", "mxfp8", "nvfp4"])
def test_single_grouped_weight_matches_discrete_grouped_tensor_path(fp8_recipe):
    # Ported from TE 2.19's test of the same name (TE: within rtol 1e-2 on cuBLAS; its recipes
    # bf16, FP8 current scaling, MXFP8 and FP8 block scaling, the last having no te_paged
    # counterpart; NVFP4 added here): a single grouped weight and discrete weights, both on the
    # device path, give the same output, input gradient and (stacked) weight gradients. Bitwise
    # on CPU.
    experts, in_f, out_f, splits = 3, 64, 64, [32, 64, 32]
    torch.manual_seed(0)
    discrete = GroupedLinear(experts, in_f, out_f, bias=False, params_dtype=torch.bfloat16,
                             fp8_recipe=fp8_recipe)  # fmt: skip
    single = GroupedLinear(experts, in_f, out_f, bias=False, params_dtype=torch.bfloat16,
                           fp8_recipe=fp8_recipe, single_grouped_weight=True)  # fmt: skip
    single.load_state_dict(discrete.state_dict())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(splits), in_f, generator=g).to(torch.bfloat16)
    dy = torch.randn(sum(splits), out_f, generator=g).to(torch.bfloat16)
    a = _run(discrete, x, dy, torch.tensor(splits))
    b = _run(single, x, dy, torch.tensor(splits))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(torch.stack(_module_grads(discrete)[0]), single.weight.grad)


def test_parameters_and_init():
    shapes = []
    mod = GroupedLinear(E, IN, OUT, init_method=lambda w: shapes.append(tuple(w.shape)))
    assert shapes == [(OUT, IN)] * E
    # TE registers weight{i}, bias{i} interleaved per GEMM: optimizer states and anything that
    # zips parameters() positionally line up with a TE model only in that order.
    expected = [name for i in range(E) for name in (f"weight{i}", f"bias{i}")]
    assert [n for n, _ in mod.named_parameters()] == expected
    single = GroupedLinear(E, IN, OUT, single_grouped_weight=True, single_grouped_bias=True)
    assert [n for n, _ in single.named_parameters()] == ["weight", "bias"]
    # TE 2.19 (module/grouped_linear.py, the single parameters re-registered last): a single
    # grouped parameter comes after the per-GEMM ones that remain.
    mixed = GroupedLinear(E, IN, OUT, single_grouped_weight=True)
    assert [n for n, _ in mixed.named_parameters()] == [f"bias{i}" for i in range(E)] + ["weight"]
    mixed = GroupedLinear(E, IN, OUT, single_grouped_bias=True)
    assert [n for n, _ in mixed.named_parameters()] == [f"weight{i}" for i in range(E)] + ["bias"]
    mod = GroupedLinear(E, IN, OUT, single_grouped_weight=True, bias=False)
    assert mod.weight.shape == (E, OUT, IN)
    torch.testing.assert_close(mod.weight.std(), torch.tensor(0.023), rtol=0.1, atol=0)  # TE's
    assert mod.weight.device.type == "cpu"
    with pytest.raises(ValueError, match="num_gemms"):
        GroupedLinear(0, IN, OUT)
    # TE ignores single_grouped_bias without a bias (before: a ValueError).
    no_bias = GroupedLinear(E, IN, OUT, bias=False, single_grouped_bias=True)
    assert [n for n, _ in no_bias.named_parameters()] == [f"weight{i}" for i in range(E)]


@pytest.mark.parametrize(
    "layout",
    [{"single_grouped_weight": True}, {"single_grouped_bias": True}, {"use_grouped_tensor": True}],
)
def test_single_grouped_weight_rejects_host_m_splits(layout):
    # Ported from TE 2.19's test of the same name (its list case; TE's CPU-tensor case needs a
    # CUDA input: on CPU a CPU tensor is the device's): host m_splits on the device path with
    # single grouped parameters, or with use_grouped_tensor=True given by name, raise.
    mod = GroupedLinear(E, IN, OUT, bias=True, **layout)
    x = torch.randn(T, IN)
    for splits in (SPLITS, tuple(SPLITS)):
        with pytest.raises(ValueError, match=r"requires.*CUDA"):
            mod(x, splits)
    mod(x, torch.tensor(SPLITS))  # a tensor on the input's device: the device path
    with pytest.raises(TypeError, match="use_grouped_tensor must be a bool or None"):
        GroupedLinear(E, IN, OUT, use_grouped_tensor=1)


def test_grouped_linear_delay_wgrad_rejects_implicit_fallback():
    # The analogue of TE 2.19's test of the same name: te_paged's implicit fallback is host
    # m_splits taking the legacy path, whose backward computes the weight gradients at once;
    # with delay_wgrad_compute, backward_dw() then raises instead of silently doing nothing.
    mod = GroupedLinear(E, IN, OUT, bias=True, delay_wgrad_compute=True)
    x = torch.randn(T, IN, requires_grad=True)
    mod(x, SPLITS).sum().backward()  # forward and backward pass
    with pytest.raises(RuntimeError, match="implicit fallback is unsupported with "
                                           "delay_wgrad_compute=True"):  # fmt: skip
        mod.backward_dw()
    mod.backward_dw()  # reported once; a device-path step then delays as it should
    mod.zero_grad(set_to_none=True)
    mod(x, torch.tensor(SPLITS)).sum().backward()
    assert all(w.grad is None for w in mod.weight_params())
    mod.backward_dw()
    assert all(w.grad is not None for w in mod.weight_params())


def test_host_splits_take_the_legacy_path_as_in_te():
    # Before: a Python list raised TypeError; TE accepts one (its host path). Since TE 2.19
    # only where use_grouped_tensor was left None and the parameters are per GEMM (above).
    mod, x, dy = _module(bias=True), *_inputs()
    legacy = _module(bias=True, use_grouped_tensor=False)
    legacy.load_state_dict(mod.state_dict())
    ref = _run(legacy, x, dy, SPLITS)
    for splits in (SPLITS, tuple(SPLITS)):
        got = _run(mod, x, dy, splits)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
        assert all(torch.equal(p, q) for p, q in zip(got[2], ref[2]))


def test_device_path_rejects_bad_splits():
    mod, x = _module(), torch.randn(T, IN)
    with pytest.raises(TypeError, match="float32"):
        mod(x, torch.tensor(SPLITS, dtype=torch.float32))
    with pytest.raises(ValueError, match="3 entries, expected num_gemms=4"):
        mod(x, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="meta"):  # a splits tensor on another device
        mod(x, torch.tensor(SPLITS, device="meta"))
    with pytest.raises(ValueError, match=r"\[\.\.\., 32\]"):
        mod(torch.randn(T, IN + 1), torch.tensor(SPLITS))


@pytest.mark.parametrize("fp8_recipe", [None, "tensorwise", "mxfp8", "nvfp4"])
def test_legacy_path_matches_device_path(fp8_recipe):
    dev = _module(bias=True, fp8_recipe=fp8_recipe)
    legacy = _module(bias=True, fp8_recipe=fp8_recipe, use_grouped_tensor=False, seed=3)
    legacy.load_state_dict(dev.state_dict())
    x, dy = _inputs()
    a = _run(dev, x, dy, torch.tensor(SPLITS))
    for splits in (SPLITS, torch.tensor(SPLITS)):
        b = _run(legacy, x, dy, splits)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert all(torch.equal(p, q) for p, q in zip(a[2], b[2]))  # bias gradients too
    with pytest.raises(ValueError, match="sums to 80"):
        legacy(x, [20] * 4)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=E, max_size=E), st.sampled_from([False, True]))
def test_random_routing_matches_legacy(splits, single):
    dev = _module(single_grouped_weight=single)
    legacy = _module(single_grouped_weight=single, use_grouped_tensor=False, seed=2)
    legacy.load_state_dict(dev.state_dict())
    x, dy = torch.randn(T + 16, IN), torch.randn(T + 16, OUT)
    a, b = _run(dev, x, dy, torch.tensor(splits)), _run(legacy, x, dy, splits)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for (name, _), p, q in zip(dev.named_parameters(), a[2], b[2]):
        assert torch.equal(p, q), name


def test_frozen_weights_compute_no_wgrad_and_save_no_input():
    mod = _module(bias=True)
    for w in mod.weight_params():
        w.requires_grad_(False)
    x, dy = _inputs()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, dx, _ = _run(mod, x, dy, torch.tensor(SPLITS))
    assert all(w.grad is None for w in mod.weight_params())
    assert all(b.grad is not None for b in mod.bias_params())
    assert not any(is_grouped_tensor_marked(t) for t in saved)  # x is not needed, not saved
    r_out, r_dx, _, _ = _reference(mod, x, dy, SPLITS)
    assert torch.equal(out, r_out) and torch.equal(dx, r_dx)
    # One frozen expert among trainable ones: only its grad is skipped.
    mod = _module()
    mod.weight1.requires_grad_(False)
    _run(mod, x, dy, torch.tensor(SPLITS))
    grads = {name: p.grad for name, p in mod.named_parameters()}
    assert grads["weight1"] is None
    assert all(g is not None for name, g in grads.items() if name != "weight1")


def test_return_bias():
    mod = _module(bias=True, return_bias=True)
    plain = _module(bias=False)
    x = torch.randn(T, IN)
    out, bias = mod(x, torch.tensor(SPLITS))
    assert torch.equal(out, plain(x, torch.tensor(SPLITS)))  # bias not added
    # TE's form: a list of the per-GEMM biases (in the activation dtype).
    assert isinstance(bias, list) and len(bias) == E
    assert all(torch.equal(b, p) for b, p in zip(bias, mod.bias_params()))
    sum(b.sum() * i for i, b in enumerate(bias)).backward()
    assert [float(b.grad[0]) for b in mod.bias_params()] == [0.0, 1.0, 2.0, 3.0]
    assert _module(bias=False, return_bias=True)(x, torch.tensor(SPLITS))[1] is None
    single = _module(bias=True, return_bias=True, single_grouped_bias=True)
    assert single(x, torch.tensor(SPLITS))[1] is single.bias  # the grouped parameter itself


def test_input_shapes_dtype_cast_and_grouped_tensor():
    mod = _module()
    x = torch.randn(2, T // 2, IN)
    out = mod(x, torch.tensor(SPLITS))
    assert out.shape == (2, T // 2, OUT)
    assert torch.equal(out.view(T, OUT), mod(x.view(T, IN), torch.tensor(SPLITS)))
    gt = GroupedTensor.from_splits(x.view(T, IN), torch.tensor(SPLITS))
    assert torch.equal(mod(gt), out.view(T, OUT))
    xb = x.view(T, IN).bfloat16().requires_grad_()
    yb = mod(xb, torch.tensor(SPLITS))  # fp32 parameters, bf16 activations: weights are cast
    yb.sum().backward()
    assert yb.dtype == torch.bfloat16 and mod.weight0.grad.dtype == torch.float32


def _pack_record(records):
    def pack(t):
        records.append((tuple(t.shape), t.dtype, getattr(t, GROUPED_TENSOR_ATTR, None)))
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def test_saved_input_is_marked_and_callers_tensor_is_not():
    mod = _module(bias=True)
    x = torch.randn(T, IN, requires_grad=True)
    records = []
    with _pack_record(records):
        out = mod(x, torch.tensor(SPLITS))
    marked = [r for r in records if r[2] is not None]
    assert marked == [((T, IN), torch.float32, False)]  # the input, one row per token
    assert ((E,), torch.int32, None) in records  # offsets saved, unmarked
    assert not is_grouped_tensor_marked(x)
    out.sum().backward()


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [
        ("tensorwise", [((T, IN), torch.float8_e4m3fn, False)]),
        ("mxfp8", [((T, IN), torch.float8_e4m3fn, False), ((T // 32, IN), E8M0, True)]),
    ],
)
def test_fp8_saves_marked_fp8_parts_only(recipe, expected):
    mod = _module(fp8_recipe=recipe)
    records = []
    with _pack_record(records):
        mod(torch.randn(T, IN, requires_grad=True), torch.tensor(SPLITS)).sum().backward()
    assert [r for r in records if r[2] is not None] == expected
    assert not [r for r in records if r[0] == (T, IN) and r[1] == torch.float32]


@pytest.mark.parametrize("recipe", ["tensorwise", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matches_quantize_dequantize_by_hand(recipe, dtype):
    mod = _module(dtype, bias=True, fp8_recipe=recipe)
    x, dy = _inputs(dtype, pad=float("nan"))  # padding must not reach the scales either
    out, dx, _ = _run(mod, x, dy, torch.tensor(SPLITS))
    x_q = dequantize(quantize(x, recipe, num_rows=torch.tensor(sum(SPLITS))), dtype)
    assert not x_q.isnan().any()
    r_out, r_dx, r_dw, r_db = _reference(mod, x_q, dy, SPLITS)  # dgrad: straight through
    dw, db = _module_grads(mod)
    assert torch.equal(out, r_out) and torch.equal(dx, r_dx)
    assert all(torch.equal(a, b) for a, b in zip(dw, r_dw))
    assert all(torch.equal(a, b) for a, b in zip(db, r_db))  # on CPU: the same sums
    assert not torch.equal(out, _run(_module(dtype, bias=True), x, dy, torch.tensor(SPLITS))[0])


def _wide_range_inputs(dtype):
    """x and dy whose rows and columns span 2^-6..2^6: rowwise and columnwise MXFP8 blocks then
    pick different exponents, so a GEMM fed the wrong layout gives other values."""
    x, dy = _inputs(dtype, pad=float("nan"))
    g = torch.Generator().manual_seed(7)
    for t in (x, dy):
        rows, cols = t.shape
        scale = 2.0 ** torch.randint(-6, 7, (rows, 1), generator=g)
        t.mul_((scale * 2.0 ** torch.randint(-6, 7, (1, cols), generator=g)).to(dtype))
    return x, dy


def _fq(t, rowwise):
    num_rows = torch.tensor(sum(SPLITS))
    return dequantize(quantize(t, "mxfp8", num_rows=num_rows, rowwise=rowwise))


@pytest.mark.parametrize("use_grouped_tensor", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_quantizes_each_gemm_operand_as_te_does_by_hand(dtype, use_grouped_tensor):
    """TE's MXFP8 recipe: the forward GEMM reads x rowwise (blocks along in_features), dgrad
    reads dy rowwise (blocks along out_features), wgrad reads both columnwise (blocks of 32
    tokens); the bias gradient sums the high-precision dy."""
    mod = _module(dtype, bias=True, fp8_recipe="mxfp8", use_grouped_tensor=use_grouped_tensor)
    x, dy = _wide_range_inputs(dtype)
    out, dx, _ = _run(mod, x, dy, torch.tensor(SPLITS))
    n = sum(SPLITS)
    assert not torch.equal(_fq(x, True)[:n], _fq(x, False)[:n])  # the layouts differ here
    assert not torch.equal(_fq(dy, True)[:n], _fq(dy, False)[:n])
    ws, bs = _weights(mod), _biases(mod)
    groups = list(zip(*(torch.split(t[:n], SPLITS) for t in (
        _fq(x, True), _fq(x, False), _fq(dy, True), _fq(dy, False), dy))))  # fmt: skip
    r_out = [F.linear(xr, w) + b for (xr, *_), w, b in zip(groups, ws, bs)]
    r_dx = [dyr.mm(w) for (_, _, dyr, _, _), w in zip(groups, ws)]
    r_dw = [dyc.t().mm(xc) for _, xc, _, dyc, _ in groups]
    r_db = [d.sum(0) for *_, d in groups]
    dw, db = _module_grads(mod)
    assert torch.equal(out[:n], torch.cat(r_out)) and not out[n:].any()
    assert torch.equal(dx[:n], torch.cat(r_dx)) and not dx[n:].any()
    assert all(torch.equal(a, b) for a, b in zip(dw, r_dw))
    assert all(torch.equal(a, b) for a, b in zip(db, r_db))


def test_mxfp8_needs_rows_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        _module(fp8_recipe="mxfp8")(torch.randn(40, IN), torch.tensor(SPLITS))
    with pytest.raises(ValueError, match="float8"):
        _module(fp8_recipe="float8")


@pytest.mark.parametrize("fp8_recipe", [None, "tensorwise", "mxfp8", "nvfp4"])
def test_paged_stash_is_bitwise_transparent(fp8_recipe):
    mod = _module(bias=True, fp8_recipe=fp8_recipe)
    splits = torch.tensor(SPLITS)
    manager = PagedStashManager(page_size=4, skip_immediate_backward=False)
    for step in range(2):  # capture, then the allocated pool
        x, dy = _inputs(seed=10 + step, pad=float("nan"))
        ref = _run(mod, x, dy, splits)
        manager.reset()
        x_leaf = x.clone().requires_grad_()
        for p in mod.parameters():
            p.grad = None
        with manager.scope(T, splits.sum(), avg_num_tokens=sum(SPLITS)):
            out = mod(x_leaf, splits)
        out.backward(dy)
        assert torch.equal(out, ref[0]) and torch.equal(x_leaf.grad, ref[1])
        assert all(torch.equal(p.grad, g) for p, g in zip(mod.parameters(), ref[2]))
        stats = manager.stats()
        # MXFP8 and NVFP4 page their block scales too (NVFP4's global scale is static).
        assert stats.stashes == stats.pops == (2 if fp8_recipe in ("mxfp8", "nvfp4") else 1)
        assert not stats.overflow
    assert stats.mode.value == "captured" and stats.pool_pages


@pytest.mark.parametrize(
    "kw",
    [
        {"bias": True},
        {"bias": True, "single_grouped_weight": True, "single_grouped_bias": True},
        {"fp8_recipe": "tensorwise"},
        {"fp8_recipe": "mxfp8"},
        {"bias": True, "cuda_k_align": 8},  # the CUDA regrouping for dW/db, forced on CPU
    ],
)
def test_device_path_is_sync_free(kw, monkeypatch):
    # The CUDA code path, run on CPU: there the bias gradient is a GEMM; on CPU it sums each
    # group with host offsets (CPU tensors: no synchronisation), as the legacy path does.
    monkeypatch.setattr("te_paged.grouped.grouped_mm._host_reads_are_free", lambda t: False)
    kw = dict(kw)
    if kw.pop("cuda_k_align", None):
        monkeypatch.setattr("te_paged.grouped.grouped_mm._k_align_rows", lambda t: 8)
    mod = _module(**kw)
    x = torch.randn(T, IN, requires_grad=True)
    splits = torch.tensor(SPLITS)
    with NoHostReads():
        mod(x, splits).backward(torch.ones(T, OUT))
        GroupedTensor.from_splits(x.detach(), splits).row_mask()
    assert x.grad.abs().sum() > 0


def test_sync_checks_can_fail(monkeypatch):
    legacy = _module(use_grouped_tensor=False)
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        torch.tensor([1]).item()
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        legacy(torch.randn(T, IN), torch.tensor(SPLITS))


def _stand_in_te(monkeypatch):
    calls = []

    class StandInGroupedLinear:
        def __init__(self, num_gemms, in_features, out_features, *, bias=True,
                     use_grouped_tensor=False, device="cuda", **kwargs):  # fmt: skip
            calls.append((num_gemms, in_features, out_features, bias, use_grouped_tensor,
                          device, kwargs))  # fmt: skip

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.GroupedLinear = StandInGroupedLinear
    te.pytorch = te_pt
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    return StandInGroupedLinear, calls


@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
def test_grouped_linear_returns_single_grouped_bias_parameter(params_dtype):
    # Ported from TE 2.19's tests/pytorch/test_grouped_linear.py (same name): with
    # return_bias and a single grouped bias, the bias returned is the registered parameter
    # itself ([E, out], uncast), and a caller adding it per expert gets its gradient.
    experts, rows, out_f = 2, 256, 128
    mod = GroupedLinear(experts, 64, out_f, bias=True, return_bias=True,
                        single_grouped_bias=True, params_dtype=params_dtype)  # fmt: skip
    splits = torch.tensor([rows, rows])
    x = torch.randn(2 * rows, 64, dtype=torch.bfloat16)  # fp32 parameters: a cast would copy
    probs = torch.cat([torch.full((rows, 1), 0.25), torch.full((rows, 1), 0.5)])
    y, bias = mod(x, splits)
    assert bias is mod.bias and bias.shape == (experts, out_f) and bias.dtype == params_dtype
    per_row = torch.repeat_interleave(bias, splits, dim=0, output_size=2 * rows)
    (y.float() + per_row.float() * probs).sum().backward()
    expected = torch.tensor([[0.25 * rows], [0.5 * rows]]).expand(experts, out_f)
    torch.testing.assert_close(mod.bias.grad.float(), expected)


def test_make_grouped_linear_prefers_transformer_engine(monkeypatch):
    cls, calls = _stand_in_te(monkeypatch)
    layer = make_grouped_linear(E, IN, OUT, bias=False, single_grouped_weight=True)
    assert isinstance(layer, cls)
    assert calls == [(E, IN, OUT, False, True, "cuda",
                      {"return_bias": False, "single_grouped_weight": True,
                       "single_grouped_bias": False})]  # fmt: skip
    with pytest.raises(ValueError, match="fp8_autocast"):
        make_grouped_linear(E, IN, OUT, fp8_recipe="mxfp8")


def test_make_grouped_linear_refuses_the_per_expert_layout_te_fell_back_to(monkeypatch):
    # TE 2.19+ gates its single grouped parameters on NVTE_GROUPED_LINEAR_SINGLE_PARAM and
    # otherwise warns and builds per-expert ones: the caller would get another layout silently.
    class GatedGroupedLinear:
        def __init__(self, num_gemms, in_features, out_features, *, single_grouped_weight=False,
                     single_grouped_bias=False, use_grouped_tensor=False, **kwargs):  # fmt: skip
            gate = os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM") is not None
            self.single_grouped_weight = single_grouped_weight and gate
            self.single_grouped_bias = single_grouped_bias and gate

    _stand_in_te(monkeypatch)
    monkeypatch.setattr(sys.modules["transformer_engine.pytorch"], "GroupedLinear",
                        GatedGroupedLinear)  # fmt: skip
    monkeypatch.delenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", raising=False)
    for name in ("single_grouped_weight", "single_grouped_bias"):
        with pytest.raises(ValueError, match=f"{name}=True .*NVTE_GROUPED_LINEAR_SINGLE_PARAM"):
            make_grouped_linear(E, IN, OUT, **{name: True})
    assert not make_grouped_linear(E, IN, OUT).single_grouped_weight  # nothing asked: fine
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    layer = make_grouped_linear(E, IN, OUT, single_grouped_weight=True, single_grouped_bias=True)
    assert layer.single_grouped_weight and layer.single_grouped_bias


def test_make_grouped_linear_falls_back_without_transformer_engine(monkeypatch):
    for name in list(sys.modules):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr("te_paged.te._te_installed", lambda: False)
    layer = make_grouped_linear(E, IN, OUT, fp8_recipe="tensorwise", device="cpu")
    assert type(layer) is GroupedLinear and layer.fp8_recipe.value == "tensorwise"


@pytest.mark.parametrize("align", [4, 8])
def test_cuda_aligned_regrouping_on_cpu(align, monkeypatch):
    # CUDA's grouped GEMM needs 16-byte group extents along K (dW, db); the regrouping that
    # provides them runs on CPU too when forced, and must not change a single bit.
    import te_paged.grouped.grouped_mm as gl
    from te_paged.grouped.grouped_tensor import align_groups

    t = torch.arange(6.0).view(6, 1).expand(6, 4).contiguous()
    t[5] = float("nan")  # padding row
    regrouped, ends = align_groups(t, torch.tensor([2, 2, 5], dtype=torch.int32), 4)
    assert ends.tolist() == [4, 4, 8] and regrouped.shape == (6 + 3 * 3, 4)
    assert regrouped[:, 0].tolist() == [0, 1, 0, 0, 2, 3, 4] + [0] * 8
    for recipe in (None, "mxfp8"):  # MXFP8: wgrad reads dy's columnwise copy, db dy itself
        mod = _module(bias=True, fp8_recipe=recipe)
        x, dy = _inputs(pad=float("nan"))
        ref = _run(mod, x, dy, torch.tensor(SPLITS))
        with monkeypatch.context() as m:
            m.setattr(gl, "_k_align_rows", lambda t: align)
            got = _run(mod, x, dy, torch.tensor(SPLITS))
            assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
            assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))
            m.setattr(gl, "_host_reads_are_free", lambda t: False)  # CUDA's db: a GEMM
            got = _run(mod, x, dy, torch.tensor(SPLITS))
        weights = [p.dim() == 2 for p in mod.parameters()]
        for is_weight, a, b in zip(weights, got[2], ref[2]):
            if is_weight:
                assert torch.equal(a, b)
            else:  # another summation order
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("in_f", "out_f"), [(69, 16), (100, 97), (4097, 69), (16, 69), (7, 3)])
@pytest.mark.parametrize("splits", [[3, 4, 3], [0, 5, 5], [5, 0, 5], [5, 5, 0], [0, 0, 0]])
def test_any_feature_size_is_bitwise_equal_to_the_legacy_path(dtype, in_f, out_f, splits):
    # Before: in_features=69 (rows not a multiple of 16 bytes) was rejected on the device
    # path, which TE accepts. Empty first/middle/last groups and no tokens at all, too.
    torch.manual_seed(0)
    dev = GroupedLinear(3, in_f, out_f, bias=True, params_dtype=dtype)
    legacy = GroupedLinear(3, in_f, out_f, bias=True, params_dtype=dtype, use_grouped_tensor=False)
    legacy.load_state_dict(dev.state_dict())
    x, dy = torch.randn(12, in_f, dtype=dtype), torch.randn(12, out_f, dtype=dtype)
    a, b = _run(dev, x, dy, torch.tensor(splits)), _run(legacy, x, dy, splits)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(p, q) for p, q in zip(a[2], b[2]))


# Transformer Engine 2.x's GroupedLinear: __init__ after (num_gemms, in_features, out_features),
# and forward, in TE's order (read from its source).
TE_INIT_ARGS = [
    "sequence_parallel", "fuse_wgrad_accumulation", "tp_group", "tp_size",
    "get_rng_state_tracker", "rng_tracker_name", "init_method", "bias", "return_bias",
    "params_dtype", "parallel_mode", "device", "ub_overlap_rs", "ub_overlap_ag", "ub_name",
    "delay_wgrad_compute", "save_original_input", "single_grouped_weight", "single_grouped_bias",
    "name", "use_grouped_tensor",
]  # fmt: skip
TE_FORWARD_ARGS = ["inp", "m_splits", "is_first_microbatch", "out", "dgrad_out"]


def test_every_te_argument_is_taken_in_tes_order() -> None:
    import inspect

    init = list(inspect.signature(GroupedLinear.__init__).parameters)
    assert init[1:4] == ["num_gemms", "in_features", "out_features"]
    assert init[4 : 4 + len(TE_INIT_ARGS)] == TE_INIT_ARGS  # positional calls line up too
    assert list(inspect.signature(GroupedLinear.forward).parameters)[1:] == TE_FORWARD_ARGS
    # Every argument at TE's default, by keyword, as callers pass them.
    defaults = {
        "sequence_parallel": False, "fuse_wgrad_accumulation": False, "tp_group": None,
        "tp_size": 1, "get_rng_state_tracker": None, "rng_tracker_name": None,
        "init_method": None, "bias": True, "return_bias": False, "params_dtype": None,
        "parallel_mode": None, "device": "cpu", "ub_overlap_rs": False, "ub_overlap_ag": False,
        "ub_name": None, "delay_wgrad_compute": False, "save_original_input": False,
        "single_grouped_weight": False, "single_grouped_bias": False, "name": "fc1",
        "use_grouped_tensor": None,
    }  # fmt: skip
    mod = GroupedLinear(E, IN, OUT, **defaults)
    assert mod.use_grouped_tensor and mod.name == "fc1"
    x = torch.randn(T, IN)
    assert mod(x, torch.tensor(SPLITS), is_first_microbatch=True).shape == (T, OUT)
    for mode in ("row", "column"):  # at tp_size=1 they change nothing, as in TE
        assert GroupedLinear(E, IN, OUT, parallel_mode=mode).out_features == OUT


class _Group:
    def size(self) -> int:
        return 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_size": 2}, "tensor parallelism of 2"),
        ({"tp_group": _Group()}, "tensor parallelism of 2"),
        ({"parallel_mode": "duplicated"}, "parallel_mode='duplicated' is not one of"),
        ({"ub_overlap_rs": True}, "no userbuffer overlap"),
        ({"ub_overlap_ag": True}, "no userbuffer overlap"),
        ({"delay_wgrad_compute": True, "use_grouped_tensor": False}, "needs the device-initiated"),
        ({"save_original_input": True, "fp8_recipe": "tensorwise", "use_grouped_tensor": False},
         "needs the device-initiated"),
    ],
)  # fmt: skip
def test_te_arguments_it_cannot_honour_are_refused_by_name(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        GroupedLinear(E, IN, OUT, **kwargs)


def test_init_under_the_rng_tracker_as_te_does() -> None:
    forks = []

    class Tracker:
        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            forks.append(name)
            yield

    GroupedLinear(E, IN, OUT, get_rng_state_tracker=Tracker, rng_tracker_name="expert-rng")
    GroupedLinear(E, IN, OUT, get_rng_state_tracker=Tracker)
    assert forks == ["expert-rng", "model-parallel-rng"]


@pytest.mark.parametrize("single", [False, True])
def test_fuse_wgrad_accumulation_adds_into_main_grad(single) -> None:
    ref = _module(bias=True, single_grouped_weight=single)
    fused = _module(bias=True, single_grouped_weight=single, fuse_wgrad_accumulation=True)
    x, dy = _inputs()
    expected = _run(ref, x, dy, torch.tensor(SPLITS))
    for w in fused.weight_params():
        w.main_grad = torch.ones_like(w)  # what was accumulated before (Megatron's buffer)
    got = _run(fused, x, dy, torch.tensor(SPLITS))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    for w, w_ref in zip(fused.weight_params(), ref.weight_params()):
        assert w.grad is None and w.grad_added_to_main_grad
        assert torch.equal(w.main_grad, 1 + w_ref.grad)
    for w in fused.weight_params():
        w.overwrite_main_grad = True
    _run(fused, x, dy, torch.tensor(SPLITS))
    assert all(torch.equal(w.main_grad, r.grad) for w, r in zip(fused.weight_params(),
                                                                 ref.weight_params()))  # fmt: skip
    del fused.weight_params()[0].main_grad
    with pytest.raises(RuntimeError, match=r"needs weight\.main_grad"):
        _run(fused, x, dy, torch.tensor(SPLITS))


_GROUPED_PARAMETER_LAYOUTS = [  # (bias, single_grouped_weight, single_grouped_bias)
    (False, False, False), (False, True, False), (True, False, False),
    (True, True, False), (True, False, True), (True, True, True),
]  # fmt: skip


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("delay", [False, True])
@pytest.mark.parametrize("recipe", [None, "tensorwise", "mxfp8"])
@pytest.mark.parametrize(("bias", "single_weight", "single_bias"), _GROUPED_PARAMETER_LAYOUTS)
def test_grouped_parameter_layout_matches_cpu_m_splits(
    bias, single_weight, single_bias, recipe, delay, fuse
):
    # Ported from TE 2.19's test of the same name: every parameter layout on the device path,
    # with delayed and fused weight gradients (one flat fp32 main_grad buffer holding 0.25,
    # the single weight's a [E, O, I] view of it), against the legacy path with per-GEMM
    # parameters and host m_splits. TE compares within tolerances; on CPU it is bitwise.
    ref = _module(bias=bias, fp8_recipe=recipe, use_grouped_tensor=False)
    mod = _module(bias=bias, fp8_recipe=recipe, single_grouped_weight=single_weight,
                  single_grouped_bias=single_bias, delay_wgrad_compute=delay,
                  fuse_wgrad_accumulation=fuse, seed=3)  # fmt: skip
    mod.load_state_dict(ref.state_dict())
    weights = mod.weight_params()
    if fuse:
        flat = torch.full((E * OUT * IN,), 0.25)
        views = [flat.view(E, OUT, IN)] if single_weight else list(flat.view(E, OUT, IN))
        for w, v in zip(weights, views):
            w.main_grad = v
    x, dy = _inputs()
    expected = _run(ref, x, dy, SPLITS)
    got = _run(mod, x, dy, torch.tensor(SPLITS))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    ref_w, ref_b = _module_grads(ref)
    if delay:  # nothing reached the weights yet; the biases' gradients are not delayed
        assert all(w.grad is None for w in weights)
        assert not fuse or torch.equal(flat, torch.full_like(flat, 0.25))
        mod.backward_dw()
    w_grads = [w.main_grad if fuse else w.grad for w in weights]  # main_grad: 0.25 + grad
    if single_weight:
        w_grads = list(w_grads[0].unbind(0))
    assert all(torch.equal(a, 0.25 + b if fuse else b) for a, b in zip(w_grads, ref_w))
    if fuse:
        assert all(w.grad is None and w.grad_added_to_main_grad for w in weights)
    b_grads = [b.grad for b in mod.bias_params()]
    b_grads = list(b_grads[0].unbind(0)) if single_bias and bias else b_grads
    assert len(b_grads) == len(ref_b) and all(map(torch.equal, b_grads, ref_b))


@pytest.mark.parametrize("fused", [False, True])
def test_delay_wgrad_compute_defers_weight_gradients_to_backward_dw(fused) -> None:
    ref = _module(bias=True)
    late = _module(bias=True, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    if fused:
        for w in late.weight_params():
            w.main_grad = torch.zeros_like(w)
    x, dy = _inputs()
    expected = _run(ref, x, dy, torch.tensor(SPLITS))
    got = _run(late, x, dy, torch.tensor(SPLITS))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert all(w.grad is None for w in late.weight_params())  # deferred...
    assert all(b.grad is not None for b in late.bias_params())  # ...the biases are not
    late.backward_dw()
    for w, w_ref in zip(late.weight_params(), ref.weight_params()):
        assert torch.equal(w.main_grad if fused else w.grad, w_ref.grad)
    late.backward_dw()  # nothing left to do
    for w, w_ref in zip(late.weight_params(), ref.weight_params()):
        assert torch.equal(w.main_grad if fused else w.grad, w_ref.grad)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8", "nvfp4"])
def test_save_original_input_saves_the_input_and_gives_the_same_gradients(recipe) -> None:
    plain = _module(fp8_recipe=recipe)
    original = _module(fp8_recipe=recipe, save_original_input=True)
    x, dy = _inputs()
    saved = []
    expected = _run(plain, x, dy, torch.tensor(SPLITS))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        got = _run(original, x, dy, torch.tensor(SPLITS))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], expected[2]))
    assert any(t.dtype == x.dtype and t.shape == x.shape for t in saved)  # the input itself
    assert not any(t.dtype == torch.float8_e4m3fn for t in saved)


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("recipe", [None, "tensorwise", "mxfp8", "nvfp4"])
def test_grouped_tensor_save_original_input_matches_saved_grouped_input(
    recipe, single, monkeypatch
):
    # Ported from TE 2.19's test of the same name (TE skips NVFP4 with a single weight; here it
    # runs): with and without save_original_input, single grouped weight or not, the output,
    # input gradient and weight gradients are the same, and the path stays the device one.
    def no_fallback(*args, **kwargs):
        raise AssertionError("the device path fell back to the legacy path")

    monkeypatch.setattr(GroupedLinear, "_forward_legacy", no_fallback)
    kw = {"fp8_recipe": recipe, "single_grouped_weight": single, "bias": True}
    plain, original = _module(**kw), _module(**kw, save_original_input=True)
    original.load_state_dict(plain.state_dict())
    x, dy = _inputs()
    a, b = _run(plain, x, dy, torch.tensor(SPLITS)), _run(original, x, dy, torch.tensor(SPLITS))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert all(torch.equal(p, q) for p, q in zip(a[2], b[2]))


def test_out_and_dgrad_out_buffers() -> None:
    mod = _module(bias=True)
    x, dy = _inputs()
    expected = _run(mod, x, dy, torch.tensor(SPLITS))
    out, dgrad = torch.full((T, OUT), 9.0), torch.full((T, IN), 9.0)
    xx = x.clone().requires_grad_()
    y = mod(xx, torch.tensor(SPLITS), out=out, dgrad_out=dgrad)
    assert y.data_ptr() == out.data_ptr() and torch.equal(out, expected[0])
    y.backward(dy)
    assert torch.equal(dgrad, expected[1]) and torch.equal(xx.grad, expected[1])
    with pytest.raises(ValueError, match="out must be a contiguous"):
        mod(x, torch.tensor(SPLITS), out=torch.empty(T, OUT + 1))
