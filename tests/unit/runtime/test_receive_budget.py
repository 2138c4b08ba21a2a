"""PagedStashRunner with a real ReceiveBudget (HybridEP's counters) in one process: the flag
reruns, the rerun's measured peak sizes the budget, ``max_capacity_factor`` bounds it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from te_paged.config import MoEConfig
from te_paged.moe import PagedStashParticipant, ReceiveBudget, kept_per_expert
from te_paged.runtime import CapacityLimitError, PagedStashRunner
from te_paged.stash import PagedStashManager

TOKENS, TOPK, EXPERTS = 16, 2, 4  # balanced: 32 rows a rank


def budget_config(factor: float) -> MoEConfig:
    return MoEConfig(
        hidden_size=8,
        moe_ffn_hidden_size=8,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_expert_rank_capacity_factor=factor,
        moe_paged_stash=True,
    )


class FrameworkDispatcher(nn.Module, PagedStashParticipant):
    """What a framework's HybridEP dispatch tells te_paged: the demand per expert, the buffer
    rows of its budget rule, and a device flag when the demand passed them."""

    def __init__(self, factor: float, max_factor: float | None = None) -> None:
        super().__init__()
        self.budget = ReceiveBudget(
            budget_config(factor), None, max_factor=max_factor,
            rank_budget=lambda n, f: int(n * TOPK * f), factor_name="receive_factor",
        )  # fmt: skip
        self.seen: list[tuple[int, list[int]]] = []

    def budget_dispatchers(self):
        return (self.budget,)

    def forward(self, x: torch.Tensor, demand: torch.Tensor) -> torch.Tensor:
        b = self.budget
        rows = int(TOKENS * TOPK * 8) if b.dropless else b.rank_budget(TOKENS, b.capacity_factor)
        over = None if b.dropless else (demand.sum() > rows).to(torch.int32).reshape(1)
        b.note_dispatch(TOKENS, rows, demand, over, 4 * x.shape[-1])
        kept = kept_per_expert(demand, rows)
        self.seen.append((rows, kept.tolist()))
        return x * kept.sum()


def run(layer: FrameworkDispatcher, demands, **kw):
    manager = PagedStashManager.from_config(budget_config(2.0))
    runner = PagedStashRunner(layer, manager, **kw)
    records = []
    for d in demands:
        x = torch.ones(2, 8, requires_grad=True)
        _, rec = runner.step(lambda x=x, d=d: layer(x, torch.tensor(d)).sum().backward())
        records.append(rec)
    return records


def test_a_step_over_the_receive_budget_reruns_and_the_budget_grows() -> None:
    layer = FrameworkDispatcher(1.0)  # 32 rows
    recs = run(layer, [[10, 10, 10, 10], [12, 12, 12, 2], [12, 12, 12, 2]])
    assert [r.attempt for r in recs] == [2, 1, 1]
    # the failed attempt kept 32 of the 40 rows; the dropless rerun measured 40
    assert layer.seen[0] == (32, [10, 10, 10, 2]) and layer.seen[1][1] == [10, 10, 10, 10]
    assert recs[0].peak_tokens == 40 and recs[0].suggested_capacity_factor == 1.25
    # 40 x 1.10 = 44 rows: factor 1.38 (int(16 x 2 x 1.38) = 44)
    assert recs[0].capacity_growth == {
        "factor": "receive_factor", "from": 1.0, "to": 1.38, "needed": 1.25, "why": "over budget",
    }  # fmt: skip
    assert layer.budget.capacity_factor == 1.38 and layer.seen[2][0] == 44
    assert recs[1].capacity_growth == {}


def test_without_growth_every_such_step_reruns() -> None:
    layer = FrameworkDispatcher(1.0)
    recs = run(layer, [[10, 10, 10, 10]] * 3, grow_capacity=False)
    assert [r.attempt for r in recs] == [2, 2, 2]
    assert layer.budget.capacity_factor == 1.0


def test_the_budgets_own_ceiling_and_the_users_limit() -> None:
    capped = FrameworkDispatcher(1.0, max_factor=1.2)  # torchtitan's kind: 1.0 is its worst case
    rec = run(capped, [[10, 10, 10, 10]])[0]
    assert rec.capacity_growth["to"] == 1.2 and capped.budget.capacity_factor == 1.2
    limited = FrameworkDispatcher(1.0)
    with pytest.raises(
        CapacityLimitError,
        match=r"step 0: a rank was sent up to 40 rows, which "
        r"needs receive_factor >= 1.25, more than max_capacity_factor=1.1",
    ):
        run(limited, [[10, 10, 10, 10]], max_capacity_factor=1.1)


def test_receive_budget_refuses_to_dispatch() -> None:
    b = FrameworkDispatcher(1.0).budget
    assert b.receive_budget and b.a2a_capacity_factor is None
    with pytest.raises(TypeError, match="its framework's dispatcher does"):
        b.dispatch()
    with pytest.raises(TypeError, match="its framework's dispatcher does"):
        b.combine()


class StaticRerunDispatcher(FrameworkDispatcher):
    """NCCL EP's kind: the rerun keeps a static budget, sized from the demand the runner hands
    over (``rerun_rows``); the demand itself is reported (``demanded``), not only the kept rows.
    ``rerun_short`` rows fewer than that in the rerun stand for a routing that changed."""

    def __init__(self, factor: float, rerun_short: int = 0) -> None:
        super().__init__(factor)
        self.budget.static_rerun = True
        self.rerun_short = rerun_short

    def forward(self, x: torch.Tensor, demand: torch.Tensor) -> torch.Tensor:
        b = self.budget
        rows = b.rank_budget(TOKENS, b.capacity_factor)
        if b.dropless:
            rows = max(rows, b.rerun_rows - self.rerun_short)
        asked = demand.sum().reshape(1)
        kept = kept_per_expert(demand, rows)
        b.note_dispatch(TOKENS, rows, kept, asked > rows, 4 * x.shape[-1], demanded=asked)
        self.seen.append((rows, kept.tolist()))
        return x * kept.sum()


def test_a_budget_static_in_the_rerun_gets_the_failed_attempts_demand() -> None:
    layer = StaticRerunDispatcher(1.0)  # 32 rows
    recs = run(layer, [[10, 10, 10, 10], [12, 12, 12, 2]])
    assert [r.attempt for r in recs] == [2, 1]
    # the attempt kept 32 rows but reported the 40 demanded: the rerun holds exactly those
    assert layer.budget.rerun_rows == 40 and layer.seen[1] == (40, [10, 10, 10, 10])
    assert recs[0].capacity_growth["to"] == 1.38 and layer.seen[2][0] == 44


def test_a_rerun_that_still_drops_is_not_kept() -> None:
    layer = StaticRerunDispatcher(1.0, rerun_short=1)
    with pytest.raises(RuntimeError, match="rerun went over"):
        run(layer, [[10, 10, 10, 10]])


def test_microbatches_of_different_sizes_size_the_budget_from_their_largest_share() -> None:
    # Two microbatches a step: 8 tokens asking 24 rows of one rank (1.5x its balanced 16) and
    # 32 tokens asking 64 (1.0x). The largest rows (64) came with the larger microbatch, so
    # sizing from rows against the last microbatch's count would keep factor 1.0 and rerun
    # every step; the share (1.5) x headroom fits both.
    layer = FrameworkDispatcher(1.0)

    def step(x: torch.Tensor) -> None:
        b = layer.budget
        total = x.new_zeros(())
        for n, demand in ((8, [24, 0, 0, 0]), (32, [16, 16, 16, 16])):
            demand = torch.tensor(demand)
            rows = n * TOPK * 8 if b.dropless else b.rank_budget(n, b.capacity_factor)
            over = None if b.dropless else (demand.sum() > rows).to(torch.int32).reshape(1)
            b.note_dispatch(n, rows, demand, over, 4 * x.shape[-1])
            total = total + (x * kept_per_expert(demand, rows).sum()).sum()
        total.backward()

    runner = PagedStashRunner(layer, PagedStashManager.from_config(budget_config(2.0)))
    records = [runner.step(lambda: step(torch.ones(2, 8, requires_grad=True)))[1]
               for _ in range(3)]  # fmt: skip
    assert [r.attempt for r in records] == [2, 1, 1], [r.capacity_growth for r in records]
    assert records[0].microbatch_tokens == [8, 32]
    assert records[0].capacity_growth["needed"] == 1.5, records[0].capacity_growth
    assert layer.budget.capacity_factor == 1.66  # 96 rows at 32 tokens x 1.10: 106 rows
