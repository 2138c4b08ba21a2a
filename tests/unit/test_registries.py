"""A new activation and a new stash kernel backend, added through the registries alone, work
everywhere an activation or a backend is read: config validation, Megatron config mapping,
both expert paths with paged stash, the manager and the ``torch.library`` ops. A name missing
from a registry is an error everywhere, never another entry's math."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from te_paged.config import MoEConfig
from te_paged.grouped.activations import (
    ACTIVATIONS,
    ActivationSpec,
    finish_grads,
    load_saved_inputs,
    register_activation,
    save_inputs,
)
from te_paged.grouped.weighted_activation import weighted_activation
from te_paged.kernels import StashBackend, register_backend, torch_stash_copy, torch_stash_pop
from te_paged.kernels.backends import _BACKENDS
from te_paged.moe import as_moe_config

from .moe.harness import build, config, run_step


def toy(x: torch.Tensor) -> torch.Tensor:
    """An activation te_paged does not ship: ``x · tanh(x)``."""
    return x * torch.tanh(x)


class ToyFused(torch.autograd.Function):
    """A fused kernel for it with the registry's contract (computed in fp32, rounded once)."""

    @staticmethod
    def forward(ctx, x, probs, recipe, paged_stash, num_rows, limit, linear_offset):
        x_RC, probs_R = save_inputs(ctx, x, probs, recipe, paged_stash, num_rows)
        gate, up = x_RC.chunk(2, dim=1)
        y = toy(gate) * up * probs_R.to(x_RC.dtype).unsqueeze(1)
        return y.to(x.dtype).view(*x.shape[:-1], gate.shape[1])

    @staticmethod
    def backward(ctx, dy):
        x_RC, probs_R = load_saved_inputs(ctx)
        ffn = x_RC.shape[1] // 2
        with torch.enable_grad():
            gate = x_RC[:, :ffn].detach().requires_grad_()
            t = toy(gate)
        dy_RF = dy.reshape(-1, ffn).to(x_RC.dtype)
        (dt,) = torch.autograd.grad(t, gate, dy_RF * probs_R.to(x_RC.dtype).unsqueeze(1))
        dgate = dt * x_RC[:, ffn:]
        dup = dy_RF * probs_R.to(x_RC.dtype).unsqueeze(1) * t.detach()
        dprobs = (dy_RF * t.detach() * x_RC[:, ffn:]).sum(1)
        return *finish_grads(ctx, dgate, dup, dprobs), None, None, None, None, None


@pytest.fixture
def toy_activation():
    spec = register_activation(ActivationSpec("toy_glu", "toy", True, toy, fused=ToyFused))
    yield spec
    del ACTIVATIONS["toy_glu"]


def test_a_registered_activation_is_valid_config_and_megatron_mapping(toy_activation) -> None:
    assert MoEConfig(activation="toy_glu").activation_type is toy_activation
    megatron = types.SimpleNamespace(hidden_size=32, moe_ffn_hidden_size=64, num_moe_experts=4,
                                     activation_func=toy, gated_linear_unit=True)  # fmt: skip
    assert as_moe_config(megatron).activation == "toy_glu"


@pytest.mark.parametrize("path", ["unfused_order", "fused_kernel", "op_fuser"])
def test_a_registered_activation_runs_both_paths_with_paged_stash(toy_activation, path) -> None:
    kw = {
        "activation": "toy_glu",
        "bias_activation_fusion": path != "unfused_order",
        "use_transformer_engine_op_fuser": path == "op_fuser",
    }
    on_cfg, off_cfg = config(moe_paged_stash=True, **kw), config(**kw)
    manager, on_layers = build(on_cfg)
    _, off_layers = build(off_cfg)
    for step in range(2):
        on = run_step(manager, on_layers, on_cfg, step)
        off = run_step(None, off_layers, off_cfg, step)
        assert all(torch.equal(a, b) for a, b in zip(on, off))
        assert manager.stats().stashes > 0 and not manager.stats().overflow
    # ... and it computes the toy function, not another activation's math.
    x = torch.randn(6, 8, dtype=torch.float64)
    p = torch.rand(6, dtype=torch.float64)
    want = toy(x[:, :4]) * x[:, 4:] * p[:, None]
    got = weighted_activation(x, p, activation=toy_activation.elementwise, gated=True)
    torch.testing.assert_close(got, want)
    fused = ToyFused.apply(x, p, None, False, None, None, 0.0)
    torch.testing.assert_close(fused, want)


def test_a_name_missing_from_the_registry_is_an_error_everywhere() -> None:
    with pytest.raises(ValueError, match="activation='toy_glu' is not registered"):
        MoEConfig(activation="toy_glu")
    megatron = types.SimpleNamespace(hidden_size=32, activation_func=toy, gated_linear_unit=True)
    with pytest.raises(ValueError, match="activation_func='toy' is not supported"):
        as_moe_config(megatron)
    with pytest.raises(ValueError, match="activation='toy' is not one of"):
        weighted_activation(torch.randn(2, 4), torch.rand(2), activation="toy", gated=True)
    with pytest.raises(ValueError, match="moe_paged_stash_kernel_backend='toy' is not registered"):
        MoEConfig(moe_paged_stash_kernel_backend="toy")
    assert F.silu.__name__ == "silu"  # the registry is keyed by what Megatron's names are


@pytest.fixture
def toy_backend():
    calls = {"copy": 0, "pop": 0}

    def copy(*args):
        calls["copy"] += 1
        torch_stash_copy(*args)

    def pop(*args):
        calls["pop"] += 1
        torch_stash_pop(*args)

    register_backend(StashBackend("toy", copy, pop))  # not direct: always through the ops
    yield calls
    del _BACKENDS["toy"]


def test_a_registered_backend_runs_the_stash_through_the_ops(toy_backend) -> None:
    kw = {"moe_paged_stash_kernel_backend": "toy"}
    on_cfg = config(moe_paged_stash=True, **kw)
    manager, layers = build(on_cfg)
    assert manager.backend.name == "toy"
    ref_manager, ref_layers = build(config(moe_paged_stash=True))
    for step in range(2):
        got = run_step(manager, layers, on_cfg, step)
        want = run_step(ref_manager, ref_layers, config(moe_paged_stash=True), step)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    stats = manager.stats()
    assert toy_backend["copy"] == toy_backend["pop"] > 0 and stats.stashes > 0
    with pytest.raises(ValueError, match="already registered"):
        register_backend(StashBackend("toy", torch_stash_copy, torch_stash_pop))
