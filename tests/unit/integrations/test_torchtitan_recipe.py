"""docs/torchtitan.md's recipe, run as written: torchtitan's ``GroupedExperts`` with paged stash.

The page's Python blocks are executed in order into one namespace (the recipe); a stack of
torchtitan-style MoE layers then trains with the recipe's experts and is compared, bit for bit,
with the same stack on the *unmodified* torchtitan-style module below, without te_paged.

Shape suffixes: ``T`` tokens, ``D`` model dim, ``F`` FFN dim, ``E`` experts, ``e`` this rank's
experts, ``K`` top-k, ``R`` rows of the static expert buffer (``T·K``: the worst case, every
choice landing on this rank). The model is one expert-parallel rank's view: it holds experts
``[0, LOCAL)`` of ``E``; choices of the other experts belong to other ranks and sort after the
local ones, so they are the buffer's padding (``1 − LOCAL/E`` of it under balance).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from te_paged import StashMode

DOC = Path(__file__).resolve().parents[3] / "docs" / "torchtitan.md"
EXAMPLE = re.compile(r"<!-- example: (torchtitan-[\w-]+) -->\n```python\n(.*?)\n```", re.DOTALL)

T, D, FFN, E, LOCAL, K, LAYERS = 128, 64, 256, 8, 2, 2, 4
R = T * K  # static rows of the expert buffer
BALANCED = T * K * LOCAL // E  # rows under perfect balance: 64 of the 256 (75 % padding)
PAGE, BUFFER_FACTOR, STEPS = 16, 1.25, 3  # step 0 captures, 1 and 2 are paged
CPU = torch.device("cpu")


@functools.cache
def recipe() -> dict[str, Any]:
    """The namespace the page's Python blocks define, executed in order."""
    text = DOC.read_text()
    blocks = EXAMPLE.findall(text)
    assert [name for name, _ in blocks] == [
        "torchtitan-markers",
        "torchtitan-grouped-linear",
        "torchtitan-step",
        "torchtitan-memory",
    ]
    namespace: dict[str, Any] = {"__name__": "torchtitan_recipe"}
    for name, code in blocks:
        exec(compile(code, f"{DOC}:{name}", "exec"), namespace)
    return namespace


class TorchtitanGroupedExperts(nn.Module):
    """torchtitan's GroupedExperts as it is, without te_paged: the reference."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1_EFD = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * dim**-0.5)
        self.w2_EDF = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) * hidden_dim**-0.5)
        self.w3_EFD = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * dim**-0.5)

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        w1, w2, w3 = (
            w.bfloat16().transpose(-2, -1) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)
        )
        h_RF = F.silu(torch._grouped_mm(x_RD.bfloat16(), w1, offs=offsets_E))
        h_RF = h_RF * torch._grouped_mm(x_RD.bfloat16(), w3, offs=offsets_E)
        return torch._grouped_mm(h_RF, w2, offs=offsets_E).type_as(x_RD)


class ScopeWithoutMarkers(TorchtitanGroupedExperts):
    """Half the recipe: the scope around the unmodified forward, no markers."""

    paged_stash = None
    avg_num_tokens = 0

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        with recipe()["paged_stash_scope"](self, x_RD, num_tokens_per_expert_E.sum()):
            return super().forward(x_RD, num_tokens_per_expert_E)


class TorchtitanStyleMoE(nn.Module):
    """Top-K router, expert-sorted dispatch into the static ``[R, D]`` buffer, the experts and
    the score-weighted combine, as torchtitan's ``LocalTokenDispatcher`` orders tokens."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        self.experts = experts

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        scores_TE = F.softmax(self.gate(x_TD), dim=-1)
        scores_TK, experts_TK = torch.topk(scores_TE, K, dim=-1)
        routing_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter_(-1, experts_TK, True)
        counts_e = routing_TE.sum(dim=0)[:LOCAL]  # int64, on the device: no host read
        order_R = torch.argsort(experts_TK.reshape(-1).clamp(max=LOCAL), stable=True)
        token_R = order_R // K
        real_R1 = (torch.arange(R, device=x_TD.device) < counts_e.sum()).unsqueeze(1)
        x_RD = torch.where(real_R1, x_TD[token_R], 0)
        y_RD = self.experts(x_RD, counts_e)
        # Select the real rows before the scores touch them: the padding rows of a grouped GEMM
        # are uninitialised, and 0 × NaN would reach the router's gradient.
        y_RD = torch.where(real_R1, y_RD, 0) * scores_TK.reshape(-1)[order_R].unsqueeze(1)
        return torch.zeros_like(x_TD).index_add(0, token_R, y_RD)


