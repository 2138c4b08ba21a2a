"""The Megatron integration's pieces that need no Megatron: checkpoint conversion, the
``GroupedLinear`` adapter, config reading and the lazy import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F

from te_paged import GroupedLinear, MoEConfig, TEGroupedMLP
from te_paged.integrations import megatron as tpm

H, FFN, E = 16, 32, 3


def megatron_config(**overrides) -> types.SimpleNamespace:
    """The fields of Megatron's ``TransformerConfig`` the integration reads, with Megatron's
    defaults (``recompute_modules=["core_attn"]`` without selective recompute included)."""
    fields = {
        "hidden_size": H,
        "ffn_hidden_size": FFN,
        "moe_ffn_hidden_size": FFN,
        "num_moe_experts": E,
        "moe_router_topk": 2,
        "activation_func": F.silu,
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "bias_activation_fusion": True,
        "params_dtype": torch.float32,
        "fp8": None,
        "fp4": None,
        "recompute_granularity": None,
        "recompute_modules": ["core_attn"],
        "expert_model_parallel_size": 1,
        "expert_tensor_parallel_size": 1,
        "moe_latent_size": None,
        "use_cpu_initialization": True,
        "perform_initialization": True,
        "moe_apply_probs_on_input": False,
    }
    fields.update(overrides)
    return types.SimpleNamespace(**fields)


def sequential_dict(prefix: str = "", bias: bool = False) -> dict[str, torch.Tensor]:
    """A SequentialMLP expert state dict, as Megatron writes it (``_extra_state`` included)."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, object] = {}
    for i in range(E):
        for linear, shape in (("linear_fc1", (2 * FFN, H)), ("linear_fc2", (H, FFN))):
            sd[f"{prefix}local_experts.{i}.{linear}.weight"] = torch.randn(shape, generator=g)
            if bias:
                sd[f"{prefix}local_experts.{i}.{linear}.bias"] = torch.randn(shape[0], generator=g)
            sd[f"{prefix}local_experts.{i}.{linear}._extra_state"] = None
    return sd


# ---------------------------------------------------------------------------- state dicts


def test_sequential_to_grouped_renames_experts_and_keeps_everything_else() -> None:
    p = "decoder.layers.1.mlp.experts."
    dense_w = torch.randn(2 * FFN, H)
    sd = {
        **sequential_dict(p, bias=True),
        "decoder.layers.1.mlp.router.weight": torch.randn(E, H),
        "decoder.layers.0.mlp.linear_fc1.weight": dense_w,  # a dense MLP: left alone
    }
    out = tpm.sequential_to_grouped_state_dict(sd)
    for i in range(E):
        for linear in ("linear_fc1", "linear_fc2"):
            for param in ("weight", "bias"):
                src = sd[f"{p}local_experts.{i}.{linear}.{param}"]
                assert out[f"{p}{linear}.{param}{i}"] is src  # renamed, not copied
    assert out["decoder.layers.0.mlp.linear_fc1.weight"] is dense_w
    assert out["decoder.layers.1.mlp.router.weight"] is sd["decoder.layers.1.mlp.router.weight"]
    assert f"{p}linear_fc1._extra_state" in out  # one per linear, not one per expert
    assert not any("local_experts" in k for k in out)
    assert len(out) == 2 + E * 2 * 2 + 2


def test_grouped_to_sequential_inverts_and_unstacks() -> None:
    sd = {k: v for k, v in sequential_dict("experts.", bias=True).items() if v is not None}
    back = tpm.grouped_to_sequential_state_dict(tpm.sequential_to_grouped_state_dict(sd))
    assert back.keys() == sd.keys()
    assert all(back[k] is sd[k] for k in sd)
    stacked = {
        "experts.linear_fc1.weight": torch.randn(E, 2 * FFN, H),  # single grouped weight
        "experts.linear_fc1.bias": torch.randn(E, 2 * FFN),
        "shared_experts.linear_fc1.weight": torch.randn(2 * FFN, H),  # dense: 2-D, left alone
    }
    out = tpm.grouped_to_sequential_state_dict(stacked)
    for i in range(E):
        w = out[f"experts.local_experts.{i}.linear_fc1.weight"]
        assert torch.equal(w, stacked["experts.linear_fc1.weight"][i])
        b = out[f"experts.local_experts.{i}.linear_fc1.bias"]
        assert torch.equal(b, stacked["experts.linear_fc1.bias"][i])
    assert out["shared_experts.linear_fc1.weight"] is stacked["shared_experts.linear_fc1.weight"]
    assert len(out) == 2 * E + 1


