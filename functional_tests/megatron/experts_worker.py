"""Megatron-core's ``TEGroupedMLP`` vs te_paged's, expert module against expert module.

One process (``torchrun --nproc_per_node=1``, gloo, Megatron's parallel state at size 1). For
each case a Megatron ``TEGroupedMLP`` over te_paged's ``GroupedLinear`` (Megatron's own
activation code; te_paged's linears give the bits of Megatron's per-expert GEMMs on the CPU) and
te_paged's ``TEGroupedMLP`` get the same weights (loaded through the state dict), the same
input rows, token counts (an empty middle expert) and probabilities, and the same output
gradient. The worker writes, per case, whether the output, the input and probability gradients
and every parameter gradient are bitwise equal, and the largest difference.

With ``static_buffer`` te_paged's experts get the rows inside a larger static buffer (padding
rows after the real ones, as te_paged's dispatcher hands them over) with paged stash on, and
the real rows are compared (the padding rows' input gradient must be zero).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import faulthandler
import json
import sys
from pathlib import Path

import torch

from te_paged.integrations.megatron import cpu_shims as stubs

EXPERTS, HIDDEN, FFN = 4, 16, 24
TOKENS_PER_EXPERT = (5, 0, 7, 3)
ACTIVATIONS = ("silu", "gelu", "quick_gelu", "relu", "squared_relu")
#: ``torch.testing.assert_close``'s default tolerances.
CLOSE = {
    torch.float32: {"rtol": 1.3e-6, "atol": 1e-5},
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-5},
}
MAX_PADDING = 13  # rows after the real ones in the static-buffer cases
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Case:
    activation: str
    gated: bool
    dtype: str
    fusion: bool = False
    extra: str = ""  # gpt_oss, probs_on_input, bf16_probs, fused_squared_relu, ...

    @property
    def id(self) -> str:
        kind = "glu" if self.gated else "plain"
        parts = [self.activation, kind, self.dtype, "fused" if self.fusion else "unfused"]
        return "-".join(parts + ([self.extra] if self.extra else []))


CASES = [
    *(Case(a, g, d) for a in ACTIVATIONS for g in (True, False) for d in DTYPES),
    *(Case(a, True, d, fusion=True) for a in ("silu", "quick_gelu") for d in DTYPES),
    Case("quick_gelu", True, "bf16", extra="gpt_oss"),
    Case("silu", True, "bf16", extra="probs_on_input"),
    Case("squared_relu", False, "bf16", extra="bf16_probs"),
    *(Case("squared_relu", False, d, extra="fused_squared_relu") for d in DTYPES),
    Case("silu", True, "bf16", extra="recompute"),
    Case("gelu", True, "bf16", extra="static_buffer"),
    Case("relu", False, "fp32", extra="static_buffer"),
]


def megatron_config(case: Case):
    import torch.nn.functional as F
    from megatron.core.activations import squared_relu
    from megatron.core.fusions.fused_bias_geglu import quick_gelu  # the one Megatron checks for
    from megatron.core.transformer.transformer_config import TransformerConfig

    funcs = {
        "silu": F.silu, "gelu": F.gelu, "relu": F.relu,
        "quick_gelu": quick_gelu, "squared_relu": squared_relu,
    }  # fmt: skip
    kw: dict = {}
    if case.extra == "gpt_oss":
        kw = {"activation_func_clamp_value": 7.0, "glu_linear_offset": 1.0}
    if case.extra == "probs_on_input":  # Megatron allows it with top-1 routing only
        kw = {
            "moe_router_topk": 1,
            "moe_router_pre_softmax": True,
            "moe_apply_probs_on_input": True,
        }
    if case.extra == "fused_squared_relu":
        kw = {"use_fused_weighted_squared_relu": True, "add_bias_linear": False}
    if case.extra == "recompute":
        kw = {"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN,
        gated_linear_unit=case.gated,
        activation_func=funcs[case.activation],
        bias_activation_fusion=case.fusion,
        use_cpu_initialization=True,
        moe_grouped_gemm=True,
        params_dtype=DTYPES[case.dtype],
        bf16=case.dtype == "bf16",
        **{"moe_router_topk": 2, "add_bias_linear": True, **kw},
    )


def build(case: Case) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(Megatron's TEGroupedMLP over te_paged's linears, te_paged's TEGroupedMLP)``."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from te_paged.integrations import megatron as tpm

    config = megatron_config(case)
    torch.manual_seed(0)
    linears = MLPSubmodules(
        linear_fc1=tpm.MegatronGroupedLinear, linear_fc2=tpm.MegatronGroupedLinear
    )
    ref = TEGroupedMLP(
        EXPERTS, config, linears, pg_collection=ProcessGroupCollection.use_mpu_process_groups()
    )
    overrides = {}
    if case.extra == "static_buffer":
        overrides = {"moe_paged_stash": True, "moe_expert_rank_capacity_factor": 2.0,
                     # one layer, whose backward follows at once: page it anyway (the point)
                     "moe_paged_stash_skip_immediate_backward": False}  # fmt: skip
    ours = tpm.MegatronTEGroupedMLP(EXPERTS, config, overrides=overrides)
    tpm.load_megatron_expert_state_dict(ours, ref.state_dict())
    return ref, ours


def run(module: torch.nn.Module, case: Case, padding: int) -> dict[str, torch.Tensor]:
    """One forward and backward; the output and every gradient, on the real rows."""
    from te_paged.integrations.megatron import paged_stash_managers

    dtype = DTYPES[case.dtype]
    tokens = sum(TOKENS_PER_EXPERT)
    g = torch.Generator().manual_seed(7)  # the same draws whatever the padding
    x = torch.randn(tokens + MAX_PADDING, HIDDEN, generator=g).to(dtype)[: tokens + padding]
    probs = torch.rand(tokens + MAX_PADDING, generator=g)[: tokens + padding]
    dy = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    if case.extra == "bf16_probs":
        probs = probs.to(torch.bfloat16)
    x.requires_grad_()
    probs.requires_grad_()
    for p in module.parameters():
        p.grad = None
    managers = paged_stash_managers(module)
    for manager in managers:
        manager.reset()
    tokens_per_expert = torch.tensor(TOKENS_PER_EXPERT)
    rows = tokens + padding  # Megatron hands over the real rows only
    y, bias = module(x[:rows], tokens_per_expert, probs[:rows])
    assert bias is None
    (y[:tokens].float() * dy.float()).sum().backward()
    if padding:
        assert torch.count_nonzero(x.grad[tokens:]) == 0, "padding rows got a gradient"
        assert all(m.stats().stashes > 0 and not m.stats().overflow for m in managers)
    out = {"output": y[:tokens].detach(), "input_grad": x.grad[:tokens]}
    out["probs_grad"] = probs.grad[:tokens]
    for name, p in module.named_parameters():
        out[f"grad:{name}"] = p.grad
    return out


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, dict]:
    if set(ours) != set(ref):
        raise AssertionError(f"different tensors: {sorted(set(ours) ^ set(ref))}")
    result = {}
    for name, b in ref.items():
        a = ours[name]
        diff = (a.double() - b.double()).abs()
        result[name] = {
            "equal": torch.equal(a, b),
            "close": bool(torch.isclose(a, b, **CLOSE[a.dtype]).all()),
            "max_abs_diff": diff.max().item() if diff.numel() else 0.0,
            "max_rel_diff": (diff / b.double().abs().clamp_min(1e-30)).max().item()
            if diff.numel()
            else 0.0,
        }
    return result


def run_case(case: Case) -> dict:
    # Fresh compile caches, as in a training run with one configuration: torch.compile falls
    # back to eager (other bits) after 8 recompiles of a function, which 30 cases would reach.
    torch._dynamo.reset()
    ref, ours = build(case)
    padding = MAX_PADDING if case.extra == "static_buffer" else 0
    result = {"vs_megatron": compare(run(ours, case, padding), run(ref, case, 0))}
    # The check can fail: one FC2 weight element moved by one bf16 step of 1.0.
    with torch.no_grad():
        ours.linear_fc2.weight0[0, 0] += 2**-7
    result["perturbed_vs_megatron"] = compare(run(ours, case, padding), run(ref, case, 0))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the results' JSON file")
    parser.add_argument("--timeout-s", type=float, default=200.0, help="watchdog: exit after")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    stubs.install()
    # The shims turn torch.compile off (a CPU compile costs seconds); Megatron's activations
    # are compiled in a real run (``jit_fuser``), and their bits are the ones compared here.
    torch._dynamo.config.disable = False
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    parallel_state.initialize_model_parallel()
    try:
        results = {case.id: run_case(case) for case in CASES}
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    args.out.write_text(json.dumps(results, indent=1))
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
