"""A rerun restores everything the failed attempt changed: module buffers (running statistics),
delayed-scaling FP8 state (a stand-in for Transformer Engine's ``fp8_meta``) and ``Restorable``
objects; what it could not restore it names."""

from __future__ import annotations

import logging
import types

import pytest
import torch
from torch import nn

from te_paged.runtime import PagedStashRunner
from te_paged.runtime.step_state import ModuleState, Restorable
from te_paged.stash import PagedStashManager

from ..moe.harness import ROWS, config
from .test_runner import FakeMoELayer


class RunningStats(nn.Module):
    """BatchNorm-like: normalises with its running mean, which forward updates in place."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.running_mean


class DelayedScalingFp8(nn.Module):
    """Transformer Engine's delayed scaling, reduced to its state: ``fp8_meta`` holds an amax
    history (rolled and appended every forward) and the scale computed from it, which scales
    this forward's output."""

    def __init__(self, history: int = 4) -> None:
        super().__init__()
        meta = types.SimpleNamespace(amax_history=torch.zeros(history), scale=torch.ones(1))
        self.fp8_meta = {"scaling_fwd": meta, "recipe": "delayed"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        meta = self.fp8_meta["scaling_fwd"]
        out = x * meta.scale
        with torch.no_grad():
            meta.amax_history.copy_(meta.amax_history.roll(1))
            meta.amax_history[0] = x.abs().max()
            meta.scale.copy_(448.0 / meta.amax_history.max().clamp(min=1.0))
        return out


class StepCounter(nn.Module):
    """A Restorable module: state kept outside tensors, which a forward changes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * (1.0 + 0.01 * self.calls)

    def snapshot(self) -> int:
        return self.calls

    def restore(self, state: int) -> None:
        self.calls = state


class WarmsUpLate(nn.Module):
    """A buffer that stays untouched for the first step and changes from the second on."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.register_buffer("ema", torch.zeros(hidden))
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        if self.seen > 1:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(x.mean(0))
        return x + self.ema


class StatefulModel(nn.Module):
    def __init__(self, late: bool = False) -> None:
        super().__init__()
        cfg = config(moe_paged_stash=True)
        self.manager = PagedStashManager.from_config(cfg)
        self.stats = RunningStats(32)
        self.fp8 = DelayedScalingFp8()
        self.counter = StepCounter()
        self.late = WarmsUpLate(32) if late else None
        self.moe = nn.ModuleList([FakeMoELayer(cfg, self.manager) for _ in range(2)])

    def forward(self, x, tokens, probs):
        h = self.fp8(self.stats(x))
        if self.late is not None:
            h = self.late(h)
        for layer in self.moe:
            h = layer(h, tokens, probs)
        return self.counter(h)


def make(late: bool = False) -> tuple[StatefulModel, PagedStashRunner]:
    torch.manual_seed(0)
    model = StatefulModel(late)
    return model, PagedStashRunner(model, model.manager, measure_fallback_memory=False)


def step_fn(model: StatefulModel, step: int):
    def fn():
        g = torch.Generator().manual_seed(step)
        x = torch.randn(ROWS, 32, generator=g)
        probs = torch.rand(ROWS, generator=g)
        tokens = torch.tensor([10, 0, 7, 13] if step % 2 == 0 else [1, 20, 5, 3])
        loss = model(x, tokens, probs).square().sum()
        loss.backward()
        return loss.detach()

    return fn


def state_of(model: StatefulModel) -> list[torch.Tensor]:
    """Everything a step leaves behind: gradients, buffers, the FP8 meta, the counter."""
    meta = model.fp8.fp8_meta["scaling_fwd"]
    return [
        *(p.grad.clone() for p in model.parameters()),
        *(b.clone() for b in model.buffers()),
        meta.amax_history.clone(),
        meta.scale.clone(),
        torch.tensor(model.counter.calls),
    ]


def train(forced_steps: set[int], steps: int = 3, late: bool = False):
    model, runner = make(late)
    states, records = [], []
    for step in range(steps):
        model.zero_grad()
        for layer in model.moe:
            layer.dispatcher.force_over_budget = step in forced_steps
        _, record = runner.step(step_fn(model, step))
        states.append(state_of(model))
        records.append(record)
    return states, records


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_forced_rerun_restores_buffers_fp8_state_and_restorables() -> None:
    reference, ref_records = train(forced_steps=set())
    forced, records = train(forced_steps={0, 2})
    assert [r.attempt for r in ref_records] == [1, 1, 1]
    assert [r.attempt for r in records] == [2, 1, 2]
    for step, (a, b) in enumerate(zip(forced, reference)):
        assert same(a, b), step
    assert all(r.unrestored_state == [] for r in records)


@pytest.mark.parametrize("what", ["buffers", "fp8", "restorables"])
def test_without_the_restore_the_rerun_differs(monkeypatch, what: str) -> None:
    reference, _ = train(forced_steps=set())
    original = ModuleState.restore

    def partial_restore(self, snap):
        if what == "buffers":
            snap.buffers = {}
        elif what == "fp8":
            snap.fp8 = {}
        else:
            self.restorables = []
            snap.restorables = []
        return original(self, snap)

    monkeypatch.setattr(ModuleState, "restore", partial_restore)
    forced, _ = train(forced_steps={0, 2})
    assert not same(forced[0], reference[0])


def test_a_buffer_changing_first_in_a_rerun_step_is_named_and_tracked_after(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="te_paged.runtime.runner")
    _, records = train(forced_steps={1, 2}, late=True)
    # Step 0 left late.ema alone, so step 1 did not copy it: it cannot be put back.
    assert records[1].attempt == 2 and records[1].unrestored_state == ["0.late.ema"]
    assert "0.late.ema" in caplog.text and "not exactly the step" in caplog.text
    # From then on it is copied: step 2's rerun restores it.
    assert records[2].attempt == 2 and records[2].unrestored_state == []
    assert '"unrestored_state": ["0.late.ema"]' in records[1].to_json()


def test_steady_state_copies_only_the_buffers_a_step_changes() -> None:
    model, runner = make()
    model.register_buffer("constant", torch.arange(1000.0))  # never written
    first = runner.module_state.snapshot()
    assert "0.constant" in first.buffers  # nothing known yet: everything
    runner.step(step_fn(model, 0))
    later = runner.module_state.snapshot()
    assert "0.constant" not in later.buffers and "0.stats.running_mean" in later.buffers


def test_restorables_outside_the_model_and_refusal_of_others() -> None:
    class Outside:
        def __init__(self) -> None:
            self.value = 1

        def snapshot(self) -> int:
            return self.value

        def restore(self, state: int) -> None:
            self.value = state

    outside = Outside()
    assert isinstance(outside, Restorable)
    model, _ = make()
    state = ModuleState([model], [outside])
    snap = state.snapshot()
    outside.value = 5
    state.restore(snap)
    assert outside.value == 1
    with pytest.raises(TypeError, match="is not Restorable: it needs snapshot"):
        ModuleState([model], [object()])
