"""The auto wire's warm-up in one process: the runner watches the largest pair demand while it
rises and sizes the wire once, at the first step whose demand is not above the peak before it
(or at ``auto_wire_steps``), from that peak x ``capacity_headroom``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from te_paged.config import MoEConfig
from te_paged.moe import PagedStashParticipant, StaticBudgetDispatcher, static_budget
from te_paged.moe.dispatcher import SHARE_ONE
from te_paged.runtime import PagedStashRunner
from te_paged.stash import PagedStashManager

TOKENS, TOPK, RANKS = 128, 2, 4  # a balanced pair: 128 x 2 / 4 = 64 rows


def wire_config() -> MoEConfig:
    return MoEConfig(
        hidden_size=8,
        moe_ffn_hidden_size=8,
        num_moe_experts=8,
        moe_router_topk=TOPK,
        moe_expert_rank_capacity_factor=2.0,
        moe_paged_stash=True,
    )


class PairDemand(nn.Module, PagedStashParticipant):
    """A wire dispatcher of a four-rank group whose exchange is skipped: each step reports
    a given largest pair demand, as a dispatch would."""

    def __init__(self) -> None:
        super().__init__()
        self.wire = StaticBudgetDispatcher(wire_config(), a2a_capacity_factor=None)
        self.wire.ep_size = RANKS  # sized as one of four ranks; nothing is exchanged
        self.factors: list[float] = []

    def budget_dispatchers(self):
        return (self.wire,)

    def forward(self, x: torch.Tensor, pair_demand: int) -> torch.Tensor:
        w = self.wire
        # a group's wire_capacity(TOKENS): the pair share at the wire's factor
        pair = static_budget(w.config, TOKENS, RANKS, capacity_factor=w.a2a_capacity_factor)[1]
        w.last_num_tokens, w.pair_capacity = TOKENS, pair
        w.peak_pair_tokens.fill_(pair_demand)
        w.peak_pair_share.fill_(-(-pair_demand * RANKS * SHARE_ONE // (TOKENS * TOPK)))
        w.over_budget.fill_(int(pair_demand > w.pair_capacity))
        self.factors.append(w.a2a_capacity_factor)
        return x * 2


def run(demands: list[int], **kw) -> tuple[PairDemand, list]:
    layer = PairDemand()
    runner = PagedStashRunner(layer, PagedStashManager.from_config(wire_config()), **kw)
    records = []
    for d in demands:
        x = torch.ones(2, 8, requires_grad=True)
        _, rec = runner.step(lambda x=x, d=d: layer(x, d).sum().backward())
        records.append(rec)
    return layer, records


def test_sized_at_the_first_step_whose_demand_does_not_rise() -> None:
    layer, recs = run([70, 69, 70, 72, 72])
    assert layer.factors[:2] == [2.0, 2.0]  # step 0 watched; step 1 (69 <= 70) sizes it
    assert recs[0].capacity_growth == {}
    # 70 x 1.10 = 77 rows a pair: factor 77 x 4 / 256 = 1.21 (pair capacity 77)
    assert recs[1].capacity_growth == {
        "factor": "a2a_capacity_factor", "from": 2.0, "to": 1.21, "needed": 1.1, "why": "warm-up",
    }  # fmt: skip
    assert layer.factors[2:] == [1.21, 1.21, 1.25] and all(r.attempt == 1 for r in recs)
    assert not layer.wire.wire_auto
    # then as with a factor you give: 72 x 1.10 = 80 rows do not fit 77, so it grows ahead
    # (why "capture": nothing stashes here, so the manager never leaves its capture step)
    assert recs[3].capacity_growth["to"] == 1.25 and recs[3].capacity_growth["why"] != "warm-up"


def test_a_rising_demand_keeps_the_wire_wide_until_it_settles() -> None:
    layer, recs = run([40, 55, 70, 70, 71])  # the routers learning: 40 -> 55 -> 70
    assert layer.factors[:4] == [2.0, 2.0, 2.0, 2.0]
    assert [bool(r.capacity_growth) for r in recs[:3]] == [False, False, False]
    assert recs[3].capacity_growth["why"] == "warm-up" and recs[3].capacity_growth["to"] == 1.21
    assert layer.factors[4] == 1.21 and all(r.attempt == 1 for r in recs)


def test_auto_wire_steps_bounds_the_warm_up() -> None:
    layer, recs = run([40, 50, 60, 70, 70], auto_wire_steps=3)
    growth = recs[2].capacity_growth  # still rising at step 2: sized from 60 anyway
    assert growth["why"] == "warm-up" and growth["to"] == 1.04  # 60 x 1.10 = 66 rows
    assert layer.factors[3] == 1.04
    # step 3's 70 rows go over the 66-row wire: a rerun, and the wire grows to hold them
    assert recs[3].attempt == 2 and recs[3].capacity_growth["why"] == "over budget"


@pytest.mark.parametrize("demands", [[70, 69], [70, 70]])
def test_without_grow_capacity_the_auto_wire_stays_at_the_expert_factor(demands) -> None:
    layer, _ = run([*demands, 70], grow_capacity=False)
    assert layer.factors == [2.0, 2.0, 2.0] and layer.wire.wire_auto
