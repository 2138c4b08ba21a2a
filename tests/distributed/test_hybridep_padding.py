"""torchtitan's HybridEP dispatcher kept by te_paged, with ``pad_multiple``, on 4 gloo ranks.

HybridEP pads every local expert's block to ``pad_multiple`` rows, so factor 1.0 (torchtitan's
buffer of ``T·EP·min(L, K)`` rows) is not the worst case. Here every rank's 128 tokens choose
experts 0 and 1 (rank 0's) among their top 4: rank 0 receives 512 rows per expert, whose blocks
pad (to 24) to 2 x 528 = 1056 rows, past the 1032 of factor 1.0. Before: te_paged capped the
budget at 1.0, so every such step reran; now the budget's ceiling is the padded worst case
(:func:`~te_paged.integrations.torchtitan.hybridep.padded_worst_case_rows`) and the factor the
step needs (1.01) holds it. Dispatcher level: the runner's growth over a full torchtitan step is
functional_tests/torchtitan/test_torchtitan_hybridep.py.
"""

from __future__ import annotations

import datetime
import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")

from te_paged.integrations.torchtitan.hybridep import padded_worst_case_rows

from .spawn import run_ranks

WORLD, EXPERTS, TOPK, TOKENS, PAD, WIDTH = 4, 8, 4, 128, 24, 16
pytestmark = pytest.mark.timeout(180)


def test_the_padded_worst_case_is_the_largest_padded_demand() -> None:
    # Brute force over every per-expert count a rank's local experts can get (each at most
    # the N tokens that can reach it, together at most N·min(L, K)).
    for n, local, topk, pad in itertools.product([1, 3, 5, 8], [1, 2, 3], [1, 2, 4], [1, 2, 3, 4]):
        s = n * min(local, topk)
        best = max(
            sum(-(-c // pad) * pad for c in counts)
            for counts in itertools.product(range(n + 1), repeat=local)
            if sum(counts) <= s
        )
        assert padded_worst_case_rows(n, 1, local, topk, pad) == best, (n, local, topk, pad)
    assert padded_worst_case_rows(TOKENS, WORLD, 2, TOPK, 1) == WORLD * TOKENS * 2  # no padding


def _rank(rank: int, out: str) -> None:
    import functional_tests.stand_ins.hybrid_ep_installed  # noqa: F401  (deep_ep stand-in)
    from te_paged.integrations.torchtitan import cpu_shims

    cpu_shims.install()
    torch.set_num_threads(1)
    store = (Path(out) / "store").as_uri()
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from te_paged.integrations.torchtitan.hybridep import PagedHybridEPTokenDispatcher

        cfg = PagedHybridEPTokenDispatcher.Config(
            num_experts=EXPERTS, top_k=TOPK, non_blocking_capacity_factor=1.0,
            pad_multiple=PAD, hidden_dim=WIDTH, num_max_tokens_per_rank=TOKENS,
        )  # fmt: skip
        d = PagedHybridEPTokenDispatcher(cfg)
        d.ep_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("ep",))
        d.init_buffer()
        x = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(rank))
        # Experts 0 and 1 for every token, then two of experts 2..7.
        t = torch.arange(TOKENS)
        ids = torch.stack([t * 0, t * 0 + 1, 2 + (t + rank) % 6, 2 + (t + rank + 3) % 6], 1)
        scores = torch.full((TOKENS, TOPK), 0.25)
        budget = d.budget(x.device)

        def dispatch() -> tuple[int, int, int]:
            budget.reset_flags()
            routed, counts, _ = d.dispatch(x, scores, ids, torch.zeros(EXPERTS))
            return routed.shape[0], int(budget.over_budget), int(counts.sum())

        rows = [dispatch()]  # at factor 1.0
        # As the runner does: the dropless rerun (a budget that holds the dispatch) measures
        # the step's need, the reduced peak; the factor that holds it is set for the next step.
        budget.set_dropless(True)
        rows.append(dispatch())
        need = torch.tensor([int(budget.peak_tokens)])
        dist.all_reduce(need, op=dist.ReduceOp.MAX)
        budget.set_dropless(False)
        fits = budget.fitting_capacity_factor(TOKENS, int(need))
        budget.set_capacity_factor(fits)
        rows.append(dispatch())
        torch.save({"rows": rows, "max_factor": budget.max_factor, "fits": fits,
                    "need": int(need)}, f"{out}/rank{rank}.pt")  # fmt: skip
        dist.barrier()  # leave together: gloo torn down under a talking peer can abort
    finally:
        dist.destroy_process_group()


def test_four_ranks_the_budget_grows_past_one_to_what_padding_needs(tmp_path: Path) -> None:
    got = run_ranks(__name__, _rank, tmp_path, WORLD)
    worst = padded_worst_case_rows(TOKENS, WORLD, EXPERTS // WORLD, TOPK, PAD)
    assert worst == 1056
    for rank, g in enumerate(got):
        # The ceiling: the smallest factor whose buffer holds the padded worst case.
        assert g["max_factor"] == 1.01 and math.ceil(1024 * 1.01 / PAD) * PAD >= worst
        (rows_1, over_1, _), _, (rows_3, over_3, _) = g["rows"]
        assert rows_1 == 1032 and rows_3 == 1056  # torchtitan's buffer at 1.0, then at 1.01
        assert over_1 == (rank == 0) and over_3 == 0, g["rows"]  # rank 0 dropped, then fits
        assert g["need"] == worst and g["fits"] == 1.01  # past 1.0, within the ceiling
    assert got[0]["rows"][1][0] == got[0]["rows"][2][2] == worst  # every padded row kept
