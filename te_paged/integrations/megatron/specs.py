"""te_paged's MoE layer inside whole-model specs: Megatron's layer, block and hybrid-stack specs
with every MoE MLP replaced, and the layer-spec function Megatron-LM's ``--spec`` takes.

Megatron-LM's ``pretrain_gpt.py`` (megatron-core 0.19.2's training loop) builds the model from a
``GPTModelConfig`` whose ``transformer_layer_spec`` may be a function of that config;
``--spec <module> <name>`` names it. So the program users launch takes te_paged's layers with
one flag and no code::

    python pretrain_gpt.py ... --spec te_paged.integrations.megatron gpt_layer_spec \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ncclep \\
        --moe-expert-rank-capacity-factor 2.0 --moe-paged-stash

(0.19.2's ``TransformerConfig`` asks for a flex backend beside a rank capacity factor; te_paged's
layer never builds that dispatcher.) A script of one's own (or a ``HybridModel``, whose
``hybrid_stack_spec`` is a spec, not a function) uses :func:`with_te_paged_moe` on the spec it
already builds.

Megatron-Bridge's ``GPTModelProvider`` is its own ``TransformerConfig`` and holds its
``transformer_layer_spec`` as a spec or as a function of the provider (``vp_stage`` optional;
DeepSeek-V3's is ``partial(get_gpt_decoder_block_spec, use_transformer_engine=...)``). Both
helpers take it as it is: ``provider.transformer_layer_spec = with_te_paged_moe(
provider.transformer_layer_spec, provider, loop=adapter)`` keeps a function a function, or
``provider.transformer_layer_spec = gpt_layer_spec``. Importing this module does not import
Megatron.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import Any

from te_paged.integrations.megatron.experts import get_te_paged_moe_spec
from te_paged.integrations.megatron.loop import MegatronLoopAdapter

__all__ = ["gpt_layer_spec", "local_hybrid_stack_spec", "with_te_paged_moe"]


def with_te_paged_moe(
    spec: Any, config: object, *, loop: MegatronLoopAdapter | None = None, **kwargs: object
) -> Any:
    """A copy of ``spec`` (of a layer, a block's ``TransformerBlockSubmodules``, a ``HybridStack``:
    anything Megatron builds, as ``ModuleSpec`` s or, as megatron-core 0.19.2 writes them,
    ``functools.partial`` s of the module class) in which every MoE MLP — Megatron's
    ``MoELayer`` — is te_paged's: :func:`get_te_paged_moe_spec` with ``config`` and ``kwargs``
    (``manager``, ``device``, te_paged overrides), keeping the original's other submodules
    (shared experts, router). All of them share one stash manager and, with a static budget
    (``moe_expert_rank_capacity_factor``), one :class:`MegatronLoopAdapter` (``loop``,
    default: a new one). ``ValueError`` when ``spec`` has no MoE layer, or when ``loop`` is
    given for a config without a static budget.

    ``config`` is a ``TransformerConfig`` (Megatron-Bridge's ``GPTModelProvider`` is one) or a
    model config that holds one as ``.transformer`` (Megatron-LM's and Bridge's
    ``GPTModelConfig``). ``spec`` may also be a function that builds a spec from such a config
    (``vp_stage`` optional), as a Bridge provider or a ``GPTModelConfig`` holds it: then the
    result is a function too, taking ``vp_stage`` where ``spec`` does, that builds the spec
    from the config it is given and replaces its MoE layers; its calls (one per virtual
    pipeline stage) share one stash manager and one adapter."""
    if _is_spec_builder(spec):
        return _te_paged_builder(spec, loop=loop, **kwargs)
    return _replace_moe(spec, _transformer_config(config), loop=loop, **kwargs)[0]


def _transformer_config(config: object) -> object:
    """The ``TransformerConfig`` of ``config``: itself, or its ``.transformer`` (a
    ``GPTModelConfig``)."""
    return getattr(config, "transformer", config)


def _is_spec_builder(spec: Any) -> bool:
    """A function of a config that returns a spec, not a spec: a plain function, or a
    ``functools.partial`` of one (a partial of a module class is a spec)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, (ModuleSpec, type)) or dataclasses.is_dataclass(spec):
        return False
    if isinstance(spec, functools.partial):
        return not isinstance(spec.func, type)
    return callable(spec)


def _te_paged_builder(builder: Any, **options: Any) -> Any:
    takes_vp_stage = "vp_stage" in inspect.signature(builder).parameters
    shared: dict[str, Any] = {}  # the first call's manager and adapter, for the later calls

    def build(config: object, vp_stage: int | None = None) -> Any:
        spec = builder(config, vp_stage=vp_stage) if takes_vp_stage else builder(config)
        out, replaced = _replace_moe(spec, _transformer_config(config), **{**options, **shared})
        if not shared:
            shared["manager"] = replaced[0].submodules.experts.params["manager"]
            if replaced[0].params.get("loop") is not None:
                shared["loop"] = replaced[0].params["loop"]
        return out

    def build_without_vp_stage(config: object) -> Any:
        return build(config)

    return build if takes_vp_stage else build_without_vp_stage


