"""Worker of the Megatron flex-dispatcher test: te_paged's experts behind Megatron's HybridEP.

Run by ``test_megatron_flex.py`` on 4 CPU ranks (gloo, megatron-core 0.19.2) in a launch that
installs the HybridEP stand-in first (``functional_tests/stand_ins/deep_ep.py``), so Megatron's
``MoEFlexTokenDispatcher`` with ``moe_flex_dispatcher_backend="hybridep"`` runs.

* ``layers`` (EP 4, two steps): Megatron's ``MoELayer`` behind the HybridEP dispatcher with
  Megatron's ``SequentialMLP`` (the reference, dropless: it splits the rows by host counts that
  must add up to the buffer, so it cannot take a static budget; Megatron's ``TEGroupedMLP``
  takes the op fuser's fused path, which 0.19.2 asks for beside HybridEP's budget and which
  needs Transformer Engine), with te_paged's experts on HybridEP's static budget (paged stash
  off and on), and te_paged's experts
  behind te_paged's own dispatcher (a copy of the config naming ``ncclep``, which te_paged
  replaces); output, input grad, router grad and every expert weight grad of each, and what
  the stand-in was asked (``num_permuted_tokens``: the static budget, so no host wait).
* ``training``: Megatron's ``GPTModel`` with HybridEP under te_paged's
  ``MegatronPagedStashRunner`` (and Megatron's own ``PagedStashRunner``): paged stash ON vs
  OFF; rank 0's routing skewed past a 1.5 factor (HybridEP drops rows past its budget and
  sets its flag) vs a run that never goes over budget; the same with te_paged's own
  dispatcher.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from functional_tests.megatron import worker

STEPS = 2
FACTOR = 4.0  # no routing of these few tokens goes over it: nothing is dropped


def flex_config(backend: str = "hybridep", factor: float | None = FACTOR):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=worker.HIDDEN,
        num_attention_heads=1,
        num_moe_experts=worker.EXPERTS,
        moe_router_topk=worker.TOPK,
        moe_ffn_hidden_size=worker.FFN,
        ffn_hidden_size=worker.FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        moe_grouped_gemm=True,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend=backend,
        moe_expert_rank_capacity_factor=factor,
        moe_router_dtype="fp32",  # HybridEP's probabilities are float32
        # 0.19.2 asks for the op fuser beside HybridEP's budget
        use_transformer_engine_op_fuser=factor is not None,
        expert_model_parallel_size=4,
        moe_router_load_balancing_type="none",
    )


def build_layers(config, dropless_config) -> dict[str, torch.nn.Module]:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from te_paged.integrations import megatron as tpm

    own = copy.copy(config)  # names a backend te_paged does not keep: its own dispatcher
    own.moe_flex_dispatcher_backend = "ncclep"
    reference_spec = get_moe_module_spec(
        use_te=False, num_experts=worker.EXPERTS, moe_grouped_gemm=False
    )
    layers = {
        "sequential": reference_spec(config=dropless_config),
        "te_paged": tpm.get_te_paged_moe_spec(config)(config=config),
        "te_paged_stash": tpm.get_te_paged_moe_spec(
            config, moe_paged_stash=True, moe_paged_stash_page_size=8,
            moe_paged_stash_buffer_size_factor_cuda=4.0,
        )(config=config),
        "te_paged_own": tpm.get_te_paged_moe_spec(own)(config=own),
    }  # fmt: skip
    reference = layers["sequential"].state_dict()
    for name, layer in layers.items():
        if name != "sequential":
            tpm.load_megatron_expert_state_dict(layer, reference)
    return layers


def layer_cases(rank: int) -> dict:
    from megatron.core.transformer.moe import fused_a2a

    from te_paged.integrations.megatron import paged_stash_managers

    torch.manual_seed(1234 + rank)
    layers = build_layers(flex_config(), flex_config(factor=None))
    result: dict = {
        "dispatchers": {n: type(layer.token_dispatcher).__name__ for n, layer in layers.items()},
        "steps": [],
    }
    (manager,) = paged_stash_managers(layers["te_paged_stash"])
    for step in range(STEPS):
        fused_a2a._hybrid_ep_buffer is None or fused_a2a._hybrid_ep_buffer.calls.clear()
        outs = {name: worker.run_step(layer, step, rank) for name, layer in layers.items()}
        calls = list(fused_a2a._hybrid_ep_buffer.calls)
        budget = layers["te_paged"].token_dispatcher.budget
        stats = manager.stats()
        result["steps"].append(
            {
                "te_paged_vs_sequential": worker.compare(outs["te_paged"], outs["sequential"]),
                "stash_on_vs_off": worker.compare(outs["te_paged_stash"], outs["te_paged"]),
                "hybridep_vs_own_dispatcher": worker.compare(
                    outs["te_paged"], outs["te_paged_own"]
                ),
                "hybridep_calls": calls,
                "budget_tokens": budget.budget_tokens,
                "over_budget": int(budget.over_budget),
                "peak_tokens": int(budget.peak_tokens),
                "a2a_capacity_factor": budget.a2a_capacity_factor,
                "stash": {"mode": stats.mode.name, "stashes": stats.stashes, "pops": stats.pops},
            }
        )
    return result


def training_cases(rank: int) -> dict:
    from functional_tests.megatron.train_worker import NEVER_OVERFLOWS, PARITY, config, summary
    from te_paged.tools.megatron_ab import train

    cpu = torch.device("cpu")
    hybridep = {"flex_backend": "hybridep", "op_fuser": True}  # 0.19.2 asks for the op fuser
    # 128 tokens a rank, top-2: the op fuser's 256-row alignment makes a factor-1.0 budget
    # exactly the balanced 256 rows, which rank 0's skewed routing overruns.
    skew = {"skew": 2.0, "seq_length": 64}
    out: dict = {}
    cfg = config(**hybridep, **PARITY)
    out["parity"] = summary(train(cfg, True, 4, cpu, rank), train(cfg, False, 4, cpu, rank))
    reference = train(config(**hybridep, **skew, **NEVER_OVERFLOWS), True, 4, cpu, rank)
    out["reference"] = summary(reference)
    # A pool with room (8x): what is tested is the receive budget, not the pool's sizing.
    scenario = config(**hybridep, **skew, capacity_factor=1.0, buffer_factor_cuda=8.0)
    for name, cfg in (
        ("over_budget", scenario),  # the runner raises the receive budget after the rerun
        ("over_budget_megatron_runner", dataclasses.replace(scenario, runner="megatron")),
        ("over_budget_fixed", dataclasses.replace(scenario, grow_capacity=False)),
    ):
        run = train(cfg, True, 4, cpu, rank)
        out[name] = summary(run, reference)
        out[name]["capacity_growth"] = [s.record["capacity_growth"] for s in run.steps]
    own = train(config(**skew, **NEVER_OVERFLOWS), True, 4, cpu, rank)  # te_paged's dispatcher
    out["own_dispatcher"] = summary(own, reference)
    return out


def run_cases(rank: int, world: int, out: Path) -> dict:
    from megatron.core.transformer.moe import fused_a2a

    from te_paged.tools.megatron_ab import megatron_parallel

    results: dict = {"have_hybridep": bool(fused_a2a.HAVE_HYBRIDEP)}
    with megatron_parallel(4):
        results["layers"] = layer_cases(rank)
        results["training"] = training_cases(rank)
    return results
