"""The Megatron training-step pieces in one process: the static-budget token dispatcher, the
spec builder's choice of layer, the runner's argument handling and the CPU shims' guards.
(The multi-rank behaviour is in functional_tests/megatron/test_megatron_train.py.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from te_paged import MoEConfig, PagedStashManager, StaticBudgetDispatcher, TEGroupedMLP
from te_paged.integrations import megatron as tpm
from te_paged.integrations.megatron.dispatcher import hybrid_ep_rank_budget, topk_from_routing_map
from te_paged.integrations.megatron.runner import _prefetch

from .test_megatron_adapters import megatron_config

H, E, K = 16, 4, 2


@pytest.mark.parametrize(
    ("tokens", "topk", "factor", "align", "ep", "rows"),
    [
        (2048, 8, 1.1, 16, 4, 18032),  # int(18022.4) = 18022 -> 18032 (multiple of 16)
        (100, 2, 1.1, 16, 1, 224),  # 220.00000000000003 truncates to 220 -> 224
        (100, 2, 1.1, 16, 3, 240),  # 224 is not a multiple of 3: lcm(16, 3) = 48 -> 240
        (100, 2, 1.1, 32, 4, 224),  # MXFP8 alignment
        (64, 2, 2.0, 16, 4, 256),  # already aligned
    ],
)
def test_budget_follows_megatron_hybrid_ep(tokens, topk, factor, align, ep, rows) -> None:
    assert hybrid_ep_rank_budget(topk, align, ep)(tokens, factor) == rows


def test_topk_from_routing_map_in_expert_order_with_differentiable_probs() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(12, 8, generator=g)
    top = scores.topk(3, dim=1).indices
    routing = torch.zeros(12, 8, dtype=torch.bool).scatter_(1, top, True)
    probs_NE = (scores * routing).requires_grad_()
    probs_NK, idx_NK = topk_from_routing_map(routing, probs_NE, 3)
    assert torch.equal(idx_NK, top.sort(dim=1).values)
    assert torch.equal(probs_NK, probs_NE.gather(1, idx_NK))
    probs_NK.sum().backward()
    assert torch.equal(probs_NE.grad, routing.float())
    # A token routed to fewer than K experts (a padding token): no-expert fillers (-1).
    short = torch.zeros(1, 8, dtype=torch.bool)
    short[0, 5] = True
    p, i = topk_from_routing_map(short, torch.full((1, 8), 0.5), 3)
    assert i.tolist() == [[5, -1, -1]] and p.tolist() == [[0.5, 0.0, 0.0]]


def _moe_config(**kw) -> MoEConfig:
    base = dict(hidden_size=H, moe_ffn_hidden_size=32, num_moe_experts=E, moe_router_topk=K)
    return MoEConfig(**{**base, "moe_expert_rank_capacity_factor": 2.0, **kw})


def test_token_dispatcher_is_megatrons_six_calls_over_the_static_budget() -> None:
    cfg = _moe_config()
    d = tpm.StaticBudgetTokenDispatcher(cfg, None, align=16)
    g = torch.Generator().manual_seed(1)
    x_SBH = torch.randn(5, 2, H, generator=g)
    scores = torch.rand(10, E, generator=g)
    routing = torch.zeros(10, E, dtype=torch.bool).scatter_(1, scores.topk(K, 1).indices, True)
    probs = scores * routing
    x_NH, packed = d.dispatch_preprocess(x_SBH, routing, probs)
    permuted, probs_T = d.token_dispatch(x_NH, packed)
    permuted, tokens_per_expert, probs_T = d.dispatch_postprocess(permuted, probs_T)
    assert permuted.shape == (48, H)  # int(10 x 2 x 2.0) = 40 -> 48 (alignment 16)
    assert d.budget.budget_tokens == 48 and int(tokens_per_expert.sum()) == 20
    # The same as te_paged's dispatcher on the top-k view of the routing map.
    ref = StaticBudgetDispatcher(cfg, rank_budget=hybrid_ep_rank_budget(K, 16, 1))
    ref_rows, ref_counts, ref_probs, handle = ref.dispatch(x_NH, *packed)
    assert torch.equal(permuted, ref_rows) and torch.equal(tokens_per_expert, ref_counts)
    assert torch.equal(probs_T, ref_probs)
    out = d.combine_postprocess(d.token_combine(d.combine_preprocess(permuted * 2)))
    assert out.shape == x_SBH.shape
    assert torch.equal(out.reshape(10, H), ref.combine(ref_rows * 2, handle))
    with pytest.raises(RuntimeError, match="token_combine without a token_dispatch"):
        d.token_combine(permuted)


def test_token_dispatcher_needs_a_capacity_factor_and_no_shared_expert_overlap() -> None:
    with pytest.raises(ValueError, match="needs moe_expert_rank_capacity_factor"):
        tpm.StaticBudgetTokenDispatcher(_moe_config(moe_expert_rank_capacity_factor=None), None,
                                        align=16)  # fmt: skip
    d = tpm.StaticBudgetTokenDispatcher(_moe_config(), None, align=16)
    with pytest.raises(ValueError, match="moe_shared_expert_overlap=False"):
        d.set_shared_experts(object())


def test_spec_builder_picks_the_static_budget_layer_for_a_capacity_factor() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    cfg = megatron_config(num_moe_experts=E)
    assert tpm.get_te_paged_moe_spec(cfg).module is MoELayer
    spec = tpm.get_te_paged_moe_spec(cfg, moe_expert_rank_capacity_factor=2.0)
    assert spec.module is tpm.PagedStashMoELayer and issubclass(spec.module, MoELayer)
    loop = spec.params.pop("loop")  # one adapter for the layers of this spec
    assert isinstance(loop, tpm.MegatronLoopAdapter) and loop.layers == []
    assert spec.params == {"overrides": {"moe_expert_rank_capacity_factor": 2.0}}
    given = tpm.MegatronLoopAdapter(grow_pool=False)
    spec = tpm.get_te_paged_moe_spec(cfg, moe_expert_rank_capacity_factor=2.0, loop=given)
    assert spec.params["loop"] is given
    with pytest.raises(ValueError, match="no moe_expert_rank_capacity_factor"):
        tpm.get_te_paged_moe_spec(cfg, loop=given)  # Megatron's own layer: no adapter
    with pytest.raises(TypeError, match="MegatronLoopAdapter"):
        tpm.get_te_paged_moe_spec(cfg, moe_expert_rank_capacity_factor=2.0, loop=object())


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("moe_expert_capacity_factor", 1.0, "replaces Megatron's per-expert capacity"),
        ("moe_pad_expert_input_to_capacity", True, "moe_pad_expert_input_to_capacity=True"),
        ("moe_shared_expert_overlap", True, "shared experts still run"),
    ],
)
def test_spec_builder_rejects_what_the_static_budget_cannot_honour(field, value, fix) -> None:
    cfg = megatron_config(num_moe_experts=E, **{field: value})
    with pytest.raises(ValueError, match=fix):
        tpm.get_te_paged_moe_spec(cfg, moe_expert_rank_capacity_factor=2.0)


def test_megatron_runner_arguments() -> None:
    cfg = _moe_config(moe_paged_stash=True)
    model = nn.ModuleList([TEGroupedMLP(2, cfg, manager=PagedStashManager.from_config(cfg))])
    runner = tpm.MegatronPagedStashRunner([model], config=types.SimpleNamespace())
    assert runner.managers == [model[0].manager] and runner.dispatchers == []
    with pytest.raises(TypeError, match="missing \\['num_microbatches'\\]"):
        runner(forward_step_func=None, data_iterator=iter([]), model=[model])
    with pytest.raises(ValueError, match="ran out after 1 of 2 microbatches"):
        _prefetch(iter([1]), 2)
    items, is_list = _prefetch([iter([1, 2, 3]), None], 2)
    assert is_list and items == [[1, 2], None]
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        runner.step(lambda: None, step=-1)


def test_megatron_runner_refuses_a_wrong_call_naming_the_users_argument() -> None:
    cfg = _moe_config(moe_paged_stash=True)
    model = nn.ModuleList([TEGroupedMLP(2, cfg, manager=PagedStashManager.from_config(cfg))])
    runner = tpm.MegatronPagedStashRunner([model], config=types.SimpleNamespace())
    call = {"forward_step_func": None, "data_iterator": iter([]), "model": [model]}
    with pytest.raises(ValueError, match=r"num_microbatches must be an int >= 1, got 0"):
        runner(**call, num_microbatches=0)
    with pytest.raises(ValueError, match=r"iteration must be a non-negative int, got -1"):
        runner(**call, num_microbatches=1, iteration=-1)
    other = nn.ModuleList([TEGroupedMLP(2, cfg, manager=PagedStashManager.from_config(cfg))])
    with pytest.raises(ValueError, match="model= is not the model this MegatronPagedStashRunner"):
        runner(**{**call, "model": [other]}, num_microbatches=1)
    assert runner.step_index == 0  # nothing ran


def test_megatron_runner_refuses_arguments_in_the_wrong_order_or_of_the_wrong_kind() -> None:
    cfg = _moe_config(moe_paged_stash=True)
    model = nn.ModuleList([TEGroupedMLP(2, cfg, manager=PagedStashManager.from_config(cfg))])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = types.SimpleNamespace()
    with pytest.raises(TypeError, match="model must be a module or a non-empty list"):
        tpm.MegatronPagedStashRunner(optimizer, [model], config)
    with pytest.raises(TypeError, match=r"optimizer must be Megatron's optimizer"):
        tpm.MegatronPagedStashRunner([model], config, optimizer)
    with pytest.raises(TypeError, match=r"config must be the model's TransformerConfig"):
        tpm.MegatronPagedStashRunner([model], None, optimizer)
    with pytest.raises(TypeError, match=r"model\[1\] must be a torch.nn.Module"):
        tpm.MegatronPagedStashRunner([model, "chunk"], optimizer, config)
    with pytest.raises(TypeError, match="max_consecutive_fallbacks must be an int, got '3'"):
        tpm.MegatronPagedStashRunner([model], optimizer, config, max_consecutive_fallbacks="3")
    runner = tpm.MegatronPagedStashRunner([model], optimizer, config)  # the right order
    assert runner.optimizer is optimizer


def test_a_manager_the_spec_would_not_use_or_that_contradicts_the_config_is_refused() -> None:
    cfg = megatron_config(num_moe_experts=E)
    manager = PagedStashManager(page_size=64, device="cpu")
    with pytest.raises(ValueError, match="manager= was given but moe_paged_stash is off"):
        tpm.get_te_paged_moe_spec(cfg, manager=manager, moe_expert_rank_capacity_factor=2.0)
    on = {"moe_paged_stash": True, "moe_expert_rank_capacity_factor": 2.0}
    with pytest.raises(ValueError, match=r"manager= pages 64 rows but moe_paged_stash_page_size "
                       r"is 16"):  # fmt: skip
        tpm.get_te_paged_moe_spec(cfg, manager=manager, moe_paged_stash_page_size=16, **on)
    with pytest.raises(TypeError, match="manager must be a PagedStashManager"):
        tpm.get_te_paged_moe_spec(cfg, manager="m", **on)
    spec = tpm.get_te_paged_moe_spec(cfg, manager=manager, **on)  # agrees: fine
    assert spec.submodules.experts.params["manager"] is manager


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=180, check=False)  # fmt: skip


def test_importing_te_paged_installs_no_cpu_shim() -> None:
    out = _run(
        """
        import torch
        current_device = torch.cuda.current_device
        import te_paged, te_paged.integrations.megatron as tpm
        from te_paged.integrations.megatron import cpu_shims
        tpm.get_te_paged_moe_spec  # the integration's names resolve without installing
        assert not cpu_shims.installed() and torch.cuda.current_device is current_device
        print("ok")
        """
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_cpu_shims_refuse_to_install_where_cuda_is_available() -> None:
    out = _run(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from te_paged.integrations.megatron import cpu_shims
        try:
            cpu_shims.install()
        except RuntimeError as e:
            print(e)
        assert not cpu_shims.installed()
        """
    )
    assert out.returncode == 0 and "for machines without CUDA" in out.stdout, out.stderr[-2000:]


def test_megatron_config_reads_the_activation_the_example_uses() -> None:
    cfg = tpm.megatron_moe_config(megatron_config(activation_func=F.silu), moe_paged_stash=False)
    assert cfg.activation == "swiglu"
