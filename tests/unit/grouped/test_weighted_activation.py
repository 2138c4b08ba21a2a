"""Every expert activation, probability-weighted in Megatron's unfused order: the registry's
formulas, gradients, the rounding order in bf16, the marker contract and the paged stash.

(Against Megatron-core's own ``TEGroupedMLP``: functional_tests/megatron/test_megatron_experts.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from te_paged.config import Activation
from te_paged.grouped.weighted_activation import (
    ACTIVATION_FUNCTIONS,
    fused_weighted_squared_relu,
    weighted_activation,
)
from te_paged.markers import MarkerKind, grouped_tensor_marker
from te_paged.stash import PagedStashManager

ROWS, FFN = 48, 20
FUNCTIONS = sorted(ACTIVATION_FUNCTIONS)
#: Megatron's formulas, written out: ``activations.squared_relu``, ``fused_bias_geglu.quick_gelu``.
FORMULAS = {
    "silu": lambda x: x * torch.sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / 2**0.5)),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": lambda x: x.clamp_min(0),
    "squared_relu": lambda x: x.clamp_min(0) ** 2,
}


def _inputs(gated: bool, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    width = 2 * FFN if gated else FFN
    x = (3 * torch.randn(ROWS, width, generator=g, dtype=torch.float64)).to(dtype)
    probs = torch.rand(ROWS, generator=g, dtype=torch.float64).to(torch.float32)
    dy = torch.randn(ROWS, FFN, generator=g, dtype=torch.float64).to(dtype)
    return x, probs, dy


def _megatron_order(x, probs, act, gated, limit=None, offset=0.0):
    """Megatron's ``TEGroupedMLP.bias_act_func`` without fusion, as its source reads."""
    if gated:
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if limit is not None:
            x_glu = x_glu.clamp(min=None, max=limit)
            x_linear = x_linear.clamp(min=-limit, max=limit)
        h = act(x_glu) * (x_linear + offset)
    else:
        h = act(x)
    return (h * probs.unsqueeze(-1)).to(h.dtype)


def _run(fn, x, probs, dy):
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = fn(x, probs)
    y.backward(dy)
    return y.detach(), x.grad, probs.grad


@pytest.mark.parametrize("name", FUNCTIONS)
def test_registry_functions_are_megatrons_formulas(name: str) -> None:
    x = torch.linspace(-6, 6, 1201, dtype=torch.float64)
    torch.testing.assert_close(ACTIVATION_FUNCTIONS[name](x), FORMULAS[name](x))


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_float64_gradcheck(name: str, gated: bool) -> None:
    x, probs, _ = _inputs(gated, torch.float64)
    x = x[:6, :] if not gated else torch.cat([x[:6, :4], x[:6, FFN : FFN + 4]], dim=1)
    if name in ("relu", "squared_relu"):
        x = x + 0.05 * torch.sign(x)  # away from the kink at 0
    probs = probs[:6].double()
    fn = lambda a, p: weighted_activation(a, p, activation=name, gated=gated)
    assert torch.autograd.gradcheck(fn, (x.requires_grad_(), probs.requires_grad_()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gated", [True, False], ids=["glu", "plain"])
@pytest.mark.parametrize("name", FUNCTIONS)
def test_bitwise_megatrons_unfused_order(name: str, gated: bool, dtype: torch.dtype) -> None:
    """Two roundings in bf16 (after ``act·up`` and after ``·probs``), in output and gradients."""
    x, probs, dy = _inputs(gated, dtype)
    act = ACTIVATION_FUNCTIONS[name]
    got = _run(lambda a, p: weighted_activation(a, p, activation=name, gated=gated), x, probs, dy)
    want = _run(lambda a, p: _megatron_order(a, p, act, gated), x, probs, dy)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)
    if dtype == torch.bfloat16 and gated:
        # ... which is not what rounding once gives: the order matters, and is tested.
        once = (_megatron_order(x.float(), probs, act, gated)).to(dtype)
        assert not torch.equal(got[0], once)


def test_clamp_and_linear_offset_follow_gpt_oss() -> None:
    x, probs, dy = _inputs(True, torch.bfloat16)
    act = ACTIVATION_FUNCTIONS["quick_gelu"]
    kw = {"activation": "quick_gelu", "gated": True, "limit": 2.0, "linear_offset": 1.0}
    got = _run(lambda a, p: weighted_activation(a, p, **kw), x, probs, dy)
    want = _run(lambda a, p: _megatron_order(a, p, act, True, 2.0, 1.0), x, probs, dy)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    gate, up = x.chunk(2, dim=-1)
    clamped = torch.cat([gate > 2.0, up.abs() > 2.0], dim=1)
    assert clamped.any() and not got[1][clamped].any()  # no gradient through a clamp


@pytest.mark.parametrize("paged_stash", [True, False])
def test_saved_tensors_are_the_marked_input_and_probs(paged_stash: bool) -> None:
    x, probs, _ = _inputs(True)
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), grouped_tensor_marker(t)))
        return t

    x, probs = x.requires_grad_(), probs.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        weighted_activation(x, probs, activation="gelu", gated=True, paged_stash=paged_stash)
    kind = MarkerKind.TOKEN_ROWS if paged_stash else None
    # Exactly two saved tensors — nothing of the recomputed graph — each marked by the config.
    assert seen == [((ROWS, 2 * FFN), kind), ((ROWS,), kind)]