@pytest.mark.parametrize("layout", ["sequential", "grouped"])
@pytest.mark.parametrize("bias", [False, True])
def test_load_megatron_expert_state_dict_into_te_grouped_mlp(layout, bias) -> None:
    sd = sequential_dict(bias=bias)
    if layout == "grouped":  # Megatron TEGroupedMLP's layout (with TE's _extra_state)
        sd = tpm.sequential_to_grouped_state_dict(sd)
    experts = TEGroupedMLP(E, MoEConfig(hidden_size=H, moe_ffn_hidden_size=FFN,
                                        num_moe_experts=E, add_bias_linear=bias))  # fmt: skip
    result = tpm.load_megatron_expert_state_dict(experts, sd)
    assert not result.missing_keys and not result.unexpected_keys
    for i in range(E):
        for linear in ("linear_fc1", "linear_fc2"):
            got = getattr(getattr(experts, linear), f"weight{i}")
            assert torch.equal(got, sd_value(sd, i, linear, "weight"))
            if bias:
                got = getattr(getattr(experts, linear), f"bias{i}")
                assert torch.equal(got, sd_value(sd, i, linear, "bias"))
    back = tpm.to_megatron_sequential_state_dict(experts)
    expected = {k: v for k, v in sequential_dict(bias=bias).items() if v is not None}
    assert back.keys() == expected.keys()
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def sd_value(sd: dict, i: int, linear: str, param: str) -> torch.Tensor:
    return sd.get(f"{linear}.{param}{i}", sd.get(f"local_experts.{i}.{linear}.{param}"))


def test_load_into_single_grouped_weight_and_back_to_grouped_layout() -> None:
    fc1 = GroupedLinear(E, H, 2 * FFN, bias=False, single_grouped_weight=True)
    sd = {f"weight{i}": torch.randn(2 * FFN, H) for i in range(E)}
    tpm.load_megatron_expert_state_dict(fc1, sd)
    assert torch.equal(fc1.weight, torch.stack([sd[f"weight{i}"] for i in range(E)]))
    out = tpm.to_megatron_grouped_state_dict(fc1)
    assert out.keys() == sd.keys()
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_load_reports_a_missing_expert() -> None:
    sd = sequential_dict()
    del sd["local_experts.2.linear_fc2.weight"]
    experts = TEGroupedMLP(E, MoEConfig(hidden_size=H, moe_ffn_hidden_size=FFN, num_moe_experts=E))
    with pytest.raises(RuntimeError, match=r"linear_fc2\.weight2"):
        tpm.load_megatron_expert_state_dict(experts, sd)
    assert tpm.load_megatron_expert_state_dict(experts, sd, strict=False).missing_keys == [
        "linear_fc2.weight2"
    ]


# ------------------------------------------------------------------------------- adapters


def _linear(cfg=None, *, bias=False, skip_bias_add=False) -> tpm.MegatronGroupedLinear:
    torch.manual_seed(0)
    return tpm.MegatronGroupedLinear(
        E, H, FFN, config=cfg or megatron_config(), init_method=torch.nn.init.normal_,
        bias=bias, skip_bias_add=skip_bias_add, is_expert=True, tp_comm_buffer_name="fc1",
        pg_collection=None,
    )  # fmt: skip


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_grouped_linear_adapter_follows_megatrons_protocol(bias, skip_bias_add) -> None:
    layer = _linear(bias=bias, skip_bias_add=skip_bias_add)
    counts = [3, 0, 4]  # Megatron passes tokens_per_expert.tolist()
    x = torch.randn(sum(counts), H)
    out, b = layer(x, counts)
    ref = GroupedLinear(E, H, FFN, bias=bias, use_grouped_tensor=False)
    ref.load_state_dict(layer.state_dict())
    expected = ref(x, counts)
    if skip_bias_add and bias:  # Megatron adds it later, zipping per expert (TE's list)
        assert len(b) == E and all(bi.shape == (FFN,) for bi in b)
        expected = expected - torch.cat([b[i].expand(n, -1) for i, n in enumerate(counts)])
        assert torch.allclose(out, expected, atol=1e-6)  # (x·W + b) − b vs x·W: rounding
    else:
        assert b is None
        assert torch.equal(out, expected)
    out_t, _ = layer(x, torch.tensor(counts))  # a host tensor works too
    assert torch.equal(out_t, out)
    assert sorted(layer.state_dict()) == sorted(ref.state_dict())  # weight{i}/bias{i}
    layer.backward_dw()  # Megatron's hook: nothing left to do


def test_grouped_linear_adapter_uses_init_method_unless_told_not_to() -> None:
    calls = []
    tpm.MegatronGroupedLinear(
        E, H, FFN, config=megatron_config(), init_method=calls.append, bias=False,
        skip_bias_add=False, is_expert=True,
    )  # fmt: skip
    assert len(calls) == E and all(w.shape == (FFN, H) for w in calls)
    calls.clear()
    tpm.MegatronGroupedLinear(
        E, H, FFN, config=megatron_config(perform_initialization=False),
        init_method=calls.append, bias=False, skip_bias_add=False, is_expert=True,
    )  # fmt: skip
    assert calls == []


