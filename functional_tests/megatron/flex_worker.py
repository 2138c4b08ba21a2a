"""Worker of the Megatron flex-dispatcher test: te_paged's experts behind Megatron's HybridEP and
NCCL EP dispatchers.

Run by ``test_megatron_flex.py`` on 4 CPU ranks (gloo, megatron-core 0.19.2) in a launch that
installs the HybridEP stand-in first (``functional_tests/stand_ins/deep_ep.py``) and the NCCL EP
stand-in after it (``functional_tests/stand_ins/te_ep.py``), so Megatron's
``MoEFlexTokenDispatcher`` with ``moe_flex_dispatcher_backend`` ``"hybridep"`` and ``"ncclep"``
runs.

* ``layers`` (EP 4, two steps): Megatron's ``MoELayer`` behind the HybridEP dispatcher with
  Megatron's ``SequentialMLP`` (the reference, dropless: it splits the rows by host counts that
  must add up to the buffer, so it cannot take a static budget; Megatron's ``TEGroupedMLP``
  takes the op fuser's fused path, which 0.19.2 asks for beside HybridEP's budget and which
  needs Transformer Engine), with te_paged's experts on HybridEP's static budget (paged stash
  off and on), and te_paged's experts behind te_paged's own dispatcher (built while no flex
  backend is kept: :func:`own_dispatcher`); output, input grad, router grad and every expert
  weight grad of each, and what
  the stand-in was asked (``num_permuted_tokens``: the static budget, so no host wait).
* ``training``: Megatron's ``GPTModel`` with HybridEP under te_paged's
  ``MegatronPagedStashRunner`` (and Megatron's own ``PagedStashRunner``): paged stash ON vs
  OFF; rank 0's routing skewed past a 1.5 factor (HybridEP drops rows past its budget and
  sets its flag) vs a run that never goes over budget; the same with te_paged's own
  dispatcher.
* ``ncclep_layers`` and ``ncclep_training``: the same for NCCL EP, whose reference is Megatron's
  ``SequentialMLP`` behind NCCL EP itself (megatron-core's manager narrows the buffer to the
  counts with a host read, so that it can run; te_paged bootstrapped NCCL EP first, so
  Megatron's manager finds it and skips its own bootstrap, which Transformer Engine 2.19 would
  refuse), and the bootstraps te_paged made (capacity, drop) at each step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from functional_tests.megatron import worker

STEPS = 2
FACTOR = 4.0  # no routing of these few tokens goes over it: nothing is dropped


@contextlib.contextmanager
def own_dispatcher():
    """te_paged's own dispatcher whatever the backend: no flex backend kept while building."""
    from te_paged.integrations.megatron import flex

    kept = flex.KEPT_BACKENDS
    flex.KEPT_BACKENDS = ()
    try:
        yield
    finally:
        flex.KEPT_BACKENDS = kept


def flex_config(backend: str = "hybridep", factor: float | None = FACTOR,
                op_fuser: bool | None = None):  # fmt: skip
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
        use_transformer_engine_op_fuser=factor is not None if op_fuser is None else op_fuser,
        expert_model_parallel_size=4,
        moe_router_load_balancing_type="none",
    )


def build_layers(config, dropless_config) -> dict[str, torch.nn.Module]:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from te_paged.integrations import megatron as tpm

    reference_spec = get_moe_module_spec(
        use_te=False, num_experts=worker.EXPERTS, moe_grouped_gemm=False
    )
    # te_paged's layers first: the first dispatch of a step is theirs (NCCL EP's bootstrap).
    layers = {
        "te_paged": tpm.get_te_paged_moe_spec(config)(config=config),
        "te_paged_stash": tpm.get_te_paged_moe_spec(
            config, moe_paged_stash=True, moe_paged_stash_page_size=8,
            moe_paged_stash_buffer_size_factor_cuda=4.0,
            moe_paged_stash_skip_immediate_backward=False,  # one layer: page it (the point)
        )(config=config),
    }  # fmt: skip
    with own_dispatcher():
        layers["te_paged_own"] = tpm.get_te_paged_moe_spec(config)(config=config)
    layers["sequential"] = reference_spec(config=dropless_config)
    reference = layers["sequential"].state_dict()
    for name, layer in layers.items():
        if name != "sequential":
            tpm.load_megatron_expert_state_dict(layer, reference)
    return layers


