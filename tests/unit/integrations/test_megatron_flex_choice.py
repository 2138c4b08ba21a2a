"""Which Megatron flex backends te_paged keeps: NCCL EP only where its ``ep_bootstrap`` can drop
(Transformer Engine 2.19+); one that traps (2.18, megatron-core 0.19.2's pairing) or none gets
te_paged's own dispatcher. And NCCL EP's budget rule, Megatron's."""

from __future__ import annotations

import types

import pytest

from te_paged.integrations.megatron import flex

fused_a2a = pytest.importorskip("megatron.core.transformer.moe.fused_a2a")


def _te_ep(drop: bool) -> types.SimpleNamespace:
    if drop:  # Transformer Engine 2.19's signature (ep.py:101-112)

        def ep_bootstrap(ep_group, num_experts, max_tokens_per_rank, hidden_dim, num_topk,
                         recv_capacity_per_rank=None, max_num_sms=0, zero_copy=False,
                         drop_on_overflow=False, max_token_dtype=None): ...  # fmt: skip
    else:  # 2.18's (ep.py:90-99)

        def ep_bootstrap(ep_group, num_experts, max_tokens_per_rank, recv_capacity_per_rank,
                         hidden_dim, max_num_sms=0, zero_copy=False,
                         max_token_dtype=None): ...  # fmt: skip

    return types.SimpleNamespace(ep_bootstrap=ep_bootstrap)


def _config(backend: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=backend
    )


@pytest.mark.parametrize(("have", "drop", "kept"), [(True, True, True), (True, False, False),
                                                    (False, True, False)])  # fmt: skip
def test_nccl_ep_is_kept_only_where_it_drops(monkeypatch, have, drop, kept) -> None:
    monkeypatch.setattr(fused_a2a, "HAVE_TE_EP", have, raising=False)
    monkeypatch.setattr(fused_a2a, "te_ep", _te_ep(drop), raising=False)
    assert flex.keeps_flex_dispatcher(_config("ncclep")) is kept
    assert (flex.nccl_ep_unavailable() is None) is kept
    assert not flex.keeps_flex_dispatcher(_config("deepep"))


def test_nccl_ep_budget_is_megatrons_rule() -> None:
    rule = flex.nccl_ep_rank_budget(topk=2, align=0)
    # 0.19.2 (_ensure_bootstrap): tokens rounded up to 64, x top-k x factor, then alignment
    assert rule(16, 4.0) == 512 and rule(128, 1.0) == 256 and rule(129, 1.0) == 384
    assert flex.nccl_ep_rank_budget(topk=8, align=256)(100, 1.1) == 1280  # 1126 -> 1280
    assert rule(64, 0.1) == 64  # never below the tokens a rank sends


def test_nccl_ep_capacity_at_the_factor_then_the_rerun_demand_or_the_worst_case() -> None:
    from te_paged.config import MoEConfig

    cfg = MoEConfig(hidden_size=8, moe_ffn_hidden_size=8, num_moe_experts=4, moe_router_topk=2,
                    moe_expert_rank_capacity_factor=1.0)  # fmt: skip
    manager = types.SimpleNamespace(zero_copy=False, num_local_experts=4, router_topk=2)
    d = flex.FlexTokenDispatcher(
        types.SimpleNamespace(_comm_manager=manager), cfg, None, align=0, backend="ncclep"
    )
    assert manager.static_shape  # the experts read the device counts: no host narrowing
    d._num_tokens = 100  # 128 tokens a rank for NCCL EP: 256 rows at factor 1.0
    assert d.nccl_ep_capacity()[:2] == (256, 128)
    d.budget.set_dropless(True)  # dropless with no failed attempt to size from: the worst
    assert d.nccl_ep_capacity()[0] == 128 * 2  # case, 1 rank x 128 tokens x min(K, 4)
    d.budget.rerun_rows = 300  # the runner's rerun: what the failed attempt demanded
    assert d.nccl_ep_capacity()[0] == 300
    d.budget.rerun_rows = 200  # never below the budget itself
    assert d.nccl_ep_capacity()[0] == 256
    manager.zero_copy = True
    with pytest.raises(ValueError, match="moe_ncclep_zero_copy"):
        flex.FlexTokenDispatcher(
            types.SimpleNamespace(_comm_manager=manager), cfg, None, align=0, backend="ncclep"
        )


@pytest.mark.parametrize("backend", ["ncclep", "hybridep"])
def test_a_lost_fast_path_is_said_once_when_the_layers_are_built(monkeypatch, caplog, backend):
    # Before: HybridEP asked for where deep_ep does not import gave te_paged's own padded
    # dispatcher silently (NCCL EP's reason was logged at INFO, every layer).
    import importlib.util
    import logging

    monkeypatch.setattr(fused_a2a, "HAVE_TE_EP", False, raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deep_ep" else real(name, *a))  # fmt: skip
    flex._lost_fast_path.cache_clear()
    with caplog.at_level(logging.INFO, logger="te_paged"):
        for _ in range(3):  # three layers
            assert not flex.keeps_flex_dispatcher(_config(backend))
    said = [r for r in caplog.records if "asked for, but" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    why = "transformer_engine.pytorch.ep" if backend == "ncclep" else "deep_ep (HybridEP)"
    assert (
        why in said[0].getMessage()
        and "te_paged's own static-budget dispatcher" in said[0].getMessage()
    )


def test_a_misspelt_flex_backend_is_refused() -> None:
    # Before: FlexBudget(backend="hybrid_ep") was taken for HybridEP.
    from te_paged.config import MoEConfig

    cfg = MoEConfig(hidden_size=8, moe_ffn_hidden_size=8, num_moe_experts=4, moe_router_topk=2,
                    moe_expert_rank_capacity_factor=1.0)  # fmt: skip
    with pytest.raises(ValueError, match="backend='hybrid_ep' is not one of"):
        flex.FlexBudget(cfg, None, align=0, backend="hybrid_ep")


@pytest.mark.parametrize("pad_uneven", [False, True])
def test_uneven_padding_sizes_the_budget_from_megatrons_padded_count(pad_uneven) -> None:
    # Before: the budget counted this rank's own tokens where Megatron's HybridEP budget counts
    # the group's largest (moe_hybridep_pad_uneven_dispatch_inputs), so the factors fitted to
    # the step overshot or fell short of Megatron's.
    import torch

    from te_paged.config import MoEConfig

    cfg = MoEConfig(hidden_size=8, moe_ffn_hidden_size=8, num_moe_experts=4, moe_router_topk=2,
                    moe_expert_rank_capacity_factor=1.0)  # fmt: skip
    manager = types.SimpleNamespace()

    def dispatch_preprocess(hidden, routing_map, probs):  # Megatron's setup_metadata's part
        manager._padded_num_tokens = 64 if pad_uneven else hidden.shape[0]
        return hidden, probs

    inner = types.SimpleNamespace(
        config=types.SimpleNamespace(moe_hybridep_pad_uneven_dispatch_inputs=pad_uneven),
        _comm_manager=manager, dispatch_preprocess=dispatch_preprocess,
    )  # fmt: skip
    d = flex.FlexTokenDispatcher(inner, cfg, None, align=0, backend="hybridep")
    d.dispatch_preprocess(torch.zeros(10, 8), torch.zeros(10, 4, dtype=torch.bool),
                          torch.zeros(10, 4))  # fmt: skip
    assert d._num_tokens == (64 if pad_uneven else 10)
    assert d.budget.rank_budget(d._num_tokens, 1.0) == (64 if pad_uneven else 10) * 2
