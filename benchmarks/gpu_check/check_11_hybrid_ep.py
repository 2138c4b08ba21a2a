"""Check 11: te_paged's experts behind Megatron's HybridEP dispatcher, with the real
``deep_ep``."""

from __future__ import annotations

import tempfile

import torch

from .common import RUN, TargetMissed, Unavailable, same

NAME = "te_paged's experts behind Megatron's HybridEP dispatcher (real deep_ep, one rank)"
TARGET = (
    "te_paged keeps the dispatcher; bitwise equal to te_paged's own dispatcher; an overrun "
    "budget sets the flag the runner reads"
)


def run() -> str:
    """Where DeepEP's HybridEP imports (``deep_ep.HybridEPBuffer``): megatron-core 0.19.2's
    ``MoELayer`` from te_paged's spec with ``moe_flex_dispatcher_backend="hybridep"`` keeps
    Megatron's flex dispatcher (``FlexTokenDispatcher``); one step's output and input gradient
    equal those of te_paged's own dispatcher with the same weights, and a budget below the
    routing sets the over-budget counter. On CPU the same runs against a stand-in
    (functional_tests/megatron/test_megatron_flex.py, 4 ranks)."""
    try:
        from deep_ep import HybridEPBuffer  # noqa: F401
        from megatron.core.transformer.moe import fused_a2a
    except ImportError as e:
        raise Unavailable(f"deep_ep's HybridEP or megatron-core is not importable ({e})") from e
    if not fused_a2a.HAVE_HYBRIDEP:
        raise Unavailable("megatron-core did not find HybridEP (fused_a2a.HAVE_HYBRIDEP)")
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from te_paged.integrations import megatron as tpm

    dev = RUN.device
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0,
                                world_size=1)  # fmt: skip
    parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
    try:

        def build(factor: float, backend: str):
            cfg = TransformerConfig(
                num_layers=1, hidden_size=1024, num_attention_heads=8, num_moe_experts=8,
                moe_router_topk=2, moe_ffn_hidden_size=2048, ffn_hidden_size=2048,
                gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True,
                add_bias_linear=False, moe_grouped_gemm=True, moe_token_dispatcher_type="flex",
                moe_flex_dispatcher_backend="hybridep", moe_expert_rank_capacity_factor=factor,
                moe_router_dtype="fp32", use_transformer_engine_op_fuser=True,
                moe_router_load_balancing_type="none", params_dtype=torch.bfloat16, bf16=True,
            )  # fmt: skip
            if backend != "hybridep":
                cfg = copy.copy(cfg)
                cfg.moe_flex_dispatcher_backend = backend  # te_paged's own dispatcher
            torch.manual_seed(0)
            return tpm.get_te_paged_moe_spec(cfg)(config=cfg).to(dev)

        def step(layer):
            g = torch.Generator(device=dev).manual_seed(1)
            x = torch.randn(512, 2, 1024, device=dev, generator=g, dtype=torch.bfloat16)
            x.requires_grad_()
            out, _ = layer(x)
            out.float().sum().backward()
            return out.detach(), x.grad

        flex, own = build(2.0, "hybridep"), build(2.0, "ncclep")
        own.load_state_dict(flex.state_dict())
        kind = type(flex.token_dispatcher).__name__
        if kind != "FlexTokenDispatcher":
            raise AssertionError(f"te_paged's layer built {kind}, not FlexTokenDispatcher")
        (out_a, grad_a), (out_b, grad_b) = step(flex), step(own)
        equal = same(out_a, out_b) and same(grad_a, grad_b)
        tight = build(0.3, "hybridep")
        step(tight)
        flagged = int(tight.token_dispatcher.budget.over_budget)
        detail = f"{kind}; bitwise vs own dispatcher: {equal}; over-budget flag at 0.3: {flagged}"
        if not equal or not flagged:
            raise TargetMissed(detail)
        return detail
    finally:
        parallel_state.destroy_model_parallel()