@pytest.mark.parametrize("activation", list(Activation))
def test_paged_stash_is_bitwise_invisible_for_every_activation(activation: Activation) -> None:
    n = 30  # real rows; the rest is padding
    x, probs, dy = _inputs(activation.is_gated, torch.bfloat16)
    x[n:], probs[n:] = 0, 0
    kw = {"activation": activation.function, "gated": activation.is_gated, "paged_stash": True}
    fn = lambda a, p: weighted_activation(a, p, **kw)
    ref = _run(fn, x, probs, dy)
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    num_tokens = torch.tensor([n])
    for _step in range(2):  # capture, then the pooled step
        manager.reset()
        with manager.scope(ROWS, num_tokens, n):
            got = _run(fn, x, probs, dy)
        assert all(torch.equal(g, w) for g, w in zip(got, ref))
        stats = manager.stats()
        assert stats.stashes == stats.pops == 2 and not stats.overflow


def test_bad_arguments_are_named() -> None:
    x, probs, _ = _inputs(True)
    with pytest.raises(ValueError, match="activation='swish' is not one of"):
        weighted_activation(x, probs, activation="swish", gated=True)
    with pytest.raises(ValueError, match="even last dim"):
        weighted_activation(x[:, :-1], probs, activation="silu", gated=True)
    with pytest.raises(ValueError, match=r"probs must have shape \[48\] or \[48, 1\]"):
        weighted_activation(x, probs[:-1], activation="silu", gated=True)
    with pytest.raises(TypeError, match="floating-point"):
        weighted_activation(x.long(), probs, activation="silu", gated=True)


@pytest.mark.parametrize("activation", list(Activation))
def test_activation_from_megatrons_function_and_gating(activation: Activation) -> None:
    assert Activation.from_function(activation.function, activation.is_gated) is activation
    assert activation.function in ACTIVATION_FUNCTIONS
    with pytest.raises(ValueError, match="no activation for function 'tanh'"):
        Activation.from_function("tanh", True)
    assert F.silu.__name__ == "silu" and F.gelu.__name__ == "gelu" and F.relu.__name__ == "relu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_squared_relu_is_megatrons_formula_rounded_once(dtype: torch.dtype) -> None:
    x, probs, dy = _inputs(False, dtype)
    got = _run(fused_weighted_squared_relu, x, probs, dy)
    assert got[0].dtype == dtype and got[2].dtype == torch.float32
    relu = x.double().clamp_min(0)
    y = relu**2 * probs.double().unsqueeze(1)
    tol = {} if dtype == torch.float32 else {"atol": 0, "rtol": 2**-8}  # one bf16 rounding
    torch.testing.assert_close(got[0].double(), y, **tol)
    dx = dy.double() * probs.double().unsqueeze(1) * 2 * relu
    torch.testing.assert_close(got[1].double(), dx, rtol=2**-7, atol=1e-6)
    dp = (relu**2 * dy.double()).sum(1)
    torch.testing.assert_close(got[2].double(), dp, rtol=1e-2, atol=1e-4)


def test_fused_squared_relu_marks_and_pages_its_two_saved_tensors() -> None:
    n = 30
    x, probs, dy = _inputs(False, torch.bfloat16)
    x[n:], probs[n:] = 0, 0
    fn = lambda a, p: fused_weighted_squared_relu(a, p, paged_stash=True)
    ref = _run(fn, x, probs, dy)
    manager = PagedStashManager(page_size=8, skip_immediate_backward=False)
    for _step in range(2):
        manager.reset()
        with manager.scope(ROWS, torch.tensor([n]), n):
            got = _run(fn, x, probs, dy)
        assert all(torch.equal(g, w) for g, w in zip(got, ref))
        assert manager.stats().stashes == 2 and not manager.stats().overflow
