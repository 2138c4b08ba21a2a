"""Tests for `MoEConfig`: defaults, valid paged-stash configs, every rejection, token budgets."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from te_paged.config import (
    Activation,
    Fp8Recipe,
    KernelBackend,
    MoEConfig,
    RecomputeGranularity,
    RecomputeModule,
)

# A valid paged-stash config; rejection cases add one bad setting to it.
PAGED: dict[str, Any] = {"moe_paged_stash": True, "moe_expert_rank_capacity_factor": 1.5}
NON_OP_FUSER_FIX = r"or set use_transformer_engine_op_fuser=True"


def test_defaults() -> None:
    cfg = MoEConfig()
    expected = {
        "hidden_size": 64,
        "moe_ffn_hidden_size": 128,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "gated_linear_unit": True,
        "activation": "swiglu",
        "activation_func_clamp_value": None,
        "glu_linear_offset": 0.0,
        "bias_activation_fusion": True,
        "use_fused_weighted_squared_relu": False,
        "add_bias_linear": False,
        "moe_mlp_glu_interleave_size": None,
        "moe_apply_probs_on_input": False,
        "moe_use_grouped_tensor": True,
        "use_transformer_engine_op_fuser": False,
        "moe_expert_rank_capacity_factor": None,
        "moe_a2a_capacity_factor": None,
        "moe_paged_stash": False,
        "moe_paged_stash_page_size": 64,
        "moe_paged_stash_buffer_size_factor_cuda": 1.10,
        "moe_paged_stash_buffer_size_factor_cpu": 0.0,
        "recompute_granularity": None,
        "recompute_modules": (),
        "cpu_offloading": False,
        "offload_modules": (),
        "fp8": None,
        "activation_func_fp8_input_store": False,
        "params_dtype": torch.float32,
        "expert_model_parallel_size": 1,
        "moe_paged_stash_kernel_backend": "auto",
        "moe_paged_stash_skip_immediate_backward": True,
        "moe_max_tokens_per_rank": None,
    }
    assert dataclasses.asdict(cfg) == expected
    assert {f.name for f in dataclasses.fields(MoEConfig)} == set(expected)
    assert cfg.activation_type.name == Activation.SWIGLU and cfg.activation_type.gated
    assert cfg.fp8_recipe is None
    assert cfg.kernel_backend == KernelBackend.AUTO == "auto"


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="non_op_fuser_swiglu"),
        pytest.param(
            {
                "activation": "quick_geglu",
                "activation_func_clamp_value": 7.0,
                "glu_linear_offset": 1.0,
                "recompute_granularity": "selective",
                "recompute_modules": ["moe_act"],
                "fp8": "mxfp8",
                "params_dtype": torch.bfloat16,
            },
            id="non_op_fuser_quick_geglu",
        ),
        # The op-fuser path runs the fused kernel whatever bias_activation_fusion says.
        pytest.param(
            {
                "use_transformer_engine_op_fuser": True,
                "activation": "quick_geglu",
                "activation_func_clamp_value": 7.0,
                "bias_activation_fusion": False,
                "expert_model_parallel_size": 4,
            },
            id="op_fuser",
        ),
        pytest.param(
            {"use_transformer_engine_op_fuser": True, "moe_mlp_glu_interleave_size": 32},
            id="op_fuser_glu_interleave",
        ),
        # Offloading other modules is fine; capacity factors below 1 are unusual but legal.
        pytest.param(
            {"offload_modules": ["core_attn"], "moe_expert_rank_capacity_factor": 0.5},
            id="other_offload_and_small_capacity",
        ),
        pytest.param({"moe_paged_stash_buffer_size_factor_cpu": 0.5}, id="host_tier"),
        # Megatron's sign convention: negative factors size from the observed peak.
        pytest.param({"moe_paged_stash_buffer_size_factor_cuda": -1.2}, id="observed_peak"),
        pytest.param({"moe_paged_stash_buffer_size_factor_cpu": -0.5}, id="observed_host_tier"),
    ],
)
def test_valid_paged_stash_configs(kwargs: dict[str, Any]) -> None:
    cfg = MoEConfig(**{**PAGED, **kwargs})
    for name, value in kwargs.items():
        assert getattr(cfg, name) == (tuple(value) if isinstance(value, list) else value)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"moe_paged_stash_buffer_size_factor_cuda": 0.0}, id="cuda_factor_0_unpaged"),
        pytest.param({"activation": "gelu", "gated_linear_unit": False}, id="gelu"),
        pytest.param({"activation": "silu", "gated_linear_unit": False}, id="silu"),
        pytest.param({"recompute_granularity": "full"}, id="full_recompute"),
        pytest.param({"moe_use_grouped_tensor": False, "cpu_offloading": True}, id="unpaged"),
    ],
)
def test_valid_configs_without_paged_stash(kwargs: dict[str, Any]) -> None:
    MoEConfig(**kwargs)


def _rejection(case_id: str, kwargs: dict[str, Any], field: str, fix: str) -> Any:
    return pytest.param(kwargs, field, fix, id=case_id)


REJECTIONS = [
    # 1-3: paged stash prerequisites and conflicts.
    _rejection(
        "paged_without_capacity_factor",
        {"moe_paged_stash": True},
        "moe_expert_rank_capacity_factor",
        r"set it, e\.g\. moe_expert_rank_capacity_factor=1\.5",
    ),
    _rejection(
        "paged_with_cpu_offloading",
        {**PAGED, "cpu_offloading": True},
        "cpu_offloading=True",
        "set cpu_offloading=False",
    ),
    *[
        _rejection(
            f"paged_offloads_{module}",
            {**PAGED, "offload_modules": ["core_attn", module]},
            f"offload_modules containing \\['{module}'\\]",
            "remove them from offload_modules",
        )
        for module in ("expert_fc1", "moe_act", "fused_group_mlp")
    ],
    # 4: the non-op-fuser paged-stash path.
    _rejection(
        "non_op_fuser_without_grouped_tensor",
        {**PAGED, "moe_use_grouped_tensor": False},
        "moe_use_grouped_tensor",
        f"set moe_use_grouped_tensor=True {NON_OP_FUSER_FIX}",
    ),
    *[
        _rejection(
            f"{act}_needs_gated_linear_unit_false",
            {**PAGED, "activation": act},
            f"activation='{act}' is not gated but gated_linear_unit=True",
            "set gated_linear_unit=False",
        )
        for act in ("gelu", "silu", "relu", "squared_relu")
    ],
    _rejection(
        "swiglu_needs_gated_linear_unit",
        {**PAGED, "gated_linear_unit": False},
        "activation='swiglu' is gated but gated_linear_unit=False",
        "set gated_linear_unit=True",
    ),
    _rejection(
        "fp8_input_store_needs_the_fused_kernel",
        {
            "fp8": "tensorwise",
            "activation_func_fp8_input_store": True,
            "bias_activation_fusion": False,
        },
        "activation_func_fp8_input_store=True needs the fused kernels",
        "bias_activation_fusion=True with activation 'swiglu' or 'quick_geglu'",
    ),
    _rejection(
        "non_op_fuser_glu_interleave",
        {**PAGED, "moe_mlp_glu_interleave_size": 32},
        "moe_mlp_glu_interleave_size=32",
        f"set moe_mlp_glu_interleave_size=None {NON_OP_FUSER_FIX}",
    ),
    # 5: page size and factors.
    *[
        _rejection(
            f"page_size_{v}",
            {"moe_paged_stash_page_size": v},
            "moe_paged_stash_page_size",
            "positive int",
        )
        for v in (0, -64)
    ],
    _rejection(
        "paged_cuda_factor_0",
        {**PAGED, "moe_paged_stash_buffer_size_factor_cuda": 0.0},
        "moe_paged_stash_buffer_size_factor_cuda=0",
        r"set it > 0 \(x the balanced peak, default 1\.10\), < 0",
    ),
    *[
        _rejection(
            f"{name}_{value}",
            {name: value},
            f"{name} must be .*finite number",
            re.escape(f"got {value!r}"),
        )
        for name in (
            "moe_paged_stash_buffer_size_factor_cuda",
            "moe_paged_stash_buffer_size_factor_cpu",
            "moe_expert_rank_capacity_factor",
        )
        for value in (math.nan, math.inf)
    ],
    _rejection(
        "capacity_factor_negative",
        {"moe_expert_rank_capacity_factor": -0.5},
        "moe_expert_rank_capacity_factor must be .*finite number > 0",
        re.escape("got -0.5"),
    ),
    _rejection(
        "capacity_factor_0",
        {"moe_expert_rank_capacity_factor": 0.0},
        "moe_expert_rank_capacity_factor",
        "finite number > 0",
    ),
    # 6: sizes.
    *[
        _rejection(f"{name}_{v}", {name: v}, name, "must be a positive int")
        for name in (
            "hidden_size",
            "moe_ffn_hidden_size",
            "num_moe_experts",
            "moe_router_topk",
            "expert_model_parallel_size",
        )
        for v in (0, -1, 2.0, True)
    ],
    _rejection(
        "experts_not_divisible_by_ep",
        {"expert_model_parallel_size": 3},
        "num_moe_experts=8 .* expert_model_parallel_size=3",
        "choose an expert_model_parallel_size that divides num_moe_experts",
    ),
    # 7: MXFP8 block alignment.
    *[
        _rejection(
            f"mxfp8_{name}",
            {"fp8": "mxfp8", name: 48},
            f"fp8='mxfp8' needs {name}",
            f"pad {name} to a multiple of 32",
        )
        for name in ("hidden_size", "moe_ffn_hidden_size")
    ],
    # 8: choices, recompute, activation consistency.
    _rejection(
        "unknown_activation",
        {"activation": "tanh"},
        "activation='tanh' is not registered",
        "'swiglu'",
    ),
    _rejection(
        "op_fuser_without_a_fused_kernel",
        {"use_transformer_engine_op_fuser": True, "activation": "geglu"},
        "use_transformer_engine_op_fuser=True fuses an activation with a fused kernel",
        "use the non-op-fuser path",
    ),
    _rejection(
        "clamp_with_the_fused_swiglu",
        {"activation_func_clamp_value": 7.0},
        "the fused 'swiglu' kernel has no clamp",
        "set bias_activation_fusion=False",
    ),
    _rejection("unknown_fp8", {"fp8": "e4m3"}, "fp8='e4m3'", "None or one of 'tensorwise'"),
    _rejection(
        "unknown_kernel_backend",
        {"moe_paged_stash_kernel_backend": "cuda"},
        "moe_paged_stash_kernel_backend='cuda'",
        "one of 'auto', 'torch', 'triton'",
    ),
    _rejection(
        "unknown_granularity",
        {"recompute_granularity": "partial"},
        "recompute_granularity='partial'",
        "None or one of 'selective', 'full'",
    ),
    _rejection(
        "unknown_recompute_module",
        {"recompute_granularity": "selective", "recompute_modules": ["moe_act", "attn"]},
        "recompute_modules contains unknown module 'attn'",
        "allowed: 'moe_act', 'moe'",
    ),
    _rejection(
        "recompute_modules_as_str",
        {"recompute_granularity": "selective", "recompute_modules": "moe_act"},
        "recompute_modules must be a list",
        r"\['moe_act'\]",
    ),
    *[
        _rejection(
            f"moe_act_with_granularity_{granularity}",
            {"recompute_granularity": granularity, "recompute_modules": ["moe_act"]},
            "recompute_modules=\\['moe_act'\\]",
            "set recompute_granularity='selective'",
        )
        for granularity in (None, "full")
    ],
    *[
        _rejection(
            f"{act}_not_gated",
            {"activation": act, "gated_linear_unit": False},
            f"activation='{act}' is gated",
            "set gated_linear_unit=True",
        )
        for act in ("swiglu", "quick_geglu")
    ],
    _rejection(
        "gelu_gated",
        {"activation": "gelu"},
        "activation='gelu' is not gated",
        "set gated_linear_unit=False",
    ),
    _rejection(
        "clamp_without_a_gated_activation",
        {"activation": "gelu", "gated_linear_unit": False, "activation_func_clamp_value": 7.0},
        "activation_func_clamp_value=7.0 only applies to a gated activation",
        "set activation_func_clamp_value=None or a gated activation",
    ),
    _rejection(
        "offset_without_a_gated_activation",
        {"activation": "relu", "gated_linear_unit": False, "glu_linear_offset": 1.0},
        "glu_linear_offset=1.0 only applies to a gated activation",
        "set glu_linear_offset=0.0 or a gated activation",
    ),
    *[
        _rejection(
            f"clamp_{value}",
            {"activation": "quick_geglu", "activation_func_clamp_value": value},
            "activation_func_clamp_value must be None or a finite number > 0",
            re.escape(f"got {value!r}"),
        )
        for value in (0.0, -1.0, math.nan)
    ],
    _rejection(
        "interleave_0",
        {"use_transformer_engine_op_fuser": True, "moe_mlp_glu_interleave_size": 0},
        "moe_mlp_glu_interleave_size",
        "None or a positive int",
    ),
    # 9: parameter dtype.
    *[
        _rejection(
            f"params_dtype_{dtype}",
            {"params_dtype": dtype},
            re.escape(f"params_dtype={dtype!r}"),
            "use one of torch.float32, torch.bfloat16, torch.float16",
        )
        for dtype in (torch.int32, torch.float64, torch.float8_e4m3fn)
    ],
]


@pytest.mark.parametrize(("kwargs", "field", "fix"), REJECTIONS)
def test_rejects_invalid_config(kwargs: dict[str, Any], field: str, fix: str) -> None:
    with pytest.raises(ValueError, match=f"{field}.*{fix}") as info:
        MoEConfig(**kwargs)
    # Each case has exactly one problem, so the message is a single line.
    assert "\n" not in str(info.value)


def test_reports_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as info:
        MoEConfig(moe_paged_stash=True, cpu_offloading=True, hidden_size=0, fp8="e5m2")
    message = str(info.value)
    for phrase in ("fp8='e5m2'", "hidden_size", "cpu_offloading", "moe_expert_rank_capacity"):
        assert phrase in message
    assert message.count("\n  - ") == 4


def test_replace_revalidates() -> None:
    cfg = MoEConfig(**PAGED)
    assert dataclasses.replace(cfg, moe_paged_stash_page_size=128).moe_paged_stash_page_size == 128
    with pytest.raises(ValueError, match=r"moe_expert_rank_capacity_factor.*set it"):
        dataclasses.replace(cfg, moe_expert_rank_capacity_factor=None)
    with pytest.raises(ValueError, match="moe_use_grouped_tensor"):
        dataclasses.replace(cfg, moe_use_grouped_tensor=False)


def test_frozen_and_replace_validates() -> None:
    cfg = MoEConfig(**PAGED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cpu_offloading = True
    with pytest.raises(ValueError, match="cpu_offloading=True"):
        dataclasses.replace(cfg, cpu_offloading=True)
    with pytest.raises(TypeError):
        MoEConfig(64)  # keyword-only, as Megatron's fields are passed
    assert not hasattr(cfg, "__dict__")  # slots


def test_lists_are_copied() -> None:
    modules = ["moe_act"]
    cfg = MoEConfig(recompute_granularity="selective", recompute_modules=modules)
    modules.append("unknown")
    assert cfg.recompute_modules == ("moe_act",)


def test_enum_members_are_normalised_to_strings() -> None:
    cfg = MoEConfig(
        activation=Activation.QUICK_GEGLU,
        fp8=Fp8Recipe.MXFP8,
        moe_paged_stash_kernel_backend=KernelBackend.TORCH,
        recompute_granularity=RecomputeGranularity.SELECTIVE,
        recompute_modules=[RecomputeModule.MOE_ACT],
    )
    assert type(cfg.activation) is str and cfg.activation == "quick_geglu"
    assert type(cfg.fp8) is str and cfg.fp8 == "mxfp8"
    assert cfg.recompute_granularity == "selective"
    assert [type(m) for m in cfg.recompute_modules] == [str] and cfg.recompute_moe_act
    assert cfg.activation_type.name == Activation.QUICK_GEGLU
    assert cfg.fp8_recipe is Fp8Recipe.MXFP8
    assert type(cfg.kernel_backend) is str and cfg.kernel_backend == KernelBackend.TORCH


def test_derived_properties() -> None:
    cfg = MoEConfig(num_moe_experts=8, expert_model_parallel_size=4)
    assert cfg.num_local_experts == 2
    assert cfg.fc1_output_size == 256
    assert not cfg.recompute_moe_act
    cfg = MoEConfig(
        activation="gelu",
        gated_linear_unit=False,
        recompute_granularity="selective",
        recompute_modules=["moe_act"],
    )
    assert cfg.fc1_output_size == 128
    assert cfg.recompute_moe_act
    gated = ["swiglu", "geglu", "quick_geglu", "reglu", "squared_reglu"]
    assert [a.value for a in Activation if a.is_gated] == gated
    assert Activation.from_function("gelu", True) is Activation.GEGLU
    assert Activation.from_function("squared_relu", False).function == "squared_relu"


@pytest.mark.parametrize("activation", [a.value for a in Activation])
@pytest.mark.parametrize("fusion", [False, True])
def test_every_activation_works_with_paged_stash(activation, fusion) -> None:
    # Before: the non-op-fuser paged-stash path accepted only fused SwiGLU/QuickGeGLU.
    gated = Activation(activation).is_gated
    MoEConfig(**{**PAGED, "activation": activation, "gated_linear_unit": gated,
                 "bias_activation_fusion": fusion})  # fmt: skip


def test_top_k_is_the_routers_check_not_the_expert_configs() -> None:
    # Megatron builds an expert module for each EP rank's local experts whatever top-k is.
    cfg = MoEConfig(num_moe_experts=2, moe_router_topk=4)
    from te_paged import TEGroupedMLP, TopKRouter

    TEGroupedMLP(1, cfg)
    with pytest.raises(ValueError, match="moe_router_topk=4 exceeds num_moe_experts=2"):
        TopKRouter(cfg)


@pytest.mark.parametrize(
    ("num_tokens", "topk", "factor", "fp8", "expected_max", "expected_avg"),
    [
        (100, 2, 1.5, None, 300, 200),
        # Float math gives ceil(220.00000000000003) = 221 and 220 // 1.1 = 199.
        (100, 2, 1.1, None, 220, 200),
        (7, 2, 1.3, None, 19, 14),  # ceil(18.2) = 19; floor(19 / 1.3) = floor(14.6)
        (0, 2, 1.5, None, 0, 0),
        (100, 2, 0.5, None, 100, 200),
        (100, 2, 1.1, "mxfp8", 224, 203),  # 220 rounded up to 7 blocks of 32
        (1, 2, 1.0, "mxfp8", 32, 32),
        (64, 2, 1.0, "mxfp8", 128, 128),  # already aligned
        (100, 2, 1.1, "tensorwise", 220, 200),  # only MXFP8 aligns
    ],
)
def test_token_budgets(
    num_tokens: int,
    topk: int,
    factor: float,
    fp8: str | None,
    expected_max: int,
    expected_avg: int,
) -> None:
    cfg = MoEConfig(moe_router_topk=topk, moe_expert_rank_capacity_factor=factor, fp8=fp8)
    max_num_tokens = cfg.max_num_tokens(num_tokens)
    assert max_num_tokens == expected_max
    assert cfg.avg_num_tokens(max_num_tokens) == expected_avg


@given(
    num_tokens=st.integers(min_value=0, max_value=1 << 20),
    topk=st.integers(min_value=1, max_value=8),
    hundredths=st.integers(min_value=100, max_value=400),
)
def test_balanced_estimate_recovers_routed_tokens(
    num_tokens: int, topk: int, hundredths: int
) -> None:
    # For a factor >= 1, ceil(x·f) / f < x + 1, so the balanced estimate is exactly x = T·top_k.
    factor = hundredths / 100
    cfg = MoEConfig(moe_router_topk=topk, moe_expert_rank_capacity_factor=factor)
    max_num_tokens = cfg.max_num_tokens(num_tokens)
    assert max_num_tokens >= num_tokens * topk * factor - 1e-6
    assert cfg.avg_num_tokens(max_num_tokens) == num_tokens * topk


def test_budgets_need_capacity_factor_and_valid_counts() -> None:
    with pytest.raises(ValueError, match=r"moe_expert_rank_capacity_factor.*set it"):
        MoEConfig().max_num_tokens(100)
    with pytest.raises(ValueError, match=r"moe_expert_rank_capacity_factor.*set it"):
        MoEConfig().avg_num_tokens(100)
    cfg = MoEConfig(moe_expert_rank_capacity_factor=1.5)
    with pytest.raises(ValueError, match="num_tokens must be a non-negative int; got -1"):
        cfg.max_num_tokens(-1)
    with pytest.raises(ValueError, match=r"max_num_tokens must be a non-negative int; got 2\.5"):
        cfg.avg_num_tokens(2.5)  # type: ignore[arg-type]


def test_activation_fp8_input_store_needs_an_fp8_recipe() -> None:
    with pytest.raises(ValueError, match="activation_func_fp8_input_store=True needs an FP8"):
        MoEConfig(activation_func_fp8_input_store=True)
    assert MoEConfig(fp8="tensorwise", activation_func_fp8_input_store=True).fp8 == "tensorwise"


def test_a2a_capacity_factor_defaults_to_the_expert_buffer_and_is_never_above_it() -> None:
    assert MoEConfig().a2a_capacity_factor is None  # no static budget, no wire budget
    assert MoEConfig(moe_expert_rank_capacity_factor=2.0).a2a_capacity_factor == 2.0
    cfg = MoEConfig(moe_expert_rank_capacity_factor=2.0, moe_a2a_capacity_factor=1.6)
    assert cfg.a2a_capacity_factor == 1.6
    with pytest.raises(ValueError, match=r"moe_a2a_capacity_factor=2.5 is larger than"):
        MoEConfig(moe_expert_rank_capacity_factor=2.0, moe_a2a_capacity_factor=2.5)
    with pytest.raises(ValueError, match=r"moe_a2a_capacity_factor must be None or a finite"):
        MoEConfig(moe_expert_rank_capacity_factor=2.0, moe_a2a_capacity_factor=0.0)
