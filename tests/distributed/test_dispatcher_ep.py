"""Expert parallelism over 4 gloo ranks, in one launch (rank start-up dominates the time).

Cases, each checked per rank in the parent from what the ranks saved:

1. identity experts: dispatch → combine gives every token its K copies back, and each rank's
   ``tokens_per_expert`` is the global count of its experts;
2. ``MoELayer``, skewed but within budget: static vs dropless outputs, input gradients and
   every parameter gradient bitwise equal, no flag;
3. rank 0 forced over budget: the flag and the drops are on rank 0 only, its dropped tokens
   lose exactly their contributions, and the suggested capacity factor is the one that fits;
4. ``MoELayer`` EP=4 vs the same seeded model at EP=1 in this process on the concatenated
   batch: outputs, input gradients and expert gradients bitwise equal (each expert sees the
   same rows in the same order: (source rank, token, k) is the global token order); the
   router weight gradient to a stated tolerance (a sum of 4 per-rank GEMMs vs one GEMM over
   all tokens: a different fp32 reduction order).
5. the wire below the expert buffer (``a2a_capacity_factor`` set to what the routing needs,
   agreed by an ``all_reduce(MAX)``): the same outputs and gradients, bit for bit, as with the
   wire at the expert buffer's factor, the expert buffer's shape unchanged, and the bytes
   counted: ``4 exchanges × P·C`` rows (plus metadata) sent, the dropless reference ``4 ×``
   the routed rows.

Cases 1-4 set the wire to the expert buffer's factor (``moe_a2a_capacity_factor=2.0``): they
test the per-pair budget at a stated factor.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from te_paged.config import MoEConfig
from te_paged.moe import MoELayer, StaticBudgetDispatcher

from .spawn import run_ranks

WORLD, E, H, K, N, SEED = 4, 8, 32, 2, 24, 11
pytestmark = pytest.mark.timeout(180)


def make_config(ep: int, **kw) -> MoEConfig:
    base = {
        "hidden_size": H,
        "moe_ffn_hidden_size": 64,
        "num_moe_experts": E,
        "moe_router_topk": K,
        "moe_expert_rank_capacity_factor": 2.0,
        "moe_a2a_capacity_factor": 2.0,
        "expert_model_parallel_size": ep,
    }
    return MoEConfig(**{**base, **kw})


def rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(N, H, generator=g), torch.randn(N, H, generator=g)


def run_layer(layer: MoELayer, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    (y * dy).sum().backward()
    out = {"y": y.detach(), "dx": x.grad}
    out.update({name: p.grad.clone() for name, p in layer.named_parameters()})
    layer.zero_grad(set_to_none=True)
    return out


def counters(disp: StaticBudgetDispatcher) -> dict[str, int]:
    names = ("over_budget", "dropped_tokens", "peak_tokens", "peak_pair_tokens")
    return {name: int(getattr(disp, name)) for name in names}


def _worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    # A file store in the test's folder: no port to pick (one found free can be taken by a
    # launch running beside the test before the store binds it).
    dist.init_process_group(
        "gloo",
        init_method=(Path(out_dir) / "store").as_uri(),
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        group, res = dist.group.WORLD, {}
        cfg = make_config(WORLD)
        x, dy = rank_inputs(rank)
        g = torch.Generator().manual_seed(rank)

        # 1. identity experts.
        disp = StaticBudgetDispatcher(cfg, group)
        indices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
        probs = torch.rand(N, K, generator=g)
        xi = x.clone().requires_grad_()
        rows, tpe, probs_T, handle = disp.dispatch(xi, probs, indices)
        y = disp.combine(rows, handle)
        y.backward(dy)
        res["identity"] = {"indices": indices, "probs": probs, "tpe": tpe, "y": y.detach(),
                           "dx": xi.grad, "rows": rows.detach(), "probs_T": probs_T,
                           **counters(disp)}  # fmt: skip

        # 2. static vs dropless, skewed toward rank 1's experts but within budget.
        layer = MoELayer(cfg, group, seed=SEED)
        layer.router.set_skew([2, 3], 0.1)  # rank 3 → rank 1: 24 of 24
        static = run_layer(layer, x, dy)
        flags = counters(layer.dispatcher)
        layer.set_dropless(True)
        dropless = run_layer(layer, x, dy)
        layer.set_dropless(False)
        res["parity"] = {"static": static, "dropless": dropless, **flags,
                         "pair_capacity": layer.dispatcher.pair_capacity}  # fmt: skip

        # 3. rank 0 sends everything to rank 1's experts: 2x its pair capacity.
        layer.dispatcher.reset_flags()
        layer.router.set_skew([2, 3] if rank == 0 else None, 1e3)
        over = run_layer(layer, x, dy)
        flags = counters(layer.dispatcher)
        layer.set_dropless(True)
        ref = run_layer(layer, x, dy)
        layer.set_dropless(False)
        factor = layer.dispatcher.fitting_capacity_factor(N, flags["peak_pair_tokens"])
        res["over"] = {"y": over["y"], "ref": ref["y"], "factor": factor, **flags,
                       "after_dropless": counters(layer.dispatcher)}  # fmt: skip

        # 4. unskewed EP=4 run for the EP=1 comparison (made in the parent).
        layer.router.set_skew(None)
        layer.dispatcher.reset_flags()
        layer.dispatcher.reset_traffic()
        res["ep"] = {"x": x, "dy": dy, **run_layer(layer, x, dy), **counters(layer.dispatcher)}

        # 5. the wire at what this routing needs (the group's peak pair), below the buffer.
        disp = layer.dispatcher
        peak = disp.peak_pair_tokens.clone()
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        wide = {"bytes": disp.bytes_sent, "rows": disp.pair_capacity * WORLD}
        disp.reset_traffic()
        disp.set_a2a_capacity_factor(disp.fitting_capacity_factor(N, int(peak)))
        narrow = run_layer(layer, x, dy)
        res["wire"] = {"out": narrow, **counters(disp), "factor": disp.a2a_capacity_factor,
                       "rows": disp.pair_capacity * WORLD, "bytes": disp.bytes_sent,
                       "dropless_bytes": int(disp.dropless_bytes), "wide": wide,
                       "budget": disp.budget_tokens, "peak": int(peak)}  # fmt: skip
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(__name__, _worker, tmp_path_factory.mktemp("ep"), WORLD)


def expected_rows(ranks: list[dict], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and probabilities rank ``rank`` must hand its experts, in (local expert, source
    rank, token, k) order."""
    rows, probs = [], []
    for e in range(rank * E // WORLD, (rank + 1) * E // WORLD):
        for src, r in enumerate(ranks):
            x, indices, p = rank_inputs(src)[0], r["identity"]["indices"], r["identity"]["probs"]
            hits = [(n, k) for n in range(N) for k in range(K) if indices[n, k] == e]
            rows += [x[n] for n, _ in hits]
            probs += [p[n, k] for n, k in hits]
    return torch.stack(rows), torch.stack(probs)


def test_identity_exchange(ranks) -> None:
    all_indices = torch.cat([r["identity"]["indices"] for r in ranks])
    global_counts = torch.bincount(all_indices.flatten(), minlength=E)
    for rank, r in enumerate(ranks):
        res = r["identity"]
        x, dy = rank_inputs(rank)
        assert res["rows"].shape == (make_config(WORLD).max_num_tokens(N), H)  # 96 = 4 · 24
        assert torch.equal(res["tpe"], global_counts[rank * 2 : rank * 2 + 2])
        rows, probs = expected_rows(ranks, rank)
        real = rows.shape[0]
        assert torch.equal(res["rows"][:real], rows) and torch.equal(res["probs_T"][:real], probs)
        assert not res["rows"][real:].any() and not res["probs_T"][real:].any()
        assert torch.equal(res["y"], K * x) and torch.equal(res["dx"], K * dy)
        assert res["over_budget"] == 0 and res["peak_tokens"] == int(res["tpe"].sum())


def test_static_equals_dropless_per_rank(ranks) -> None:
    for r in ranks:
        res = r["parity"]
        assert res["over_budget"] == 0 and res["dropped_tokens"] == 0
        static, dropless = res["static"], res["dropless"]
        # y, dx, the router weight, FC1 and FC2 weights of the 2 local experts
        assert static.keys() == dropless.keys() and len(static) == 2 + 1 + 2 * E // WORLD
        for name in static:
            assert torch.equal(static[name], dropless[name]), name
        assert static["dx"].abs().max() > 0 and static["router.weight"].abs().max() > 0
    # The skew is real: rank 1's experts were asked for more than the balanced share.
    assert ranks[1]["parity"]["peak_tokens"] > N * K
    assert max(r["parity"]["peak_pair_tokens"] for r in ranks) > N * K // WORLD


def test_forced_over_budget_flags_only_that_rank(ranks) -> None:
    capacity = ranks[0]["parity"]["pair_capacity"]
    assert capacity == N * K * 2 // WORLD  # 24: rank 0 wants to send 48 to rank 1
    for rank, r in enumerate(ranks):
        res = r["over"]
        assert res["after_dropless"]["dropped_tokens"] == res["dropped_tokens"]  # dropless: 0
        if rank == 0:
            assert res["over_budget"] == 1 and res["dropped_tokens"] == N * K - capacity
            assert res["peak_pair_tokens"] == N * K and res["factor"] == 4.0
            kept = capacity // K  # (token, k) order: tokens 0..11 keep both, 12..23 lose both
            assert not res["y"][kept:].any() and res["ref"][kept:].abs().min() > 0
            # Kept rows: same expert rows, but the static GEMMs see fewer rows of rank 0 in
            # the groups than dropless does; fp32 GEMM blocking may differ with the row count.
            torch.testing.assert_close(res["y"][:kept], res["ref"][:kept], rtol=1e-6, atol=1e-6)
        else:
            assert res["over_budget"] == 0 and res["dropped_tokens"] == 0
    assert ranks[1]["over"]["peak_tokens"] > N * K  # rank 1 was asked for more than usual


def test_ep4_equals_ep1(ranks) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks ran single-threaded: same GEMM blocking
    try:
        layer = MoELayer(make_config(1), seed=SEED)
        x = torch.cat([r["ep"]["x"] for r in ranks])
        dy = torch.cat([r["ep"]["dy"] for r in ranks])
        ref = run_layer(layer, x, dy)
    finally:
        torch.set_num_threads(threads)
    assert all(r["ep"]["over_budget"] == 0 for r in ranks)
    assert torch.equal(torch.cat([r["ep"]["y"] for r in ranks]), ref["y"])
    assert torch.equal(torch.cat([r["ep"]["dx"] for r in ranks]), ref["dx"])
    local = E // WORLD
    for rank, r in enumerate(ranks):
        for name, grad in r["ep"].items():
            if name.startswith("experts.") and grad.dim() == 2:  # weight{j}: global expert
                fc, j = name.rsplit(".weight", 1)
                assert torch.equal(grad, ref[f"{fc}.weight{rank * local + int(j)}"]), name
    router = torch.stack([r["ep"]["router.weight"] for r in ranks]).sum(0)
    # Summing 4 per-rank GEMMs vs one GEMM over 96 tokens: fp32 reordering only.
    torch.testing.assert_close(router, ref["router.weight"], rtol=1e-5, atol=1e-7)


def test_wire_below_the_expert_buffer_changes_only_the_bytes(ranks) -> None:
    cfg = make_config(WORLD)
    row = H * 4  # fp32 rows of x and of the expert output
    for r in ranks:
        wire, wide = r["wire"], r["ep"]
        assert wire["over_budget"] == 0 and wire["budget"] == cfg.max_num_tokens(N)
        assert wire["factor"] < 2.0 and wire["rows"] < wire["wide"]["rows"] == cfg.max_num_tokens(N)
        assert wire["rows"] // WORLD >= wire["peak"]  # every pair fits
        for name, value in wire["out"].items():  # y, dx and every gradient: bit for bit
            assert torch.equal(value, wide[name]), name
        # x and y: dispatch and combine, forward and backward; probs twice; one metadata.
        meta = WORLD * (wire["rows"] // WORLD + 1) * 8
        assert wire["bytes"] == wire["rows"] * (4 * row + 2 * 4) + meta
        assert wire["dropless_bytes"] == N * K * (4 * row + 2 * 4)
        wide_meta = WORLD * (wire["wide"]["rows"] // WORLD + 1) * 8
        assert wire["wide"]["bytes"] == wire["wide"]["rows"] * (4 * row + 2 * 4) + wide_meta