def layer_cases(rank: int, backend: str = "hybridep") -> dict:
    from megatron.core.transformer.moe import fused_a2a

    from functional_tests.stand_ins import te_ep
    from te_paged.integrations.megatron import paged_stash_managers

    torch.manual_seed(1234 + rank)
    if backend == "ncclep":  # no op fuser: Megatron's manager narrows to the counts for
        config = flex_config("ncclep", op_fuser=False)  # SequentialMLP, alignment 0
        layers = build_layers(config, config)
    else:
        layers = build_layers(flex_config(), flex_config(factor=None))
    result: dict = {
        "dispatchers": {n: type(layer.token_dispatcher).__name__ for n, layer in layers.items()},
        "steps": [],
    }
    (manager,) = paged_stash_managers(layers["te_paged_stash"])
    for step in range(STEPS):
        fused_a2a._hybrid_ep_buffer is None or fused_a2a._hybrid_ep_buffer.calls.clear()
        bootstraps = len(te_ep.bootstraps)
        outs = {name: worker.run_step(layer, step, rank) for name, layer in layers.items()}
        buffer = fused_a2a._hybrid_ep_buffer
        budget = layers["te_paged"].token_dispatcher.budget
        stats = manager.stats()
        result["steps"].append(
            {
                "te_paged_vs_sequential": worker.compare(outs["te_paged"], outs["sequential"]),
                "stash_on_vs_off": worker.compare(outs["te_paged_stash"], outs["te_paged"]),
                "flex_vs_own_dispatcher": worker.compare(outs["te_paged"], outs["te_paged_own"]),
                "hybridep_calls": [] if buffer is None else list(buffer.calls),
                "nccl_ep_bootstraps": te_ep.bootstraps[bootstraps:],
                "budget_tokens": budget.budget_tokens,
                "over_budget": int(budget.over_budget),
                "peak_tokens": int(budget.peak_tokens),
                "a2a_capacity_factor": budget.a2a_capacity_factor,
                "stash": {"mode": stats.mode.name, "stashes": stats.stashes, "pops": stats.pops},
            }
        )
    return result


def training_cases(rank: int, backend: str = "hybridep") -> dict:
    from functional_tests.megatron.train_worker import NEVER_OVERFLOWS, PARITY, config, summary
    from functional_tests.stand_ins import te_ep
    from te_paged.tools.megatron_ab import train

    cpu = torch.device("cpu")
    # 0.19.2 asks for the op fuser beside HybridEP's budget; NCCL EP's runs keep alignment 0.
    flex = {"flex_backend": backend, "op_fuser": backend == "hybridep"}
    # 128 tokens a rank, top-2: the op fuser's 256-row alignment makes a factor-1.0 budget
    # exactly the balanced 256 rows, which rank 0's skewed routing overruns.
    skew = {"skew": 2.0, "seq_length": 64}
    out: dict = {}
    cfg = config(**flex, **PARITY)
    out["parity"] = summary(train(cfg, True, 4, cpu, rank), train(cfg, False, 4, cpu, rank))
    reference = train(config(**flex, **skew, **NEVER_OVERFLOWS), True, 4, cpu, rank)
    out["reference"] = summary(reference)
    # A pool with room (8x): what is tested is the receive budget, not the pool's sizing.
    scenario = config(**flex, **skew, capacity_factor=1.0, buffer_factor_cuda=8.0)
    for name, cfg in (
        ("over_budget", scenario),  # the runner raises the receive budget after the rerun
        ("over_budget_megatron_runner", dataclasses.replace(scenario, runner="megatron")),
        ("over_budget_fixed", dataclasses.replace(scenario, grow_capacity=False)),
    ):
        bootstraps = len(te_ep.bootstraps)
        run = train(cfg, True, 4, cpu, rank)
        out[name] = summary(run, reference)
        out[name]["capacity_growth"] = [s.record["capacity_growth"] for s in run.steps]
        out[name]["nccl_ep_bootstraps"] = te_ep.bootstraps[bootstraps:]
    with own_dispatcher():  # te_paged's dispatcher
        own = train(config(**flex, **skew, **NEVER_OVERFLOWS), True, 4, cpu, rank)
    out["own_dispatcher"] = summary(own, reference)
    return out


def run_cases(rank: int, world: int, out: Path) -> dict:
    from megatron.core.transformer.moe import fused_a2a

    from te_paged.tools.megatron_ab import megatron_parallel

    results: dict = {"have_hybridep": bool(fused_a2a.HAVE_HYBRIDEP),
                     "have_nccl_ep": bool(fused_a2a.HAVE_TE_EP)}  # fmt: skip
    with megatron_parallel(4):
        results["layers"] = layer_cases(rank)
        results["training"] = training_cases(rank)
        results["ncclep_layers"] = layer_cases(rank, "ncclep")
        results["ncclep_training"] = training_cases(rank, "ncclep")
    return results
