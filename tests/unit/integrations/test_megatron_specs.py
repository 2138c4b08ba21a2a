"""``with_te_paged_moe`` on Megatron's own specs (megatron-core 0.19.2 writes them as
``functools.partial`` s, 0.16.1 as ``ModuleSpec`` s): every MoE layer becomes te_paged's, with
one stash manager and one adapter, the router and shared experts kept; nothing else changes.
(Built and trained on 4 ranks in functional_tests/megatron/test_megatron_pretrain.py.)"""

from __future__ import annotations

import functools

import pytest

from te_paged.integrations import megatron as tpm

from .test_megatron_adapters import megatron_config

STASH = {"moe_expert_rank_capacity_factor": 2.0, "moe_paged_stash": True}


def _moe_specs(node, found=None) -> list:
    """Every te_paged MoE spec in ``node`` (a layer, block or hybrid-stack spec)."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    found = [] if found is None else found
    if isinstance(node, ModuleSpec):
        if node.module is tpm.PagedStashMoELayer:
            found.append(node)
        else:
            _moe_specs(node.submodules, found)
    elif isinstance(node, functools.partial):
        for value in node.keywords.values():
            _moe_specs(value, found)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _moe_specs(value, found)
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        for field in dataclasses.fields(node):
            _moe_specs(getattr(node, field.name), found)
    return found


def test_a_gpt_layer_spec_gets_te_pageds_moe_keeping_its_router() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = megatron_config(num_moe_experts=8)
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    router = spec.submodules.mlp.keywords["submodules"].router
    loop = tpm.MegatronLoopAdapter()
    out = tpm.with_te_paged_moe(spec, cfg, loop=loop, **STASH)
    (moe,) = _moe_specs(out)
    assert moe.params["loop"] is loop
    assert moe.submodules.router is router  # Megatron's, kept
    assert moe.submodules.experts.module is tpm.MegatronTEGroupedMLP
    assert out.submodules.self_attention == spec.submodules.self_attention  # the rest as it was
    assert spec.submodules.mlp.func.__name__ == "MoELayer"  # the input is not changed


def test_every_moe_layer_of_a_hybrid_stack_shares_one_manager_and_one_adapter() -> None:
    cfg = megatron_config(num_moe_experts=8)
    stack = tpm.local_hybrid_stack_spec(8)
    out = tpm.with_te_paged_moe(stack, cfg, **STASH)
    (moe,) = _moe_specs(out)  # the stack's one MoE slot
    manager = moe.submodules.experts.params["manager"]
    assert manager is not None and isinstance(moe.params["loop"], tpm.MegatronLoopAdapter)
    # A block of two MoE layer specs (as get_gpt_decoder_block_spec builds): one of each.
    two = tpm.with_te_paged_moe([stack, stack], cfg, **STASH)
    first, second = _moe_specs(two)
    assert first.submodules.experts.params["manager"] is second.submodules.experts.params["manager"]
    assert first.params["loop"] is second.params["loop"]


def test_a_spec_without_moe_layers_is_refused() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    with pytest.raises(ValueError, match="no MoE layer"):
        tpm.with_te_paged_moe(get_gpt_layer_local_spec(), megatron_config(), **STASH)


def test_a_config_without_a_static_budget_gets_megatrons_layer_and_no_loop_error() -> None:
    # Before: with_te_paged_moe made a loop itself and passed it on, so a config without
    # moe_expert_rank_capacity_factor failed with "loop= was given" when no loop was given.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = megatron_config(num_moe_experts=8)
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    out = tpm.with_te_paged_moe(spec, cfg)
    assert not _moe_specs(out)  # Megatron's own MoELayer around te_paged's experts
    assert out.submodules.mlp.module.__name__ == "MoELayer"
    with pytest.raises(ValueError, match="loop= was given"):  # and one given is still refused
        tpm.with_te_paged_moe(spec, cfg, loop=tpm.MegatronLoopAdapter())


def test_gpt_layer_spec_takes_an_adapter_through_a_partial(monkeypatch) -> None:
    # The --spec route passes no options; a script reaches them with
    # functools.partial(gpt_layer_spec, loop=MegatronLoopAdapter(...)).
    import sys
    import types

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # megatron.training needs Python 3.12 (typing.override) unless the CPU shims run: the one
    # function gpt_layer_spec calls, as Megatron's default_layer_spec would answer here.
    gpt = types.ModuleType("megatron.training.models.gpt")
    gpt.default_layer_spec = lambda cfg, vp_stage: get_gpt_layer_local_spec(
        num_experts=8, moe_grouped_gemm=False
    )
    monkeypatch.setitem(sys.modules, "megatron.training.models.gpt", gpt)
    model_config = types.SimpleNamespace(transformer=megatron_config(num_moe_experts=8,
                                                                     **STASH))  # fmt: skip
    loop = tpm.MegatronLoopAdapter(grow_pool=False, max_consecutive_fallbacks=5)
    spec = functools.partial(tpm.gpt_layer_spec, loop=loop)
    chunks = [_moe_specs(spec(model_config, vp_stage)) for vp_stage in (0, 1)]
    assert [moe.params["loop"] for (moe,) in chunks] == [loop, loop]  # one adapter, every chunk
    (default,) = _moe_specs(tpm.gpt_layer_spec(model_config))  # --spec: its own, defaults
    assert default.params["loop"] is not loop and default.params["loop"]._options["grow_pool"]


def _default_layer_spec_stand_in(monkeypatch, seen: list) -> None:
    """Megatron-LM's ``default_layer_spec`` (needs Python 3.12's typing.override without the
    CPU shims), answering Megatron's local MoE layer spec and noting what it was given."""
    import sys
    import types

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def default_layer_spec(model_config, vp_stage):
        seen.append((model_config.transformer, model_config.restore_modelopt_state, vp_stage))
        return get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)

    gpt = types.ModuleType("megatron.training.models.gpt")
    gpt.default_layer_spec = default_layer_spec
    monkeypatch.setitem(sys.modules, "megatron.training.models.gpt", gpt)


