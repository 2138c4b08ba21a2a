"""StaticBudgetDispatcher and MoELayer in one process (``ep_group=None``): permutation, budget,
drops, static vs dropless parity, MXFP8 alignment, no host reads."""

from __future__ import annotations

import pytest
import torch

from te_paged.config import MoEConfig
from te_paged.moe import MoELayer, StaticBudgetDispatcher, static_budget
from te_paged.stash import PagedStashManager
from tests.host_reads import NoHostReads

E, H, K, N = 4, 32, 2, 20


def config(**kw) -> MoEConfig:
    base = {
        "hidden_size": H,
        "moe_ffn_hidden_size": 64,
        "num_moe_experts": E,
        "moe_router_topk": K,
        "moe_expert_rank_capacity_factor": 2.0,
        "moe_paged_stash_page_size": 8,
        # One layer: its backward comes first, so the default would keep its tensors unpaged.
        "moe_paged_stash_skip_immediate_backward": False,
    }
    return MoEConfig(**{**base, **kw})


def routing(seed: int = 0, n: int = N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g)
    indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    probs = torch.rand(n, K, generator=g)
    return x, probs, indices


def reference_permutation(x, probs, indices):
    """Rows ordered by (expert, token, k): what one rank must hand its experts."""
    rows, p, counts = [], [], []
    for e in range(E):
        hits = [(n, k) for n in range(x.shape[0]) for k in range(K) if indices[n, k] == e]
        rows += [x[n] for n, _ in hits]
        p += [probs[n, k] for n, k in hits]
        counts.append(len(hits))
    return torch.stack(rows), torch.stack(p), torch.tensor(counts)


def test_static_dispatch_order_counts_padding_and_identity_combine() -> None:
    disp = StaticBudgetDispatcher(config())
    x, probs, indices = routing()
    x.requires_grad_()
    out_TH, tpe, probs_T, handle = disp.dispatch(x, probs, indices)
    ref_rows, ref_p, ref_counts = reference_permutation(x.detach(), probs, indices)
    budget = config().max_num_tokens(N)
    assert out_TH.shape == (budget, H) and probs_T.shape == (budget,)
    assert tpe.dtype == torch.int64 and torch.equal(tpe, ref_counts)
    real = N * K
    assert torch.equal(out_TH[:real], ref_rows) and torch.equal(probs_T[:real], ref_p)
    assert not out_TH[real:].any() and not probs_T[real:].any()  # zero padding
    # Identity experts: every token gets its K copies back, summed.
    y = disp.combine(out_TH, handle)
    assert torch.equal(y, x.detach().unsqueeze(1).expand(N, K, H).sum(1))
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.full_like(x, K))
    assert disp.over_budget.item() == 0 and disp.dropped_tokens.item() == 0
    assert disp.peak_tokens.item() == real and disp.peak_pair_tokens.item() == real
    assert disp.budget_tokens == disp.pair_capacity == budget


def test_over_budget_assignments_are_dropped_and_counted() -> None:
    cfg = config(moe_expert_rank_capacity_factor=0.5)  # 20 rows for 40 assignments
    disp = StaticBudgetDispatcher(cfg)
    x, probs, indices = routing()
    indices[:, 0] = 3  # expert 3 first for everybody: skewed, but P=1 counts only the total
    out_TH, tpe, probs_T, handle = disp.dispatch(x, probs, indices)
    budget = cfg.max_num_tokens(N)
    assert budget == 20 and out_TH.shape == (20, H)
    # The first C assignments in (token, k) order are kept: tokens 0..9, both k.
    kept = N * K // 2 // K
    ref_rows, ref_p, ref_counts = reference_permutation(x[:kept], probs[:kept], indices[:kept])
    assert torch.equal(out_TH, ref_rows) and torch.equal(tpe, ref_counts)
    assert torch.equal(probs_T, ref_p) and int(tpe.sum()) == budget
    y = disp.combine(out_TH, handle)
    assert torch.equal(y[:kept], 2 * x[:kept]) and not y[kept:].any()  # missing, not garbage
    assert disp.over_budget.item() == 1 and disp.dropped_tokens.item() == N * K - budget
    assert disp.peak_tokens.item() == N * K and disp.peak_pair_tokens.item() == N * K
    # A second over-budget dispatch counts again; reset_flags() clears everything in place.
    flag = disp.over_budget
    disp.dispatch(x, probs, indices)
    assert disp.over_budget.item() == 2 and disp.dropped_tokens.item() == 2 * (N * K - budget)
    disp.reset_flags()
    assert disp.over_budget is flag and flag.item() == 0 and disp.peak_tokens.item() == 0
    # The suggested factor really fits: nothing is dropped with it.
    factor = disp.fitting_capacity_factor(N, N * K)
    assert factor == 1.0
    fitted = StaticBudgetDispatcher(cfg, capacity_factor=factor)
    fitted.dispatch(x, probs, indices)
    assert fitted.over_budget.item() == 0


