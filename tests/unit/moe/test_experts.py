"""TEGroupedMLP conventions (Megatron drop-in), overflow handling and invalid configs."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from te_paged.config import MoEConfig
from te_paged.moe import TEGroupedMLP, as_moe_config

from .harness import EXPERTS, ROWS, build, config, run_step, step_inputs


def megatron_like_config(**overrides) -> types.SimpleNamespace:
    """The fields Megatron's TransformerConfig carries, as a plain object."""
    fields = {
        "hidden_size": 32,
        "ffn_hidden_size": 128,
        "moe_ffn_hidden_size": 64,
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "activation_func": F.silu,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "bias_activation_fusion": True,
        "params_dtype": torch.float32,
        "fp8": None,
        "fp8_recipe": "delayed",
        "recompute_granularity": None,
        "recompute_modules": None,
        "expert_model_parallel_size": 1,
        "tensor_model_parallel_size": 1,
        "moe_apply_probs_on_input": False,
        "sequence_parallel": False,
    }
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def test_megatron_constructor_and_config_mapping() -> None:
    mlp = TEGroupedMLP(
        4,
        megatron_like_config(),
        submodules=object(),
        pg_collection=None,
        name="decoder.layers.0.mlp.experts",
    )
    assert mlp.config.activation == "swiglu" and mlp.config.moe_ffn_hidden_size == 64
    names = set(dict(mlp.named_parameters()))
    assert names == {f"linear_fc{k}.weight{i}" for k in (1, 2) for i in range(4)}
    assert mlp.linear_fc1.weight0.shape == (128, 32) and mlp.linear_fc2.weight3.shape == (32, 64)
    mlp.backward_dw()  # exists, nothing to do


def test_quick_gelu_and_fp8_recipe_mapping() -> None:
    def quick_gelu(x):
        return x * torch.sigmoid(1.702 * x)

    cfg = as_moe_config(
        megatron_like_config(
            activation_func=quick_gelu,
            activation_func_clamp_value=7.0,
            glu_linear_offset=1.0,
            fp8="e4m3",
            fp8_recipe="mxfp8",
        )
    )
    assert (cfg.activation, cfg.activation_func_clamp_value, cfg.fp8) == (
        "quick_geglu",
        7.0,
        "mxfp8",
    )
    with pytest.raises(ValueError, match="not supported by te_paged's experts"):
        as_moe_config(megatron_like_config(activation_func=torch.tanh))
    with pytest.raises(ValueError, match="'tensorwise'"):
        as_moe_config(megatron_like_config(fp8="hybrid", fp8_recipe="delayed"))


def _squared_relu(x):
    return torch.pow(F.relu(x), 2)


_squared_relu.__name__ = "squared_relu"


@pytest.mark.parametrize(
    ("func", "gated", "activation"),
    [
        (F.silu, True, "swiglu"), (F.gelu, True, "geglu"), (F.relu, True, "reglu"),
        (_squared_relu, True, "squared_reglu"), (F.silu, False, "silu"),
        (F.gelu, False, "gelu"), (F.relu, False, "relu"), (_squared_relu, False, "squared_relu"),
    ],
)  # fmt: skip
def test_every_megatron_activation_builds_and_runs(func, gated, activation) -> None:
    """What Megatron constructs (e.g. GeGLU when only GLU is set) builds and runs, even with
    one local expert and top-2 routing: top-k is the router's to check."""
    mcfg = megatron_like_config(activation_func=func, gated_linear_unit=gated,
                                bias_activation_fusion=False)  # fmt: skip
    assert as_moe_config(mcfg).activation == activation
    mlp = TEGroupedMLP(1, megatron_like_config(activation_func=func, gated_linear_unit=gated,
                                               num_moe_experts=1))  # fmt: skip
    width = 2 * 64 if gated else 64
    assert mlp.linear_fc1.weight0.shape == (width, 32)
    x = torch.randn(10, 32, requires_grad=True)
    y, _ = mlp(x, torch.tensor([10]), torch.rand(10))
    y.sum().backward()
    assert y.shape == (10, 32) and x.grad.abs().sum() > 0


def test_megatron_settings_te_paged_cannot_reproduce_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="use_te_activation_func=True"):
        as_moe_config(megatron_like_config(use_te_activation_func=True))
    with pytest.raises(ValueError, match="use_fused_weighted_squared_relu=True needs"):
        MoEConfig(use_fused_weighted_squared_relu=True)  # SwiGLU


def test_megatron_dynamic_input_with_host_token_counts() -> None:
    # Megatron's dropless dispatchers hand [sum(tokens), H] with tokens_per_expert on the CPU.
    mlp = TEGroupedMLP(4, megatron_like_config())
    tokens = torch.tensor([3, 0, 5, 2], dtype=torch.int64)
    x = torch.randn(10, 32, requires_grad=True)
    probs = torch.rand(10, requires_grad=True)
    out, bias = mlp(x, tokens, probs)
    assert out.shape == (10, 32) and bias is None
    # against a per-expert loop of plain torch ops
    ref, start = [], 0
    for e, n in enumerate(tokens.tolist()):
        xe, pe = x[start : start + n], probs[start : start + n, None]
        h = F.linear(xe, getattr(mlp.linear_fc1, f"weight{e}"))
        a = F.silu(h[:, :64]) * h[:, 64:] * pe
        ref.append(F.linear(a, getattr(mlp.linear_fc2, f"weight{e}")))
        start += n
    torch.testing.assert_close(out, torch.cat(ref), rtol=1e-5, atol=1e-6)  # fp32 GEMM order
    out.sum().backward()
    assert x.grad is not None and probs.grad is not None


