"""TopKRouter: selection and probabilities against a loop reference, expert bias, aux loss,
test-only skew, and no host reads."""

from __future__ import annotations

import pytest
import torch

from te_paged.config import MoEConfig
from te_paged.moe import RouterOutput, TopKRouter
from tests.host_reads import NoHostReads

E, H, K, N = 8, 32, 2, 24


def make(topk: int = K, seed: int = 0, **kw) -> tuple[TopKRouter, torch.Tensor]:
    cfg = MoEConfig(hidden_size=H, moe_ffn_hidden_size=64, num_moe_experts=E, moe_router_topk=topk)
    router = TopKRouter(cfg, **kw)
    router.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        router.weight.mul_(50)  # spread the logits so that the top-k has clear winners
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(seed + 1))
    return router, x


def reference(router: TopKRouter, x: torch.Tensor, bias=None):
    """Token by token: sort the selection scores, take K, normalise the chosen scores."""
    logits = x @ router.weight.t()
    probs, indices = [], []
    for row in logits:
        if router.score_function.value == "softmax":
            select = row if bias is None else row + bias
            top = torch.argsort(select, descending=True, stable=True)[: router.topk]
            chosen = row[top]
            p = torch.exp(chosen - chosen.max())
            p = p / p.sum()
        else:
            sig = torch.sigmoid(row)
            select = sig if bias is None else sig + bias
            top = torch.argsort(select, descending=True, stable=True)[: router.topk]
            p = sig[top]
            p = p / p.sum() if router.topk > 1 else p
        probs.append(p)
        indices.append(top)
    return torch.stack(probs), torch.stack(indices)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("topk", [1, 2, 4])
def test_topk_matches_reference(score, topk) -> None:
    router, x = make(topk, score_function=score)
    out = router(x)
    assert isinstance(out, RouterOutput)
    ref_probs, ref_idx = reference(router, x)
    assert out.indices.dtype == torch.int64 and torch.equal(out.indices, ref_idx)
    # Different but equivalent arithmetic (a fused softmax vs exp/sum): fp32 rounding only.
    torch.testing.assert_close(out.probs, ref_probs, rtol=1e-6, atol=1e-7)
    if score == "softmax" or topk > 1:
        torch.testing.assert_close(out.probs.sum(1), torch.ones(N), rtol=1e-6, atol=1e-6)
    assert torch.equal(out.tokens_per_expert, torch.bincount(ref_idx.flatten(), minlength=E))
    assert out.aux_loss.shape == () and out.aux_loss.item() == 0.0


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_expert_bias_changes_selection_not_probs(score) -> None:
    router, x = make(score_function=score, expert_bias=True)
    before = router(x)
    bias = torch.zeros(E)
    bias[5] = 100.0  # every token now selects expert 5 first
    router.expert_bias.copy_(bias)
    after = router(x)
    assert torch.equal(after.indices[:, 0], torch.full((N,), 5))
    assert not torch.equal(before.indices, after.indices)
    ref_probs, ref_idx = reference(router, x, bias=bias)
    assert torch.equal(after.indices, ref_idx)
    # The probabilities come from the unbiased scores of the selected experts.
    torch.testing.assert_close(after.probs, ref_probs, rtol=1e-6, atol=1e-7)
    assert "expert_bias" in router.state_dict() and not router.expert_bias.requires_grad


def test_update_expert_bias_moves_against_load() -> None:
    router, _ = make(expert_bias=True)
    load = torch.tensor([10, 0, 5, 5, 5, 5, 5, 5])  # mean 5: expert 0 over, expert 1 under
    router.update_expert_bias(load, rate=0.5)
    assert torch.equal(router.expert_bias, torch.tensor([-0.5, 0.5, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match=r"shape \[8\]"):
        router.update_expert_bias(torch.zeros(3), rate=0.1)
    plain, _ = make()
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        plain.update_expert_bias(load)


def _aux_reference(router: TopKRouter, w: torch.Tensor, x: torch.Tensor, coeff: float):
    """Switch loss written out: coeff · E · Σ_e f_e · P_e (``w`` may be a leaf to differentiate)."""
    logits = x @ w.t()
    if router.score_function.value == "softmax":
        scores = torch.softmax(logits, dim=1)
    else:
        sig = torch.sigmoid(logits)
        scores = sig / sig.sum(1, keepdim=True)
    _, idx = reference(router, x)
    f = torch.stack([(idx == e).sum() for e in range(E)]).float() / (N * router.topk)
    return coeff * E * sum(f[e] * scores[:, e].mean() for e in range(E))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_aux_loss_value_and_gradient(score) -> None:
    coeff = 0.01
    router, x = make(score_function=score, aux_loss_coeff=coeff)
    out = router(x)
    (g_out,) = torch.autograd.grad(out.aux_loss, router.weight)
    w = router.weight.detach().clone().requires_grad_()
    ref = _aux_reference(router, w, x, coeff)
    (g_ref,) = torch.autograd.grad(ref, w)
    # Same formula, different reduction order (mean/sum vs a Python loop): fp32 rounding.
    torch.testing.assert_close(out.aux_loss, ref.detach(), rtol=1e-5, atol=0)
    assert g_out.abs().max() > 0
    torch.testing.assert_close(g_out, g_ref, rtol=1e-4, atol=1e-9)


def test_aux_loss_is_coeff_under_perfect_balance() -> None:
    # Zero weights: every score is 1/E, so P_e = 1/E and the loss is coeff · Σ_e f_e = coeff
    # whatever the (tie-broken) selection.
    router, x = make(aux_loss_coeff=0.3)
    with torch.no_grad():
        router.weight.zero_()
    out = router(x)
    torch.testing.assert_close(out.aux_loss, torch.tensor(0.3), rtol=1e-6, atol=0)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_skew_forces_chosen_experts(score) -> None:
    router, x = make(score_function=score)
    base = router(x)
    router.set_skew([6, 7], 1e3)
    skewed = router(x)
    assert torch.equal(skewed.indices.sort(1).values, torch.tensor([[6, 7]]).expand(N, 2))
    assert router.skew.experts == (6, 7) and "skew=RoutingSkew" in repr(router)
    router.set_skew(None)
    assert torch.equal(router(x).indices, base.indices)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        router.set_skew([8], 1.0)


def test_validation_errors_name_the_fix() -> None:
    cfg = MoEConfig(hidden_size=H, num_moe_experts=E)
    with pytest.raises(ValueError, match="'softmax', 'sigmoid'"):
        TopKRouter(cfg, score_function="relu")
    with pytest.raises(ValueError, match="aux_loss_coeff"):
        TopKRouter(cfg, aux_loss_coeff=-1.0)
    with pytest.raises(ValueError, match=r"\[tokens, 32\]"):
        TopKRouter(cfg)(torch.randn(4, 16))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_forward_backward_sync_free(score, monkeypatch) -> None:
    router, x = make(score_function=score, expert_bias=True, aux_loss_coeff=0.01)
    router.set_skew([1], 0.5)
    x.requires_grad_()

    def tolist(self):  # below the dispatcher on CPU: patch it instead
        raise AssertionError("host sync: Tensor.tolist")

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    with NoHostReads():
        out = router(x)
        (out.probs.square().sum() + out.aux_loss).backward()
        router.update_expert_bias(out.tokens_per_expert, 1e-3)
    assert x.grad is not None and router.weight.grad.abs().max() > 0


def test_guard_catches_a_host_read() -> None:
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        torch.tensor([1, 2]).sum().item()