class Stack(nn.Module):
    def __init__(self, experts_cls: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            TorchtitanStyleMoE(experts_cls(D, FFN, LOCAL)) for _ in range(LAYERS)
        )

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x_TD = x_TD + layer(x_TD)
        return x_TD


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)) for _ in range(STEPS)]


def reference_model() -> Stack:
    torch.manual_seed(0)
    return Stack(TorchtitanGroupedExperts)


@dataclasses.dataclass
class Step:
    loss: torch.Tensor
    outputs: dict[int, torch.Tensor]  # each MoE layer's output, by layer
    grads: dict[str, torch.Tensor]  # every parameter's gradient, under the reference's names
    record: Any = None  # the runner's StepRecord
    stats: Any = None  # the manager's StashStats after the step
    peak: int | None = None  # step_peak_bytes, on the measured step


def record_outputs(model: Stack) -> dict[int, torch.Tensor]:
    outputs: dict[int, torch.Tensor] = {}  # a rerun overwrites its first attempt's
    for i, layer in enumerate(model.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out.detach()))
    return outputs


def plain_step(model: Stack, optimizer: torch.optim.Optimizer, inputs, labels) -> torch.Tensor:
    """The page's ``train_step`` without te_paged (and so without a runner)."""
    optimizer.zero_grad(set_to_none=False)
    loss = F.mse_loss(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss.detach()


def maybe_measured(step_fn, measured: bool, manager=None) -> tuple[Any, int | None]:
    """``step_fn()`` and, on the measured step, its peak by the page's ``step_peak_bytes``."""
    if not measured:
        return step_fn(), None
    box: list[Any] = []
    peak = recipe()["step_peak_bytes"](lambda: box.append(step_fn()), CPU, manager)
    return box[0], peak


@functools.cache
def run_reference(steps: int = STEPS, measure: int | None = None) -> tuple[Step, ...]:
    """The unmodified module without te_paged, on the same batches and optimizer."""
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    outputs = record_outputs(model)
    results = []
    for step, (inputs, labels) in enumerate(batches()[:steps]):
        step_fn = functools.partial(plain_step, model, optimizer, inputs, labels)
        loss, peak = maybe_measured(step_fn, step == measure)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append(Step(loss, dict(outputs), grads, peak=peak))
    return tuple(results)


def run_recipe(
    experts_cls: type[nn.Module],
    *,
    steps: int = STEPS,
    buffer_factor: float = BUFFER_FACTOR,
    measure: int | None = None,
    grow_pool: bool = True,
) -> list[Step]:
    """The recipe's experts, loaded from the reference's initial weights, driven by the page's
    ``build_paged_stash``/``train_step`` (and ``step_peak_bytes`` on step ``measure``).
    Gradients are reported under the reference's parameter names."""
    ns = recipe()
    model = Stack(experts_cls)
    grouped_linear = experts_cls is ns["GroupedLinearExperts"]
    rename = ns["grouped_linear_state_dict"] if grouped_linear else dict
    state = reference_model().state_dict()
    model.load_state_dict(rename(state))
    manager, runner = ns["build_paged_stash"](
        model, BALANCED, CPU, page_size=PAGE, buffer_factor=buffer_factor
    )
    runner.grow_pool = grow_pool  # off: the pool stays at the factor's size, to overflow
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    outputs = record_outputs(model)
    to_reference = dict(zip(rename(state), state))  # the recipe's names -> the reference's
    results = []
    for step, (inputs, labels) in enumerate(batches()[:steps]):
        args = (runner, model, optimizer, F.mse_loss, inputs, labels, step)
        step_fn = functools.partial(ns["train_step"], *args)
        (loss, record), peak = maybe_measured(step_fn, step == measure, manager)
        grads = {to_reference[n]: p.grad.clone() for n, p in model.named_parameters()}
        results.append(Step(loss, dict(outputs), grads, record, manager.stats(), peak))
    return results


def assert_bitwise(on: list[Step], off: tuple[Step, ...]) -> None:
    assert len(on) == len(off) > 0
    for step, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a.loss, b.loss), step
        assert a.outputs.keys() == b.outputs.keys() == set(range(LAYERS))
        for i in range(LAYERS):
            assert torch.equal(a.outputs[i], b.outputs[i]), (step, i)
        assert a.grads.keys() == b.grads.keys()
        for name, grad in b.grads.items():
            assert grad.abs().sum() > 0, (step, name)  # every parameter takes part
            assert torch.equal(a.grads[name], grad), (step, name)


def test_every_python_block_of_the_page_is_executed() -> None:
    text = DOC.read_text()
    assert text.count("```python") == len(EXAMPLE.findall(text)) == 4
    ns = recipe()
    for name in ("GroupedExperts", "GroupedLinearExperts", "build_paged_stash", "train_step"):
        assert name in ns