def _replace_moe(
    spec: Any, config: object, *, loop: MegatronLoopAdapter | None = None, **kwargs: object
) -> tuple[Any, list[Any]]:
    """``spec`` with its MoE layers replaced, and te_paged's MoE specs that replaced them."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    replaced: list[Any] = []

    def is_moe(module: object) -> bool:
        return isinstance(module, type) and issubclass(module, MoELayer)

    def te_paged(submodules: Any) -> Any:
        adapter = loop
        if replaced:  # every MoE layer stashes into the first one's manager, reports to its loop
            kwargs.setdefault("manager", replaced[0].submodules.experts.params["manager"])
            adapter = adapter or replaced[0].params.get("loop")
        shared = getattr(submodules, "shared_experts", None)
        # No loop is made here: the first layer's spec makes one where the config has a static
        # budget (without one, Megatron's own MoELayer is built and a loop= would be refused).
        moe = get_te_paged_moe_spec(config, shared_experts=shared, loop=adapter, **kwargs)
        for field in dataclasses.fields(moe.submodules):  # the router, say
            if field.name not in ("experts", "shared_experts") and hasattr(submodules, field.name):
                setattr(moe.submodules, field.name, getattr(submodules, field.name))
        replaced.append(moe)
        return moe

    def replace(node: Any) -> Any:
        if isinstance(node, ModuleSpec):
            if is_moe(node.module):
                return te_paged(node.submodules)
            node.submodules = replace(node.submodules)
            return node
        if isinstance(node, functools.partial):
            if is_moe(node.func):
                return te_paged(node.keywords.get("submodules"))
            keywords = {k: replace(v) for k, v in node.keywords.items()}
            return functools.partial(node.func, *node.args, **keywords)
        if isinstance(node, (list, tuple)):
            return type(node)(replace(n) for n in node)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for field in dataclasses.fields(node):
                setattr(node, field.name, replace(getattr(node, field.name)))
        return node

    out = replace(copy.deepcopy(spec))
    if not replaced:
        raise ValueError(
            "with_te_paged_moe: the spec has no MoE layer (Megatron's MoELayer) to replace: give "
            "the spec of a model with num_moe_experts set"
        )
    return out, replaced


def gpt_layer_spec(
    model_config: Any,
    vp_stage: int | None = None,
    *,
    loop: MegatronLoopAdapter | None = None,
    **kwargs: object,
) -> Any:
    """``GPTModelConfig.transformer_layer_spec`` for Megatron-LM's training loop (``--spec
    te_paged.integrations.megatron gpt_layer_spec``): the spec Megatron would build for this
    config (``megatron.training.models.gpt.default_layer_spec``: Transformer Engine or local
    layers as ``--transformer-impl`` says, the MoE layer frequency) with te_paged's MoE layers.
    Each call (one per virtual pipeline stage) makes its own stash manager and adapter, with
    the adapter's default options. ``--spec`` passes no options: to set them, a script puts
    ``functools.partial(gpt_layer_spec, loop=MegatronLoopAdapter(...))`` in
    ``model_config.transformer_layer_spec`` (one adapter for every chunk); ``kwargs`` go to
    :func:`with_te_paged_moe` (``manager``, te_paged overrides).

    ``model_config`` may also be a Megatron-Bridge ``GPTModelProvider`` (its own
    ``TransformerConfig``): ``provider.transformer_layer_spec = gpt_layer_spec``; the base spec
    is then the one Megatron-LM would build for the same fields (``transformer_impl="local"``
    for Megatron's own layers, as a CPU needs)."""
    from megatron.training.models.gpt import default_layer_spec

    if not hasattr(model_config, "transformer"):  # a Bridge provider: its own transformer
        model_config = _ProviderAsModelConfig(model_config)
    spec = default_layer_spec(model_config, vp_stage)
    return with_te_paged_moe(spec, model_config.transformer, loop=loop, **kwargs)


class _ProviderAsModelConfig:
    """A Megatron-Bridge provider seen as the ``GPTModelConfig`` Megatron-LM's
    ``default_layer_spec`` reads: ``.transformer`` is the provider, every other field (it has
    ``restore_modelopt_state``, ``use_transformer_engine_op_fuser``, ...) its own."""

    def __init__(self, provider: object) -> None:
        self.transformer = provider

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transformer, name)


def local_hybrid_stack_spec(num_experts: int = 8) -> Any:
    """Megatron's ``HybridStack`` spec with Megatron's local layers (no Transformer Engine):
    attention (``*``), dense MLP (``-``) and MoE (``E``) layers as in
    ``get_gpt_layer_local_spec``; the Mamba, GDN, DSA and MLA slots empty (``IdentityOp``).
    megatron-core 0.19.2 ships only Transformer Engine hybrid specs (``hybrid_layer_specs``),
    so this is what a ``HybridModel`` on CPU is built from (with the CPU shim
    ``hybrid_final_norm``: the stack's final norm is ``TENorm`` whatever the spec says).
    ``num_experts`` only selects the MoE submodules; the config sets the count."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        MoETransformerLayer,
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    dense = get_gpt_layer_local_submodules(num_experts=None)
    moe = get_gpt_layer_local_submodules(num_experts=num_experts, moe_grouped_gemm=False)
    bda = get_bias_dropout_add
    attention = TransformerLayerSubmodules(
        input_layernorm=dense.input_layernorm,
        self_attention=dense.self_attention,
        self_attn_bda=bda,
    )
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=IdentityOp,
            gdn_layer=IdentityOp,
            dsa_layer=IdentityOp,
            mla_layer=IdentityOp,
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=bda
                ),
            ),
            moe_layer=ModuleSpec(
                module=MoETransformerLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=bda
                ),
            ),
        ),
    )