def test_dropless_gives_exact_rows_and_same_order() -> None:
    x, probs, indices = routing(1)
    static = StaticBudgetDispatcher(config())
    dropless = StaticBudgetDispatcher(config(), capacity_factor=None)
    assert dropless.dropless and dropless.capacity_factor is None
    s_TH, s_tpe, s_p, _ = static.dispatch(x, probs, indices)
    d_TH, d_tpe, d_p, handle = dropless.dispatch(x, probs, indices)
    assert d_TH.shape == (N * K, H) and handle.dropless
    assert torch.equal(d_TH, s_TH[: N * K]) and torch.equal(d_p, s_p[: N * K])
    assert torch.equal(d_tpe, s_tpe)
    assert torch.equal(dropless.combine(d_TH, handle), 2 * x)
    dropless.set_dropless(False)  # no factor: stays dropless
    assert dropless.dropless


def _run(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y, aux = layer(x)
    (y * dy).sum().add(aux).backward()
    out = [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"fp8": "mxfp8"},
        {"moe_paged_stash": True},
        {
            "moe_paged_stash": True,
            "recompute_granularity": "selective",
            "recompute_modules": ["moe_act"],
        },
    ],
    ids=["plain", "mxfp8", "stash", "stash-recompute"],
)
def test_layer_static_equals_dropless_bitwise(kw) -> None:
    cfg = config(**kw)
    manager = PagedStashManager.from_config(cfg) if cfg.moe_paged_stash else None
    layer = MoELayer(cfg, manager=manager, seed=3, aux_loss_coeff=0.01)
    layer.router.set_skew([0], 0.05)  # skewed, within the 2x budget
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(2, N // 2, H, generator=g), torch.randn(2, N // 2, H, generator=g)
    results = []
    for step in range(3):  # capture step, then a paged step, then the dropless rerun
        if manager is not None:
            manager.reset()
        layer.set_dropless(step == 2)
        results.append(_run(layer, x, dy))
        if manager is not None and step == 1:
            stats = manager.stats()
            assert stats.stashes == stats.pops > 0 and not stats.overflow
    layer.set_dropless(False)
    assert layer.dispatcher.over_budget.item() == 0
    assert layer.dispatcher.peak_tokens.item() > N * K // E  # really skewed
    for static, dropless in zip(results[1], results[2]):
        assert torch.equal(static, dropless)
    assert results[0][0].shape == x.shape and results[0][1].abs().max() > 0


def test_dropless_settings_compose_and_leave_the_manager_alone() -> None:
    cfg = config(moe_paged_stash=True)
    manager = PagedStashManager.from_config(cfg)
    a = MoELayer(cfg, manager=manager, seed=0)
    d = a.dispatcher
    a.set_dropless(True)
    assert a.dropless and manager.enabled  # stashing is the manager's own switch
    with d.dropless_block():
        a.set_dropless(False)
        assert d.dropless  # the runner's block holds whatever the caller sets meanwhile
    assert not d.dropless
    with d.dropless_block(), d.dropless_block():
        assert d.dropless
    assert not d.dropless


def test_manager_disabled_blocks_are_counted() -> None:
    manager = PagedStashManager.from_config(config(moe_paged_stash=True))
    with manager.disabled():
        with manager.disabled():
            assert not manager.enabled
        assert not manager.enabled  # the outer owner still holds it off
    assert manager.enabled
    with pytest.raises(AttributeError):
        manager.enabled = False  # read-only: disabled() is the only switch


def test_dropless_forward_never_stashes() -> None:
    cfg = config(moe_paged_stash=True)
    manager = PagedStashManager.from_config(cfg)
    layer = MoELayer(cfg, manager=manager, seed=0)
    layer.dispatcher.set_dropless(True)  # only the dispatcher: the manager stays enabled
    manager.reset()
    layer(torch.randn(N, H))[0].sum().backward()
    assert manager.enabled and manager.stats().stashes == 0


def test_static_budget_alignment() -> None:
    # 100 tokens, top-2, factor 1.1: 220 rows (decimal arithmetic, not 221).
    cfg = config(num_moe_experts=12, moe_expert_rank_capacity_factor=1.1)
    assert static_budget(cfg, 100, 1) == (220, 220)
    assert static_budget(cfg, 100, 4) == (220, 55)
    assert static_budget(cfg, 100, 3) == (222, 74)  # rounded up to a multiple of P
    mx = config(num_moe_experts=12, moe_expert_rank_capacity_factor=1.1, fp8="mxfp8")
    assert static_budget(mx, 100, 1) == (224, 224)
    assert static_budget(mx, 100, 4) == (224, 56)  # lcm(4, 32) = 32
    assert static_budget(mx, 100, 3) == (288, 96)  # lcm(3, 32) = 96
    disp = StaticBudgetDispatcher(mx)
    out_TH, *_ = disp.dispatch(*routing(n=100))
    assert out_TH.shape[0] % 32 == 0 and out_TH.shape[0] == 224


def test_validation_errors() -> None:
    disp = StaticBudgetDispatcher(config())
    x, probs, indices = routing()
    with pytest.raises(ValueError, match=r"\[tokens, moe_router_topk\] = \[20, 2\]"):
        disp.dispatch(x, probs[:, :1], indices)
    with pytest.raises(TypeError, match="integer"):
        disp.dispatch(x, probs, indices.float())
    with pytest.raises(ValueError, match=r"tokens >= 1, 32"):
        disp.dispatch(x[:0], probs[:0], indices[:0])
    with pytest.raises(ValueError, match=r"capacity_factor must be finite and > 0, got -1\.0"):
        StaticBudgetDispatcher(config(), capacity_factor=-1.0)
    _, handle = disp.dispatch(x, probs, indices)[2:]
    with pytest.raises(ValueError, match=r"expert output must be \[80, 32\]"):
        disp.combine(torch.zeros(3, H), handle)


def test_static_forward_backward_sync_free(monkeypatch) -> None:
    # Router → dispatcher → experts → combine, forward and backward. Paged stash is left off:
    # its CPU reference kernels read flags on the host by design (the stash's own sync-free
    # path is tested with its kernels); everything this layer adds must not.
    layer = MoELayer(config(), seed=0, expert_bias=True, aux_loss_coeff=0.01)
    x = torch.randn(N, H, requires_grad=True)

    def tolist(self):  # below the dispatcher on CPU: patch it instead
        raise AssertionError("host sync: Tensor.tolist")

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with NoHostReads():
        y, aux = layer(x)
        (y.square().sum() + aux).backward()
    assert x.grad.abs().max() > 0 and layer.router.weight.grad.abs().max() > 0
    # The guard sees the dispatcher's ops: the dropless mode's host read trips it.
    layer.set_dropless(True)
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        layer(x)


def test_the_stash_is_sized_from_the_exact_balanced_count(monkeypatch) -> None:
    # 100 tokens, top-2, factor 1.1, MXFP8: budget 220 → 224 rows, whose estimate
    # floor(224 / 1.1) = 203 is not the 200 balanced rows the dispatcher knows (N·K).
    cfg = config(moe_paged_stash=True, moe_expert_rank_capacity_factor=1.1, fp8="mxfp8")
    manager = PagedStashManager.from_config(cfg)
    layer = MoELayer(cfg, manager=manager, seed=0)
    seen = []
    scope = manager.scope

    def spy(max_num_tokens, num_tokens, avg_num_tokens, **kw):
        seen.append((max_num_tokens, avg_num_tokens))
        return scope(max_num_tokens, num_tokens, avg_num_tokens, **kw)

    monkeypatch.setattr(manager, "scope", spy)
    manager.reset()
    layer(torch.randn(100, H))[0].sum().backward()
    assert cfg.avg_num_tokens(224) == 203
    assert seen == [(224, 200)]
    assert layer.experts._balanced_num_tokens is None  # only within the layer's call


def test_assignments_that_do_not_exist_are_not_sent_and_add_exact_zeros() -> None:
    # Tokens routed to fewer than K experts (Megatron's routing map allows it): before, the
    # missing routes went to some other expert with probability 0, using its budget and
    # multiplying that expert's output by 0 (NaN where the output is NaN).
    disp = StaticBudgetDispatcher(config(moe_expert_rank_capacity_factor=1.0))
    x, probs, indices = routing()
    routed = torch.ones_like(indices, dtype=torch.bool)
    routed[::2, 1] = False  # every other token: one expert only
    indices = indices.masked_fill(~routed, -1)
    out_TH, tpe, _, handle = disp.dispatch(x, probs, indices, routed_NK=routed)
    assert int(tpe.sum()) == int(routed.sum())  # only the real assignments are sent
    assert int(disp.invalid_indices) == 0 and int(disp.over_budget) == 0
    assert int(disp.dropped_tokens) == 0
    nan_out = torch.full_like(out_TH, float("nan"))
    nan_out[: int(tpe.sum())] = out_TH[: int(tpe.sum())]  # NaN only where nothing was sent
    y = disp.combine(nan_out, handle)
    assert not y.isnan().any()
    expect = torch.stack([x[n] * int(routed[n].sum()) for n in range(N)])
    assert torch.equal(y, expect)  # identity experts: each real assignment once
    with pytest.raises(ValueError, match="routed must be a bool tensor shaped like indices"):
        disp.dispatch(x, probs, indices, routed_NK=routed.long())


def test_an_unset_wire_is_auto_until_a_factor_is_set() -> None:
    """No ``moe_a2a_capacity_factor``: the wire starts at the expert factor, marked auto for a
    runner to size; a factor given, or set, is not auto; no static budget, no wire."""
    auto = StaticBudgetDispatcher(config())
    assert auto.wire_auto and auto.a2a_capacity_factor == 2.0
    auto.set_a2a_capacity_factor(1.3)
    assert not auto.wire_auto and auto.a2a_capacity_factor == 1.3
    given = StaticBudgetDispatcher(config(moe_a2a_capacity_factor=1.5))
    assert not given.wire_auto and given.a2a_capacity_factor == 1.5
    assert StaticBudgetDispatcher(config(), a2a_capacity_factor=None).wire_auto
    dropless = StaticBudgetDispatcher(config(moe_expert_rank_capacity_factor=None))
    assert not dropless.wire_auto and dropless.a2a_capacity_factor is None
