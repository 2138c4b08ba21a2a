"""Worker of the Megatron MoE functional test: ``run_cases`` on every rank (gloo).

Run by ``test_megatron_moe.py`` through ``launch_workers.py`` (4 CPU ranks). For EP 1 and EP 4
(one process group setup each), both dropless dispatchers and ``moe_act`` recompute off/on, it
builds Megatron's ``MoELayer`` five ways from one set of weights and runs two steps of forward
and backward:

* ``sequential`` — the reference: Megatron's ``SequentialMLP`` experts;
* ``te_paged`` — te_paged's experts (:func:`get_te_paged_moe_spec`), paged stash off;
* ``te_paged_static`` — te_paged's experts behind te_paged's static-budget dispatcher
  (:class:`PagedStashMoELayer`, selected by the capacity factor), paged stash off;
* ``te_paged_stash`` — the same with paged stash on (step 0 captures, step 1 pages);
* ``grouped_linears`` — Megatron's own ``TEGroupedMLP`` over te_paged's ``GroupedLinear``;
* ``perturbed`` — ``te_paged`` with one expert weight element changed by 1e-2.

Each rank's results hold, per case and comparison, per tensor (output, input grad,
router weight grad, each expert weight grad in ``SequentialMLP`` naming), whether it is bitwise
equal to the other side and its largest absolute difference; plus the stash statistics and the
checkpoint round trip; and, per EP size, Megatron distributed checkpoints moved between
``SequentialMLP`` and te_paged's experts, and from EP 1 to EP 4.
"""

from __future__ import annotations

from pathlib import Path

import torch

SEQ, BATCH, HIDDEN, FFN, EXPERTS, TOPK = 8, 2, 16, 32, 8, 2
STEPS = 2
EPS = (1, 4)
DISPATCHERS = ("alltoall", "allgather")
# te_paged-only fields (megatron-core 0.16.1 has none of them). The capacity factor selects
# te_paged's static-budget dispatcher; 4.0 leaves room for any routing of these few tokens, so
# nothing is dropped (no runner here to rerun), and the pool gets 4x the balanced pages.
STATIC_OVERRIDES = {"moe_expert_rank_capacity_factor": 4.0}
STASH_OVERRIDES = {
    **STATIC_OVERRIDES,
    "moe_paged_stash": True,
    "moe_paged_stash_page_size": 8,
    "moe_paged_stash_buffer_size_factor_cuda": 4.0,
    # One MoE layer, whose backward follows its forward at once: the default would keep it
    # unpaged, and these tests are of the paging.
    "moe_paged_stash_skip_immediate_backward": False,
}
# fp32 on CPU. Differences come only from the order of float operations (see the test), each
# a few ulps of the compared value; 1e-5 relative is ~100 ulps of fp32 and 1e-6 absolute covers
# values that cancel to ~0. The perturbation (1e-2 on one weight) moves outputs by ~1e-3.
PERTURBATION = 1e-2


def case_id(ep: int, dispatcher: str, recompute: bool) -> str:
    return f"ep{ep}-{dispatcher}-{'moe_act_recompute' if recompute else 'no_recompute'}"


def megatron_config(ep: int, dispatcher: str, recompute: bool):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {}
    if recompute:  # Megatron allows moe_act recompute with grouped-GEMM experts only
        kw = {
            "recompute_granularity": "selective",
            "recompute_modules": ["moe_act"],
            "moe_grouped_gemm": True,
        }
    return TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        add_bias_linear=False,
        use_cpu_initialization=True,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=ep,
        moe_router_load_balancing_type="none",
        **kw,
    )


