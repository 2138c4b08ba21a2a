"""Worker of ``test_torchtitan_hybridep.py``: torchtitan's HybridEP dispatcher kept by te_paged.

4 CPU ranks, EP 4, the HybridEP stand-in (``functional_tests/stand_ins/deep_ep.py``) installed
as ``deep_ep`` and torchtitan's HybridEP custom ops given CPU kernels (the torchtitan CPU
shims). Each case trains a fresh :class:`~te_paged.integrations.torchtitan.PagedStashTrainer`
with ``moe_comm_backend="hybridep"`` in its non-blocking mode and compares, per step, the loss,
every gradient shard and every parameter shard with an OFF run, bitwise:

* ``parity``: factor 1.0 (HybridEP's worst case: nothing can be dropped), ON vs OFF;
* ``overflow``: rank 0's routing skewed to expert 0, factor 0.25 (the balanced rows): HybridEP
  drops rows past the budget and sets its flag; te_paged's reduction sees it and the step reruns
  dropless, against an OFF run at factor 1.0 of the same routing, which never dropped;
* ``overflow_fixed``: the same without ``grow_capacity``: every step reruns (the growth is
  what lets later steps keep their first attempt);
* ``everywhere``: every rank's routing skewed to expert 0, factor 0.25, so in the reruns ranks 1
  to 3 receive almost nothing; against an OFF run at 1.0 of the same routing;
* ``padded_everywhere``: the same with ``pad_multiple`` 4, factor 1.0 (which padding can
  overrun), against an OFF run at 2.0 (past the padded worst case).

The last two hung in the rerun (FSDP's reduce-scatter sizes disagreeing across ranks) while it
used HybridEP's blocking mode: see ``te_paged.integrations.torchtitan.hybridep``.

* ``rerun_undersized``: ``padded_everywhere`` with the rerun's dispatch sized at factor 0.25 (a
  sizing bug, made on purpose): the rerun drops rows, reads its own flag and raises on every
  rank, naming the rows kept and needed, instead of keeping a step that dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from functional_tests.torchtitan.worker import BASE, _same, start_rank

STEPS = 3
SKEW = 20.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    import functional_tests.stand_ins.hybrid_ep_installed  # noqa: F401  (deep_ep stand-in)
    from te_paged.tools.torchtitan_ab import TorchtitanModelConfig, train

    rank, device = start_rank()

    def run(paged: bool, **kw):
        return train(TorchtitanModelConfig(**{**BASE, "steps": STEPS, **kw}), paged, device)

    def compare(on, off) -> list[dict]:
        out = []
        for i, (a, b) in enumerate(zip(on.steps, off.steps, strict=True)):
            out.append({
                "loss_equal": a.loss == b.loss,
                "grads_equal": _same(on.grads[i], off.grads[i]),
                "params_equal": _same(on.params[i], off.params[i]),
                "attempt": a.attempt,
                "overbudget_ranks": a.overbudget_ranks,
                "stashes": a.stashes,
                "pops": a.pops,
                "capacity_growth": a.record["capacity_growth"],
                "budget_tokens": a.record["budget_tokens"],
                "peak_tokens": a.record["peak_tokens"],
            })  # fmt: skip
        return out

    parity_off = run(False, hybridep_factor=1.0)
    never = run(False, hybridep_factor=1.0, skew=SKEW)
    # The skewed runs' pool has room (factor 2.0): the demand of the routing skewed to expert
    # 0 still rises step by step, and the reruns tested here are the budget's, not the pool's.
    pool = {"buffer_factor_cuda": 2.0}
    everywhere = {"skew": SKEW, "skew_every_rank": True}
    padded = {"hybridep_pad_multiple": 4, **everywhere}
    never_everywhere = run(False, hybridep_factor=1.0, **everywhere)
    never_padded = run(False, hybridep_factor=2.0, **padded)
    cases = {
        "parity": compare(run(True, hybridep_factor=1.0), parity_off),
        "overflow": compare(run(True, hybridep_factor=0.25, skew=SKEW, **pool), never),
        "overflow_fixed": compare(
            run(True, hybridep_factor=0.25, skew=SKEW, grow_capacity=False, **pool), never
        ),
        "everywhere": compare(run(True, hybridep_factor=0.25, **everywhere, **pool),
                              never_everywhere),
        "padded_everywhere": compare(run(True, hybridep_factor=1.0, **padded, **pool),
                                     never_padded),
    }  # fmt: skip
    result = {"world_size": dist.get_world_size(), "rank": rank, "cases": cases,
              "rerun_undersized": _rerun_undersized(run, padded, pool)}  # fmt: skip
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _rerun_undersized(run, padded: dict, pool: dict) -> str | None:
    """``padded_everywhere``'s ON run with the rerun's dispatch sized at a quarter of the worst
    case (a sizing bug, made on purpose; the skewed routing needs more): the error its rerun
    raises (None if it kept its steps)."""
    from te_paged.integrations.torchtitan.hybridep import PagedHybridEPTokenDispatcher as D

    def quarter(self, num_tokens: int, topk_expert_ids_TK) -> float:
        return 0.25

    real, D.rerun_factor = D.rerun_factor, quarter
    try:
        run(True, hybridep_factor=1.0, **padded, **pool)
        return None
    except RuntimeError as e:
        return str(e)
    finally:
        D.rerun_factor = real


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