def test_the_unmodified_experts_save_what_the_page_lists() -> None:
    """The page's table: two bf16 ``[R, D]`` casts of the input and four bf16 ``[R, F]`` tensors
    are token-major; the rest (offsets, bf16 weight copies) is static and never paged."""
    torch.manual_seed(0)
    experts = TorchtitanGroupedExperts(D, FFN, LOCAL)
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    x_RD = torch.randn(R, D, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(x_RD, torch.tensor([BALANCED // 2, BALANCED // 2]))
    token_major = [t for t in saved if t.dim() == 2 and t.shape[0] == R]
    assert sorted(tuple(t.shape) for t in token_major) == [(R, D)] * 2 + [(R, FFN)] * 4
    assert {t.dtype for t in token_major} == {torch.bfloat16}
    static = sorted(tuple(t.shape) for t in saved if not any(t is m for m in token_major))
    assert static == sorted([(LOCAL,)] * 3 + [(LOCAL, D, FFN)] * 2 + [(LOCAL, FFN, D)])


@pytest.mark.parametrize("variant", ["GroupedExperts", "GroupedLinearExperts"])
def test_recipe_is_bitwise_torchtitan_and_pages_every_saved_activation(variant: str) -> None:
    on = run_recipe(recipe()[variant])
    assert_bitwise(on, run_reference())
    per_step = 6 * LAYERS  # x twice (w1's and w3's GEMM), w1's output, silu's, w3's, the product
    for step, result in enumerate(on):
        stats, record = result.stats, result.record
        assert record.attempt == 1 and record.enabled and not record.stash_overflow_ranks
        assert stats.stashes == stats.pops == per_step, step
        assert not (stats.overflow or stats.host_spill or stats.invalid)
        assert stats.bytes_stashed > 0
        if step == 0:
            assert stats.mode is StashMode.CAPTURE and stats.pool_bytes == 0
        else:  # one pool per (bf16, width): D and F
            assert stats.mode is StashMode.CAPTURED and len(stats.pool_pages) == 2
            for key, pages in stats.pool_pages.items():
                assert 0 < stats.pages_high_water[key] <= pages


@pytest.mark.parametrize("variant", ["GroupedExperts", "GroupedLinearExperts"])
def test_recipe_measures_a_clear_saving(variant: str) -> None:
    """Step 2's peak, ON (pools included) against OFF, by the page's ``step_peak_bytes``."""
    on = run_recipe(recipe()[variant], measure=2)
    off = run_reference(measure=2)
    assert_bitwise(on, off)
    stats = on[2].stats
    saving = off[2].peak - on[2].peak
    # The capacity model less one layer's reload (docs/design.md): OFF keeps cf·S of the marked
    # tensors, ON a pool of bf·S, and backward holds one layer's tensors at full size again.
    balanced_bytes = LAYERS * BALANCED * (2 * D + 4 * FFN) * 2  # S: bf16, balanced rows
    cf = R / BALANCED
    expected = (cf - BUFFER_FACTOR - cf / LAYERS) * balanced_bytes
    # Measured 1.23 MiB of 3.83 MiB (32 %; pools 0.70 MiB), 1.25 × the model: backward reloads
    # one node's tensors at a time, not a whole layer's at once.
    assert 0.9 <= saving / expected <= 1.4, (off[2].peak, on[2].peak, stats.pool_bytes, expected)
    assert saving > 0.3 * off[2].peak


def test_without_markers_the_scope_stashes_nothing() -> None:
    """The markers are what pages: a scope around the unmodified forward keeps every saved
    tensor at full size (still bitwise, since nothing changes) and never allocates a pool, so
    step 2's peak is the reference's (measured: 3.83 MiB both, 24 bytes apart)."""
    on = run_recipe(ScopeWithoutMarkers, measure=2)
    off = run_reference(measure=2)
    assert_bitwise(on, off)
    for result in on:
        assert result.stats.stashes == result.stats.pops == 0
        assert result.stats.pool_pages == {} and result.stats.mode is StashMode.CAPTURE
    assert abs(on[2].peak - off[2].peak) < 0.01 * off[2].peak


def test_overflow_is_rerun_without_the_stash_and_stays_bitwise() -> None:
    """A pool at half the balanced pages overflows at the first paged step: the runner reruns
    it with the stash off, and the step's result is still the reference's."""
    on = run_recipe(recipe()["GroupedExperts"], steps=2, buffer_factor=0.5, grow_pool=False)
    assert_bitwise(on, run_reference(steps=2))
    capture, paged = on[0].record, on[1].record
    assert capture.attempt == 1 and capture.enabled
    assert paged.attempt == 2 and paged.stash_overflow_ranks == 1 and not paged.enabled