def build_layers(config) -> dict[str, torch.nn.Module]:
    """The five layers of the module docstring, all with the reference's weights."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    from te_paged.integrations import megatron as tpm

    reference_spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)

    def build(spec, config):
        # megatron-core 0.19.2's specs are builders (a partial, a callable ModuleSpec);
        # 0.16.1's are ModuleSpec data only build_module reads.
        return spec(config=config) if callable(spec) else build_module(spec, config=config)

    layers = {
        "sequential": build(reference_spec, config=config),
        "te_paged": build(tpm.get_te_paged_moe_spec(config), config=config),
        "te_paged_static": build(
            tpm.get_te_paged_moe_spec(config, **STATIC_OVERRIDES), config=config
        ),
        "te_paged_stash": build(
            tpm.get_te_paged_moe_spec(config, **STASH_OVERRIDES), config=config
        ),
        "grouped_linears": build(tpm.get_te_paged_linear_moe_spec(), config=config),
        "perturbed": build(tpm.get_te_paged_moe_spec(config), config=config),
    }
    reference = layers["sequential"].state_dict()
    for name, layer in layers.items():
        if name != "sequential":
            tpm.load_megatron_expert_state_dict(layer, reference)
    with torch.no_grad():
        layers["perturbed"].experts.linear_fc2.weight0[0, 0] += PERTURBATION
    return layers


def roundtrip_mismatches(layers: dict[str, torch.nn.Module]) -> list[str]:
    """Keys where te_paged's weights, written back in SequentialMLP layout, differ from the
    reference's (``_extra_state`` entries carry no weights)."""
    from te_paged.integrations.megatron import to_megatron_sequential_state_dict

    reference = {
        k: v for k, v in layers["sequential"].state_dict().items() if not k.endswith("_extra_state")
    }
    back = to_megatron_sequential_state_dict(layers["te_paged"])
    bad = sorted(set(reference) ^ set(back))
    bad += [k for k in reference if k in back and not torch.equal(reference[k], back[k])]
    return bad


def run_step(layer: torch.nn.Module, step: int, rank: int) -> dict[str, torch.Tensor]:
    """Forward and backward of one step; the output and every gradient, SequentialMLP names."""
    from te_paged.integrations.megatron import (
        grouped_to_sequential_state_dict,
        paged_stash_managers,
    )

    for manager in paged_stash_managers(layer):
        manager.reset()
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).requires_grad_()
    dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    out, bias = layer(x)
    assert bias is None
    (out * dy).sum().backward()
    grads = {"output": out.detach(), "input_grad": x.grad}
    for name, p in layer.named_parameters():
        grads[f"grad:{name}"] = p.grad
    layer.zero_grad(set_to_none=True)
    return grouped_to_sequential_state_dict(grads)


def compare(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, dict]:
    if set(ours) != set(ref):
        raise AssertionError(f"different tensors: {sorted(set(ours) ^ set(ref))}")
    result = {}
    for name, b in ref.items():
        a = ours[name]
        diff = (a - b).abs()
        result[name] = {
            "equal": torch.equal(a, b),
            "max_abs_diff": diff.max().item() if diff.numel() else 0.0,
        }
    return result


def run_case(ep: int, dispatcher: str, recompute: bool, rank: int) -> dict:
    from te_paged.integrations.megatron import paged_stash_managers

    torch.manual_seed(1234 + rank)
    layers = build_layers(megatron_config(ep, dispatcher, recompute))
    result: dict = {"roundtrip_mismatches": roundtrip_mismatches(layers), "steps": []}
    (manager,) = paged_stash_managers(layers["te_paged_stash"])
    for step in range(STEPS):
        outs = {name: run_step(layer, step, rank) for name, layer in layers.items()}
        stats = manager.stats()
        result["steps"].append(
            {
                "te_paged_vs_sequential": compare(outs["te_paged"], outs["sequential"]),
                "grouped_linears_vs_sequential": compare(
                    outs["grouped_linears"], outs["sequential"]
                ),
                "perturbed_vs_sequential": compare(outs["perturbed"], outs["sequential"]),
                "static_vs_sequential": compare(outs["te_paged_static"], outs["sequential"]),
                "stash_on_vs_off": compare(outs["te_paged_stash"], outs["te_paged_static"]),
                "static_layers": [
                    type(layers[n]).__name__ for n in ("te_paged", "te_paged_static")
                ],
                "dropped_tokens": [
                    int(layers[n].token_dispatcher.budget.dropped_tokens)
                    for n in ("te_paged_static", "te_paged_stash")
                ],
                "stash": {
                    "mode": stats.mode.name,
                    "stashes": stats.stashes,
                    "pops": stats.pops,
                    "overflow": stats.overflow,
                    "pages_high_water": sum(stats.pages_high_water.values()),
                    "capture_keys": sorted(stats.capture_peak_rows),
                },
            }
        )
    return result