def test_grouped_linear_adapter_rejects_what_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="is_expert"):
        tpm.MegatronGroupedLinear(
            E, H, FFN, config=megatron_config(), init_method=None, bias=False,
            skip_bias_add=False, is_expert=False,
        )  # fmt: skip
    with pytest.raises(ValueError, match="fp8"):
        _linear(megatron_config(fp8="hybrid"))
    two_ranks = types.SimpleNamespace(expt_tp=types.SimpleNamespace(size=lambda: 2))
    with pytest.raises(ValueError, match="2 ranks"):
        tpm.MegatronGroupedLinear(
            E, H, FFN, config=megatron_config(), init_method=None, bias=False,
            skip_bias_add=False, is_expert=True, pg_collection=two_ranks,
        )  # fmt: skip


# --------------------------------------------------------------------------------- config


def test_megatron_moe_config_reads_megatron_semantics_and_overrides() -> None:
    cfg = tpm.megatron_moe_config(megatron_config())
    assert cfg.recompute_modules == ()  # Megatron's ["core_attn"] is inert without selective
    assert cfg.activation == "swiglu" and cfg.moe_ffn_hidden_size == FFN
    rc = tpm.megatron_moe_config(
        megatron_config(recompute_granularity="selective", recompute_modules=["moe_act"]),
        moe_paged_stash=True,
        moe_expert_rank_capacity_factor=1.0,
    )
    assert rc.recompute_moe_act and rc.moe_paged_stash
    with pytest.raises(ValueError, match="unknown te_paged config overrides"):
        tpm.megatron_moe_config(megatron_config(), moe_paged_stach=True)
    with pytest.raises(ValueError, match="expert_tensor_parallel_size=2"):
        tpm.megatron_moe_config(megatron_config(expert_tensor_parallel_size=2))
    with pytest.raises(ValueError, match="moe_latent_size"):
        tpm.megatron_moe_config(megatron_config(moe_latent_size=8))
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor"):
        tpm.megatron_moe_config(megatron_config(), moe_paged_stash=True)


def test_megatron_experts_share_the_spec_manager() -> None:
    overrides = {"moe_paged_stash": True, "moe_expert_rank_capacity_factor": 1.0}
    own = tpm.MegatronTEGroupedMLP(E, megatron_config(), overrides=overrides)
    assert own.manager is not None and own.manager.device == torch.device("cpu")
    shared = own.manager
    layers = torch.nn.ModuleList(
        tpm.MegatronTEGroupedMLP(E, megatron_config(), manager=shared, overrides=overrides)
        for _ in range(2)
    )
    assert tpm.paged_stash_managers(layers) == [shared]
    plain = tpm.MegatronTEGroupedMLP(E, megatron_config())
    assert plain.manager is None and tpm.paged_stash_managers(plain) == []
    assert sorted(plain.state_dict())[:2] == ["linear_fc1.weight0", "linear_fc1.weight1"]


# ---------------------------------------------------------------------------- lazy import


def test_importing_the_integration_does_not_import_megatron() -> None:
    code = textwrap.dedent(
        """
        import sys
        import te_paged.integrations.megatron as tpm
        assert not [m for m in sys.modules if m.split(".")[0] == "megatron"], "megatron imported"
        sys.modules["megatron"] = None  # as if it were not installed
        try:
            tpm.get_te_paged_linear_moe_spec()
        except ImportError as e:
            assert "pip install --no-deps megatron-core" in str(e), e
            print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


def test_loading_ignores_transformer_engines_extra_state_of_the_expert_linears() -> None:
    # Megatron's TE linears keep FP8 metadata in `_extra_state[i]` entries, and the distributed
    # checkpoint hands them back: te_paged's linears skip them, strict loads still catch the rest.
    layer = _linear()
    sd = layer.state_dict()
    extra = {"_extra_state": None, "_extra_state1": b"fp8 metadata", "_extra_state2": None}
    assert str(layer.load_state_dict({**sd, **extra}, strict=True)).startswith("<All keys")
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*_extra_state\.x"):
        layer.load_state_dict({**sd, "_extra_state.x": None}, strict=True)
    experts = tpm.MegatronTEGroupedMLP(E, megatron_config(), device="cpu")
    sd = experts.state_dict()
    extra = {"linear_fc1._extra_state": None, "linear_fc2._extra_state2": None}
    assert str(experts.load_state_dict({**sd, **extra}, strict=True)).startswith("<All keys")
    with pytest.raises(RuntimeError, match=r"Unexpected key.*router\._extra_state"):
        experts.load_state_dict({**sd, "router._extra_state": None}, strict=True)


def test_distributed_checkpoint_of_a_single_grouped_weight_is_refused() -> None:
    from te_paged.integrations.megatron.dist_ckpt import linear_sharded_state_dict

    linear = GroupedLinear(E, H, FFN, bias=False, single_grouped_weight=True)
    with pytest.raises(NotImplementedError, match="one parameter per expert"):
        linear_sharded_state_dict(linear, "", "experts.", "linear_fc1.", tp_axis=0, swiglu=True)