def test_megatron_checkpoint_loads_by_name() -> None:
    a = TEGroupedMLP(4, megatron_like_config())
    b = TEGroupedMLP(4, megatron_like_config())
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_output_bias_is_applied_inside_weighted_by_probs() -> None:
    cfg = config(add_bias_linear=True)
    _, (mlp,) = build(cfg, layers=1)
    with torch.no_grad():
        for i in range(EXPERTS):
            getattr(mlp.linear_fc2, f"bias{i}").fill_(float(i + 1))
    x, tokens, probs = step_inputs(cfg, 0)
    out, bias = mlp(x, tokens, probs)
    cfg_nb = config()
    _, (plain,) = build(cfg_nb, layers=1)
    plain.load_state_dict({k: v for k, v in mlp.state_dict().items() if "bias" not in k})
    with torch.no_grad():
        for i in range(EXPERTS):
            getattr(plain.linear_fc1, f"weight{i}").copy_(getattr(mlp.linear_fc1, f"weight{i}"))
    ref, _ = plain(x, tokens, probs)
    expert = torch.repeat_interleave(torch.arange(EXPERTS), tokens)
    n = int(tokens.sum())
    expected = ref[:n] + (expert + 1).float()[:, None] * probs[:n, None]
    assert bias is None
    torch.testing.assert_close(out[:n], expected)
    assert not out[n:].any()


def test_counts_past_the_buffer_are_invalid_and_do_not_crash() -> None:
    cfg = config(moe_paged_stash=True)
    manager, layers = build(cfg)
    run_step(manager, layers, cfg, 0)
    manager.reset()
    x = torch.randn(ROWS, 32, requires_grad=True)
    probs = torch.rand(ROWS, requires_grad=True)
    out, _ = layers[0](x, torch.tensor([30, 30, 10, 10]), probs)  # 80 > 64 rows
    out.sum().backward()
    stats = manager.stats()
    assert stats.invalid and not stats.overflow


def test_too_small_pool_sets_overflow_and_does_not_crash() -> None:
    cfg = config(moe_paged_stash=True, moe_paged_stash_buffer_size_factor_cuda=0.1)
    manager, layers = build(cfg)
    run_step(manager, layers, cfg, 0)
    assert not manager.stats().overflow
    run_step(manager, layers, cfg, 1)
    stats = manager.stats()
    assert stats.overflow and stats.stashes == stats.pops


def test_layers_share_one_manager_and_pool() -> None:
    cfg = config(moe_paged_stash=True)
    manager, layers = build(cfg, layers=3)
    assert all(layer.manager is manager for layer in layers)
    run_step(manager, layers, cfg, 0)
    run_step(manager, layers, cfg, 1)
    assert manager.stats().stashes == 3 * 4  # fc1 input, act input, probs, fc2 input per layer


def test_owns_a_manager_when_none_is_given() -> None:
    mlp = TEGroupedMLP(EXPERTS, config(moe_paged_stash=True))
    assert mlp.manager is not None


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"moe_paged_stash": True}, "moe_expert_rank_capacity_factor"),
        (
            {
                "moe_paged_stash": True,
                "moe_expert_rank_capacity_factor": 2.0,
                "moe_use_grouped_tensor": False,
            },
            "moe_use_grouped_tensor",
        ),
        (
            {
                "moe_paged_stash": True,
                "moe_expert_rank_capacity_factor": 2.0,
                "moe_mlp_glu_interleave_size": 32,
            },
            "moe_mlp_glu_interleave_size",
        ),
    ],
)
def test_invalid_configs_rejected_at_construction(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        TEGroupedMLP(EXPERTS, MoEConfig(**kw))


def test_module_level_rejections() -> None:
    with pytest.raises(ValueError, match="moe_mlp_glu_interleave_size"):
        TEGroupedMLP(EXPERTS, config(moe_mlp_glu_interleave_size=32))
    with pytest.raises(ValueError, match="moe_use_grouped_tensor=True"):
        TEGroupedMLP(
            EXPERTS, config(use_transformer_engine_op_fuser=True, moe_use_grouped_tensor=False)
        )
    mlp = TEGroupedMLP(EXPERTS, config())
    with pytest.raises(ValueError, match="tokens_per_expert has 3 entries"):
        mlp(torch.randn(8, 32), torch.tensor([1, 2, 3]), torch.rand(8))
    with pytest.raises(ValueError, match=r"must be \[tokens, 32\]"):
        mlp(torch.randn(8, 16), torch.tensor([1, 2, 3, 0]), torch.rand(8))
    with pytest.raises(ValueError, match="permuted_probs has 7 entries"):
        mlp(torch.randn(8, 32), torch.tensor([1, 2, 3, 0]), torch.rand(7))


def test_megatron_default_recompute_modules_are_ignored_without_selective_recompute() -> None:
    # Megatron defaults recompute_modules to ["core_attn"] even with no recompute at all.
    cfg = as_moe_config(megatron_like_config(recompute_modules=["core_attn"]))
    assert cfg.recompute_modules == ()
    cfg = as_moe_config(
        megatron_like_config(recompute_granularity="selective", recompute_modules=["moe_act"])
    )
    assert cfg.recompute_moe_act


def test_expert_tensor_parallelism_is_rejected() -> None:
    group = types.SimpleNamespace(size=lambda: 2)
    with pytest.raises(ValueError, match="expert tensor parallelism"):
        TEGroupedMLP(4, megatron_like_config(), pg_collection=types.SimpleNamespace(expt_tp=group))