def _experts_only(state_dict: dict) -> dict[str, torch.Tensor]:
    """The expert weights of a ``SequentialMLP``-layout state dict (``_extra_state`` aside)."""
    return {k: v for k, v in state_dict.items() if "local_experts" in k and "_extra_state" not in k}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def dist_checkpoint_case(ep: int, rank: int, root: Path) -> dict:
    """Megatron ``dist_checkpointing`` between ``SequentialMLP``, te_paged's experts and
    Megatron's ``TEGroupedMLP`` over te_paged's linears, at this EP size; at EP > 1 also loads
    the EP-1 checkpoint of the first phase."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module

    from te_paged.integrations import megatron as tpm

    config = megatron_config(ep, "alltoall", False)

    def build(kind: str, seed: int) -> torch.nn.Module:
        # Every layer starts different; replicas of the same experts (expert-data-parallel
        # ranks, all 4 at EP 1) the same, as in training: the checkpoint keeps one of them.
        torch.manual_seed(seed + parallel_state.get_expert_model_parallel_rank())
        if kind == "sequential":
            spec = get_moe_module_spec(use_te=False, num_experts=EXPERTS, moe_grouped_gemm=False)
        elif kind == "grouped_linears":  # Megatron's TEGroupedMLP over te_paged's linears
            spec = tpm.get_te_paged_linear_moe_spec()
        else:
            spec = tpm.get_te_paged_moe_spec(config)
        return spec(config=config) if callable(spec) else build_module(spec, config=config)

    def experts(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
        return _experts_only(tpm.to_megatron_sequential_state_dict(layer))

    def save(layer: torch.nn.Module, name: str) -> Path:
        path = root / f"{name}-ep{ep}"
        if rank == 0:
            path.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(layer.sharded_state_dict(), str(path))
        return path

    def load(layer: torch.nn.Module, path: Path) -> str:
        loaded = dist_checkpointing.load(layer.sharded_state_dict(), str(path))
        return str(layer.load_state_dict(loaded, strict=True))

    def layout(layer: torch.nn.Module, singleton: bool) -> list:
        """What the checkpoint stores for the experts: (key, offset, replica id) of each."""
        metadata = {"singleton_local_shards": singleton}
        sd = layer.sharded_state_dict(metadata=metadata)
        return sorted(
            (v.key, str(getattr(v, "global_offset", None)), str(v.replica_id))
            for k, v in sd.items()
            if k.startswith("experts.")
        )

    result: dict = {}
    reference, ours = build("sequential", 100), build("te_paged", 200)
    grouped = build("grouped_linears", 600)
    result["same_layout"] = [
        layout(reference, singleton) == layout(other, singleton)
        for other in (ours, grouped)
        for singleton in (False, True)
    ]
    result["differs_before"] = not _same(experts(ours), _experts_only(reference.state_dict()))
    result["load_seq_into_te_paged"] = load(ours, save(reference, "sequential"))
    result["seq_to_te_paged"] = _same(experts(ours), _experts_only(reference.state_dict()))
    saved, back = build("te_paged", 300), build("sequential", 400)
    result["load_te_paged_into_seq"] = load(back, save(saved, "te_paged"))
    result["te_paged_to_seq"] = _same(_experts_only(back.state_dict()), experts(saved))
    result["load_seq_into_grouped_linears"] = load(grouped, root / f"sequential-ep{ep}")
    result["seq_to_grouped_linears"] = _same(
        experts(grouped), _experts_only(reference.state_dict())
    )
    grouped, ours = build("grouped_linears", 700), build("te_paged", 800)
    result["load_grouped_linears_into_te_paged"] = load(ours, save(grouped, "grouped_linears"))
    result["grouped_linears_to_te_paged"] = _same(experts(ours), experts(grouped))
    if ep == 1:
        if rank == 0:
            torch.save(_experts_only(reference.state_dict()), root / "ep1-experts.pt")
    else:
        resharded = build("te_paged", 500)
        result["load_ep1_into_te_paged"] = load(resharded, root / "sequential-ep1")
        whole = torch.load(root / "ep1-experts.pt")
        per_rank = EXPERTS // ep
        mine = {}
        for local in range(per_rank):
            for k, v in whole.items():
                prefix = f"experts.local_experts.{rank * per_rank + local}."
                if k.startswith(prefix):
                    mine[f"experts.local_experts.{local}.{k[len(prefix) :]}"] = v
        result["ep1_to_te_paged"] = _same(experts(resharded), mine)
    dist.barrier()
    return result


def run_cases(rank: int, world: int, out: Path) -> dict:
    from te_paged.tools.megatron_ab import megatron_parallel

    results = {}
    for ep in EPS:
        with megatron_parallel(ep):
            for dispatcher in DISPATCHERS:
                for recompute in (False, True):
                    results[case_id(ep, dispatcher, recompute)] = run_case(
                        ep, dispatcher, recompute, rank
                    )
            results[f"dist_checkpoint-ep{ep}"] = dist_checkpoint_case(
                ep, rank, out / "dist_checkpoint"
            )
    return results
