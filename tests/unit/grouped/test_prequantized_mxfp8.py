"""A GroupedLinear input or gradient that arrived quantised (rowwise MXFP8, FP8 dispatch's wire).

Ported from Transformer Engine 2.19's tests/pytorch/test_grouped_mlp.py
(``test_grouped_linear_prequantized_mxfp8_input`` / ``_grad``, written for ``te.ops.GroupedLinear``)
at CPU sizes: 4 groups with 0, 32, 64 and 96 rows in a shuffled order (TE: multiples of 128),
64 features (TE: 256), bf16. TE's claim is that results are bit-exact against the same layer run
on the dequantised wire tensor; te_paged checks that, and more directly that every GEMM read the
operand TE says it reads: the forward and input-gradient GEMMs the wire values as they are (a
rowwise requantisation changes nothing), the weight gradient columnwise copies made from them.

TE's ``scaled`` bias mode (``scale_bias`` with routing probabilities) has no te_paged analogue:
te_paged weights by the probabilities in the fused activation, not in GroupedLinear.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from te_paged import PagedStashManager
from te_paged.grouped import GroupedLinear, GroupedTensor, dequantize, quantize

E, FEAT = 4, 64
DTYPE = torch.bfloat16


def _splits(seed=0):
    sizes = [32 * i for i in range(E)]  # an empty group included
    random.Random(seed).shuffle(sizes)
    return sizes


def _module(bias=False, seed=0, **kw):
    torch.manual_seed(seed)
    return GroupedLinear(E, FEAT, FEAT, bias=bias, params_dtype=DTYPE, fp8_recipe="mxfp8", **kw)


def _rand(rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, FEAT, generator=g) - 0.5
    # Rows and columns an order of magnitude apart: the layouts' blocks then differ.
    x *= 2.0 ** torch.randint(-8, 9, (rows, 1), generator=g)
    return (x * 2.0 ** torch.randint(-8, 9, (1, FEAT), generator=g)).to(DTYPE)


def _wire(x_hp, splits):
    """Rowwise-only MXFP8, as FP8 dispatch sends tokens: ``data`` is the e4m3 bytes themselves."""
    fp8 = quantize(x_hp, "mxfp8", rowwise=True)
    return GroupedTensor.from_splits(fp8.data, torch.tensor(splits), fp8=fp8)


def _fq(t, splits, rowwise):
    return dequantize(quantize(t, "mxfp8", torch.tensor(sum(splits)), rowwise=rowwise))


def _by_group(t, splits):
    return torch.split(t[: sum(splits)], splits)


def _weight_grads(mod):
    grads = [w.grad for w in mod.weight_params() if w.grad is not None]
    mod.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("weight_requires_grad", [False, True])
def test_grouped_linear_prequantized_mxfp8_input(weight_requires_grad):
    splits = _splits()
    rows = sum(splits)
    x_wire = _wire(_rand(rows, 1), splits)
    x_ref = dequantize(x_wire.fp8)  # the only data a layer sees after FP8 dispatch
    dy = torch.rand(rows, FEAT, dtype=DTYPE) - 0.5
    mod = _module()
    mod.requires_grad_(weight_requires_grad)

    def run(x, *m_splits):
        y = mod(x, *m_splits)
        if weight_requires_grad:
            y.backward(dy)
        return y.detach(), _weight_grads(mod)

    y_ref, wgrads_ref = run(x_ref, torch.tensor(splits))
    y_test, wgrads_test = run(x_wire)
    assert torch.equal(y_test, y_ref)  # TE: bit-exact
    assert len(wgrads_test) == len(wgrads_ref) == (E if weight_requires_grad else 0)
    assert all(torch.equal(a, b) for a, b in zip(wgrads_test, wgrads_ref))
    # The forward GEMM read the wire as it is; the weight gradient a columnwise copy of it.
    ws = mod.weight_params()
    ys = [F.linear(x_g, w) for x_g, w in zip(_by_group(x_ref, splits), ws)]
    assert torch.equal(y_test, torch.cat(ys))
    assert not torch.equal(_fq(x_ref, splits, False), x_ref)  # so the copy is a real requant
    if weight_requires_grad:
        groups = zip(_by_group(_fq(dy, splits, False), splits),
                     _by_group(_fq(x_ref, splits, False), splits))  # fmt: skip
        assert all(torch.equal(g, dy_g.t().mm(x_g)) for g, (dy_g, x_g) in zip(wgrads_test, groups))


@pytest.mark.parametrize("bias_mode", ["none", "plain"])
@pytest.mark.parametrize("weight_requires_grad", [False, True])
def test_grouped_linear_prequantized_mxfp8_grad(bias_mode, weight_requires_grad):
    # te_paged's gradients are tensors: a wire-format gradient enters autograd as its
    # dequantised values (TE's test hands the GroupedTensor itself to backward). What TE checks
    # is then what the layer does with a gradient already on the rowwise MXFP8 grid: the input
    # gradient GEMM reads it as it is, the weight gradient a columnwise copy, the bias gradient
    # sums it.
    splits = _splits(seed=1)
    rows = sum(splits)
    x = _rand(rows, 2)
    dy_ref = dequantize(_wire(_rand(rows, 3), splits).fp8)
    mod = _module(bias=bias_mode == "plain")
    mod.requires_grad_(weight_requires_grad)  # TE: biases frozen with the weights
    x_in = x.clone().requires_grad_()
    mod(x_in, torch.tensor(splits)).backward(dy_ref)
    ws = mod.weight_params()
    dx = [dy_g.mm(w) for dy_g, w in zip(_by_group(dy_ref, splits), ws)]
    assert torch.equal(x_in.grad, torch.cat(dx))
    assert not torch.equal(_fq(dy_ref, splits, False), dy_ref)
    if not weight_requires_grad:
        assert all(p.grad is None for p in mod.parameters())
        return
    groups = zip(_by_group(_fq(dy_ref, splits, False), splits),
                 _by_group(_fq(x, splits, False), splits))  # fmt: skip
    assert all(torch.equal(w.grad, dy_g.t().mm(x_g)) for w, (dy_g, x_g) in zip(ws, groups))
    for b, dy_g in zip(mod.bias_params(), _by_group(dy_ref, splits)):
        assert torch.equal(b.grad, dy_g.sum(0))


def test_prequantized_input_passes_its_gradient_to_the_handle_and_pages_its_copy():
    """``GroupedTensor.data`` carries the input gradient when it requires grad (an FP8
    dispatcher's autograd output); under the paged stash the columnwise copy is what pages, and
    the gradients do not change."""
    splits = _splits(seed=2)
    rows = 256  # padding rows past the 192 real ones
    x_hp = _rand(rows, 4)
    wire = quantize(x_hp, "mxfp8", torch.tensor(sum(splits)), rowwise=True)
    dy = torch.rand(rows, FEAT, dtype=DTYPE) - 0.5
    mod = _module(bias=True)
    x_ref = dequantize(wire).requires_grad_()
    mod(x_ref, torch.tensor(splits)).backward(dy)
    expected = [x_ref.grad, *(p.grad.clone() for p in mod.parameters())]
    manager = PagedStashManager(page_size=16, skip_immediate_backward=False)
    for _step in range(2):  # capture, then the pool
        mod.zero_grad(set_to_none=True)
        manager.reset()
        handle = torch.zeros(rows, FEAT, dtype=DTYPE, requires_grad=True)
        with manager.scope(rows, torch.tensor(sum(splits)), sum(splits)):
            y = mod(GroupedTensor.from_splits(handle, torch.tensor(splits), fp8=wire))
        y.backward(dy)
        got = [handle.grad, *(p.grad for p in mod.parameters())]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        stats = manager.stats()
        assert stats.stashes == stats.pops == 2 and not stats.overflow  # data and scales


def test_prequantized_input_is_refused_where_it_cannot_be_honoured():
    splits = torch.tensor(_splits())
    x = _rand(192, 5)
    rowwise = _wire(x, splits.tolist())
    columnwise = GroupedTensor.from_splits(x, splits, fp8=quantize(x, "mxfp8"))
    with pytest.raises(ValueError, match=r"must be rowwise MXFP8 .*got columnwise mxfp8"):
        _module()(columnwise)
    tensorwise = GroupedTensor.from_splits(x, splits, fp8=quantize(x, "tensorwise"))
    with pytest.raises(ValueError, match="got tensorwise"):
        _module()(tensorwise)
    with pytest.raises(NotImplementedError, match="device-initiated path only"):
        _module(use_grouped_tensor=False)(rowwise)
    with pytest.raises(ValueError, match="pass no m_splits"):
        _module()(rowwise, splits)
    handle = torch.zeros(192, FEAT, requires_grad=True)  # float32, the wire came from bf16
    with pytest.raises(TypeError, match="must have the dtype"):
        _module()(GroupedTensor.from_splits(handle, splits, fp8=rowwise.fp8))


def test_te_stored_uint8_bytes_are_taken_as_the_same_bits() -> None:
    # Transformer Engine stores MXFP8 data and its e8m0 scale-inverses as uint8 bytes. Before:
    # a uint8 scale_inv was read as values (the output scaled by ~1.5e4); now the same bits.
    splits = _splits()
    wire = _wire(_rand(sum(splits), 1), splits)
    fp8 = wire.fp8
    te_bytes = dataclasses.replace(fp8, data=fp8.data.view(torch.uint8),
                                   scale_inv=fp8.scale_inv.view(torch.uint8))  # fmt: skip
    mod = _module()
    y = mod(wire)
    y_te = mod(GroupedTensor.from_splits(wire.data, torch.tensor(splits), fp8=te_bytes))
    assert torch.equal(y, y_te)


@pytest.mark.parametrize(
    ("field", "bad", "error", "match"),
    [
        ("scale_inv", lambda s: s.float(), TypeError, "scale_inv must be float8_e8m0fnu"),
        ("scale_inv", lambda s: s[:, :1], ValueError, "expected .*one per 32 elements"),
        ("data", lambda d: d.to(torch.float8_e5m2), TypeError, "data must be float8_e4m3fn"),
    ],
)
def test_other_scale_or_data_storage_is_refused_naming_it(field, bad, error, match) -> None:
    splits = _splits()
    wire = _wire(_rand(sum(splits), 1), splits)
    fp8 = dataclasses.replace(wire.fp8, **{field: bad(getattr(wire.fp8, field))})
    with pytest.raises(error, match=match):
        _module()(GroupedTensor.from_splits(wire.data, torch.tensor(splits), fp8=fp8))