def _provider(**fields):
    """A stand-in for Megatron-Bridge's ``GPTModelProvider``: its own TransformerConfig (no
    ``.transformer``), with the model fields Megatron-LM's spec function reads."""
    cfg = megatron_config(num_moe_experts=8, **STASH)
    cfg.restore_modelopt_state = False
    cfg.__dict__.update(fields)
    return cfg


def test_gpt_layer_spec_takes_a_bridge_provider(monkeypatch) -> None:
    """Bridge calls ``provider.transformer_layer_spec(provider, vp_stage=...)``: the provider
    is its own TransformerConfig (before: ``AttributeError: ... 'transformer'``)."""
    seen: list = []
    _default_layer_spec_stand_in(monkeypatch, seen)
    provider = _provider()
    loop = tpm.MegatronLoopAdapter()
    (moe,) = _moe_specs(functools.partial(tpm.gpt_layer_spec, loop=loop)(provider, vp_stage=1))
    assert seen == [(provider, False, 1)]  # the spec Megatron-LM builds for the same fields
    assert moe.params["loop"] is loop and moe.submodules.experts.module is tpm.MegatronTEGroupedMLP


def test_a_spec_function_gives_back_a_spec_function_of_the_same_signature() -> None:
    """Bridge's provider holds its spec as a function of the provider, with or without
    ``vp_stage`` (it reads the signature): the result is such a function too, and all the
    chunks it builds share one manager and one adapter."""
    import inspect

    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    from .test_megatron_releases import BUILTIN_STASH, _config

    # A real TransformerConfig (Megatron's block spec reads many of its fields), as Bridge's
    # provider is one, with the fields Bridge's perf recipes set.
    provider = _config(**{**BUILTIN_STASH, "moe_paged_stash_buffer_size_factor_cuda": 1.3})

    def local(config):  # Bridge's local_layer_spec: no vp_stage
        return get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)

    loop = tpm.MegatronLoopAdapter()
    wrapped = tpm.with_te_paged_moe(local, provider, loop=loop)
    assert callable(wrapped) and "vp_stage" not in inspect.signature(wrapped).parameters
    (moe,) = _moe_specs(wrapped(provider))
    assert moe.params["loop"] is loop
    # DeepSeek-V3's: partial(get_gpt_decoder_block_spec, ...), called with vp_stage.
    block = functools.partial(get_gpt_decoder_block_spec, use_transformer_engine=False, pp_rank=0)
    wrapped = tpm.with_te_paged_moe(block, None)
    assert "vp_stage" in inspect.signature(wrapped).parameters
    chunks = [_moe_specs(wrapped(provider, vp_stage=None)) for _ in range(2)]  # two chunks
    managers = {id(m.submodules.experts.params["manager"]) for chunk in chunks for m in chunk}
    loops = {id(m.params["loop"]) for chunk in chunks for m in chunk}
    assert [len(c) for c in chunks] == [2, 2] and len(managers) == 1 and len(loops) == 1
    # A spec stays a spec (a partial of a module class is one, not a function of a config).
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    assert isinstance(tpm.with_te_paged_moe(spec, provider), type(spec))
