"""Multi-rank cases of the paged-stash runner, on 4 ranks (``torchrun`` or ``forkrun``):

    python -m torch.distributed.run --nproc_per_node=4 -m functional_tests.runner_worker --out DIR

Each rank writes ``DIR/rank{r}.json`` with its observations; ``test_runner_multirank.py``
launches this and asserts on them. Every case builds fresh models from seeds, so cases cannot
leak state into each other. Cases 1-7 put the all-to-all's wire budget at the expert buffer's
factor (they test the per-pair budget at a stated factor); case 8 tests the wire's own; case 9
``max_pool_bytes`` that only some ranks' pools pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from te_paged.runtime import (
    CapacityLimitError,
    FallbackLimitError,
    PagedStashRunner,
    PoolLimitError,
)
from te_paged.runtime.planner import RoutingProfile, recommend
from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

BASE = ModelConfig(
    layers=3,
    experts=8,
    topk=2,
    hidden=32,
    ffn=64,
    tokens=32,
    page_size=8,
    capacity_factor=2.0,
    steps=3,
    seed=5,
)


def train(
    cfg: ModelConfig,
    *,
    paged: bool,
    dropless: bool = False,
    skew_rank: int | None = None,
    max_fallbacks: int = 3,
    record_routing: bool = False,
    capture_at_factor: bool = False,
    auto_wire: bool = False,
    **runner_kw: object,
) -> dict:
    if cfg.a2a_capacity_factor is None and not auto_wire:  # cases 1-7: the wire at the expert
        # buffer's factor
        cfg = dataclasses.replace(cfg, a2a_capacity_factor=cfg.capacity_factor)
    group = dist.group.WORLD
    rank = dist.get_rank()
    model = ToyMoEModel(cfg, paged=paged, group=group)
    if dropless:
        for layer in model.layers:
            layer.set_dropless(True)
    if skew_rank == rank:
        for layer in model.layers:
            layer.router.set_skew([0, 1], 50.0)
    runner = PagedStashRunner(
        model,
        model.manager,
        group=group,
        max_consecutive_fallbacks=max_fallbacks,
        record_routing=record_routing,
        **runner_kw,
    )
    out: dict = {"loss": [], "grad_norm": [], "records": [], "grads": [], "stats": []}
    for step in range(cfg.steps):
        x, target = make_batch(cfg, step, rank)
        model.zero_grad(set_to_none=False)

        def fn(x=x, target=target):
            loss = model(x, target)
            loss.backward()
            return loss.detach()

        # capture_at_factor: no growth after the capture step, so the pools start at the
        # factor's size (a tiny one overflows) instead of at the capture step's peak.
        grow = runner.grow_pool
        runner.grow_pool = grow and not (capture_at_factor and step == 0)
        try:
            loss, record = runner.step(fn)
        except (FallbackLimitError, CapacityLimitError, PoolLimitError) as e:
            out["raised"] = f"{type(e).__name__}: {e}"
            break
        runner.grow_pool = grow
        runner.grow_pool = grow
        grads = [p.grad.clone() for p in model.parameters()]
        out["loss"].append(float(loss))
        out["grad_norm"].append(float(torch.stack([g.norm() for g in grads]).norm()))
        out["records"].append(dataclasses.asdict(record))
        out["grads"].append(grads)
        if model.manager is not None:
            s = model.manager.stats()
            out["stats"].append({"stashes": s.stashes, "pops": s.pops, "overflow": s.overflow,
                                 "pool_bytes": s.pool_bytes})  # fmt: skip
    if record_routing:
        out["profile"] = dataclasses.asdict(runner.routing_profile())
    return out


def same(a: dict, b: dict) -> bool:
    """Losses, grad norms and every gradient of every step bitwise equal."""
    if a["loss"] != b["loss"] or a["grad_norm"] != b["grad_norm"]:
        return False
    return all(torch.equal(x, y) for ga, gb in zip(a["grads"], b["grads"]) for x, y in zip(ga, gb))


def summary(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "grads"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    res: dict = {}
    try:
        ref = train(BASE, paged=False, dropless=True)  # the dropless reference
        # 1. in budget: ON vs OFF
        on, off = train(BASE, paged=True), train(BASE, paged=False)
        res["in_budget"] = {"on_equals_off": same(on, off), "on": summary(on), "off": summary(off)}
        # 2. ON vs the dropless reference (same arithmetic: each expert sees the same rows)
        res["on_equals_dropless"] = same(on, ref)
        # 3. rank 0 forced over its budget
        skewed_ref = train(BASE, paged=False, dropless=True, skew_rank=0)
        over = train(BASE, paged=True, skew_rank=0)
        fit = over["records"][0]["suggested_capacity_factor"]
        refit = train(dataclasses.replace(BASE, capacity_factor=fit), paged=True, skew_rank=0)
        res["over_budget"] = {
            "equals_reference": same(over, skewed_ref),
            "run": summary(over),
            "refit": summary(refit),
            "fit": fit,
        }
        # 4. stash overflow: host spill off (rerun), then on (no rerun)
        tiny = dataclasses.replace(BASE, buffer_factor_cuda=0.2)
        spill_off = train(tiny, paged=True, capture_at_factor=True)
        host_tier = dataclasses.replace(tiny, buffer_factor_cpu=2.0)
        spill_on = train(host_tier, paged=True, grow_pool=False)  # kept small: it spills
        res["overflow"] = {
            "off_equals_reference": same(spill_off, ref),
            "on_equals_reference": same(spill_on, ref),
            "spill_off": summary(spill_off),
            "spill_on": summary(spill_on),
        }
        # 4b. the same overflow with the pools kept at their size: every step reruns
        kept = train(tiny, paged=True, grow_pool=False)
        res["overflow"]["kept"] = summary(kept)
        res["overflow"]["kept_equals_reference"] = same(kept, ref)
        # 4c. pool sizes: from the observed peak (factor -1), which differs by rank; agreed
        #     across the expert-parallel group (the default) or each rank's own
        observed = dataclasses.replace(BASE, buffer_factor_cuda=-1.0)
        res["pool_sizes"] = {
            "agreed": summary(train(observed, paged=True)),
            "per_rank": summary(train(observed, paged=True, per_rank_pools=True)),
        }
        # 5. MXFP8 and moe_act recompute: ON vs OFF
        mx = dataclasses.replace(BASE, fp8="mxfp8", recompute=True)
        mx_on, mx_off = train(mx, paged=True), train(mx, paged=False)
        res["mxfp8_recompute"] = {"on_equals_off": same(mx_on, mx_off), "on": summary(mx_on)}
        # 5b. ranks that hold different pool keys (ranks 2 and 3 store MXFP8: two more pools,
        #     data and scales) through forced overflows and an over-budget rerun: one
        #     reduction layout on every rank, each key's high-water mark from the ranks with it
        mixed = dataclasses.replace(BASE, fp8="mxfp8") if rank >= 2 else BASE
        mixed_ref = train(mixed, paged=False, dropless=True)
        mixed_overflow = train(
            dataclasses.replace(mixed, buffer_factor_cuda=0.2), paged=True, capture_at_factor=True
        )
        mixed_skewed_ref = train(mixed, paged=False, dropless=True, skew_rank=0)
        mixed_over = train(mixed, paged=True, skew_rank=0)
        mixed_on = train(dataclasses.replace(mixed, buffer_factor_cuda=3.0), paged=True)
        res["mixed_keys"] = {
            "overflow_equals_reference": same(mixed_overflow, mixed_ref),
            "over_budget_equals_reference": same(mixed_over, mixed_skewed_ref),
            "on_equals_reference": same(mixed_on, mixed_ref),
            "overflow": summary(mixed_overflow),
            "over_budget": summary(mixed_over),
            "on": summary(mixed_on),
        }
        # 6. repeated forced overflow: the runaway guard
        guard = train(dataclasses.replace(BASE, steps=4), paged=True, skew_rank=0, max_fallbacks=2)
        res["guard"] = summary(guard)
        # 7. a profile recorded under a skew sizes the per-pair budget exactly; the per-rank
        #    totals alone give a lower bound that still reruns
        roomy = dataclasses.replace(BASE, buffer_factor_cuda=3.0)  # no stash overflow here
        recorded = train(
            dataclasses.replace(roomy, capacity_factor=8.0),
            paged=True,
            skew_rank=0,
            record_routing=True,
        )
        profile = RoutingProfile(**recorded["profile"])
        totals = dataclasses.replace(profile, tokens_by_source=None)
        exact = recommend(profile, 0.0).capacity_factor
        lower = recommend(totals, 0.0).capacity_factor
        at = {
            name: summary(
                train(dataclasses.replace(roomy, capacity_factor=cf), paged=True, skew_rank=0)
            )
            for name, cf in (("exact", exact), ("lower", lower))
        }
        res["plan"] = {
            "recorded": summary(recorded),
            "exact": exact,
            "lower": lower,
            "at_exact": at["exact"],
            "at_lower": at["lower"],
        }
        # 8. the wire below the expert buffer: from a2a_capacity_factor 1.0 the runner raises
        #    it after the step that went over it; without grow_capacity every step reruns; a
        #    need past max_capacity_factor raises on every rank
        narrow = dataclasses.replace(BASE, a2a_capacity_factor=1.0, steps=4)
        wide = dataclasses.replace(BASE, steps=4)  # the wire at the expert buffer's factor
        wire_ref = train(dataclasses.replace(narrow, capacity_factor=2.0), paged=False,
                         dropless=True)  # fmt: skip
        sized = train(narrow, paged=True)
        fixed = train(narrow, paged=True, grow_capacity=False, max_fallbacks=10)
        res["wire"] = {
            "sized": summary(sized),
            "fixed": summary(fixed),
            "wide": summary(train(wide, paged=True)),
            "sized_equals_reference": same(sized, wire_ref),
            "fixed_equals_reference": same(fixed, wire_ref),
            "limited": summary(train(narrow, paged=True, max_capacity_factor=1.05)),
            # the auto wire (no a2a_capacity_factor): steps 0-1 at the expert factor, then
            # sized from their largest demand
            "auto": summary(auto := train(wide, paged=True, auto_wire=True, auto_wire_steps=2)),
            "auto_equals_reference": same(auto, wire_ref),
        }
        # 9. max_pool_bytes passed on some ranks only: ranks 0 and 1 plan more pool bytes than
        #    2 and 3 (whose MXFP8 rows are 1 byte, not 4); a bound at the smallest rank's pools
        #    raises PoolLimitError on every rank at the capture step, before any allocation,
        #    naming the ranks past it
        limited = dataclasses.replace(mixed, steps=2)
        free = train(limited, paged=True, grow_pool=False, per_rank_pools=True)
        mine = free["stats"][-1]["pool_bytes"]
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        bound = min(every)
        # The capture step alone: a rank that did not raise then reaches the gather below at
        # once, and the test names it, instead of running on into a collective the others
        # never join (gloo's timeout, minutes later).
        bounded = train(
            dataclasses.replace(limited, steps=1), paged=True, grow_pool=False,
            per_rank_pools=True, max_pool_bytes=bound,
        )  # fmt: skip
        raised: list = [None] * dist.get_world_size()
        dist.all_gather_object(raised, "raised" in bounded)
        res["pool_limit"] = {
            "pool_bytes": every, "bound": bound, "run": summary(bounded),
            "raised_ranks": [r for r, yes in enumerate(raised) if yes],
        }  # fmt: skip
    finally:
        (args.out / f"rank{rank}.json").write_text(json.dumps(res, default=str))
        dist.barrier()  # leave together: gloo torn down under a talking peer can abort
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
