"""Worker of ``test_torchtitan_train.py``: every case in one launch (4 CPU ranks).

Each case trains a fresh :class:`~te_paged.integrations.torchtitan.PagedStashTrainer` (the
``ab`` engine's tiny torchtitan DeepSeek-V3, made smaller) for :data:`STEPS` steps, paged stash
OFF, then ON under other settings, and compares loss, every gradient shard and every parameter
shard after the optimizer step bitwise with the OFF run of the same routing:

* ``ep4``: expert parallelism over the 4 ranks (FSDP of the dense part over the same 4);
* ``ep2_dp2``: expert parallelism 2, each expert group data parallel over 2 ranks (``efsdp``);
* ``overflow``: ``ep4``'s model with a pool that cannot hold a step (``grow_pool`` off, buffer
  factor 0.3): every step after the capture step overflows and reruns; compared with ``ep4``'s
  OFF run, which never overflowed;
* ``over_budget``: rank 0's routing skewed to expert 0 past its budget (capacity factor 1.25):
  over-budget reruns, against an OFF run of the same skewed routing that never had a budget
  (``moe_expert_rank_capacity_factor=None``: dropless from the start), so never reran;
* ``sac``: torchtitan's selective activation checkpointing on every block;
* ``compiled``: torchtitan's ``compile.enable`` (each TransformerBlock ``fullgraph=True``,
  ``aot_eager``), sequences of 256 tokens and 2 steps, the memory measured as ``te-paged ab``
  measures it (its ``RankResult`` in the JSON), against the OFF run compiled alike;
* ``compiled_overflow``: ``compiled`` with ``overflow``'s pool: the reruns run the compiled
  graph with the stash off, against the compiled OFF run, which never overflowed;
* ``variable``: a variable-length run, sequences of 32, 64, 32 and 32 tokens: one rerun, at the
  64-token step (the new maximum), then paged; ``variable_declared``: the same with the
  largest batch declared (``max_tokens_per_rank``): none. (The tiny model's routing drifts
  much from step to step, its load-balancing bias updated each step: a step of 48 tokens
  after the 64-token one was seen to need more pages than it, a drift no headroom covers.)

Each rank writes ``rank<r>.json``: per case, per step, the flags and whether it matched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

STEPS = 3
BASE = {
    "layers": 2, "dense_layers": 1, "experts": 8, "hidden": 64, "ffn": 64, "heads": 4,
    "vocab": 256, "seq_length": 64, "micro_batch_size": 2, "steps": STEPS,
    "measure_memory": False,
}  # fmt: skip
VARIABLE = ((32,), (64,), (32,), (32,))  # a variable-length run: each step's sequence length
# Its wire held at the expert buffer's factor: what the pools do is the question here (a
# step's wire demand drifts as the tiny model trains, whatever its length); pages of 8 rows,
# so that a step's pages follow its rows (at 64, each small tensor's page rounds up alike).
VARIABLE_RUN = {"seq_schedule": VARIABLE, "steps": 4, "a2a_capacity_factor": 2.0,
                "grow_capacity": False, "page_size": 8}  # fmt: skip
#: case -> (the OFF run it is compared with, the ON run's settings)
CASES = {
    "ep4": ("ep4", {}),
    "overflow": ("ep4", {"grow_pool": False, "buffer_factor_cuda": 0.3}),
    "ep2_dp2": ("ep2_dp2", {"ep": 2}),
    "over_budget": ("over_budget", {"capacity_factor": 1.25, "skew": 20.0}),
    "sac": ("sac", {"activation_checkpoint": "selective"}),
    "compiled": ("compiled", {"compile": "aot_eager", "steps": 2, "seq_length": 256}),
    "compiled_overflow": (
        "compiled",
        {"compile": "aot_eager", "steps": 2, "seq_length": 256, "grow_pool": False,
         "buffer_factor_cuda": 0.3},
    ),
    "variable": ("variable", {**VARIABLE_RUN}),
    "variable_declared": ("variable", {**VARIABLE_RUN, "max_tokens_per_rank": 128}),
}  # fmt: skip
#: The cases whose memory is measured, as ``ab`` measures it (slow: the others skip it).
MEASURED = ("compiled",)
#: OFF runs: the routing-relevant settings of the cases that own one.
OFF = {
    "ep4": {},
    "ep2_dp2": {"ep": 2},
    "over_budget": {"capacity_factor": None, "skew": 20.0},
    "sac": {"activation_checkpoint": "selective"},
    "compiled": {"compile": "aot_eager", "steps": 2, "seq_length": 256, "measure_memory": True},
    "variable": {**VARIABLE_RUN},
}


def _same(a, b) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def start_rank():
    """One rank's set-up, shared by the torchtitan workers: the CPU shims, one thread, gloo,
    torchtitan's logging quiet. Returns ``(rank, cpu device)``."""
    import torch
    import torch.distributed as dist

    from te_paged.integrations.torchtitan import cpu_shims

    cpu_shims.install()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from te_paged.tools.torchtitan_ab import quiet_torchtitan

    quiet_torchtitan()
    return dist.get_rank(), torch.device("cpu")


def _ab_result(rank: int, on, off, config: dict) -> dict:
    """This rank's ``te-paged ab`` result of the ON and OFF runs (the test gathers the ranks'
    into an ``ABResult`` for the memory table's figures)."""
    from te_paged.tools.ab_result import rank_result

    equal = [_same(a, b) and _same(ga, gb)
             for a, b, ga, gb in zip(on.params, off.params, on.grads, off.grads)]  # fmt: skip
    host = sum(m.stats().host_pool_bytes for m in on.managers)
    reloads = max((m.reload_layers for m in on.managers), default=1)
    result = rank_result(rank, on.steps, off.steps, equal, host, on.memory_method, [],
                         reload_layers=reloads)  # fmt: skip
    return {"config": config, "rank": dataclasses.asdict(result)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from te_paged.tools.torchtitan_ab import TorchtitanModelConfig, train

    rank, device = start_rank()
    off_runs = {
        name: train(TorchtitanModelConfig(**{**BASE, **kw}), False, device)
        for name, kw in OFF.items()
    }
    result = {"world_size": dist.get_world_size(), "rank": rank, "cases": {}, "ab": {}}
    for case, (off_name, kw) in CASES.items():
        measure = {"measure_memory": True} if case in MEASURED else {}
        cfg = TorchtitanModelConfig(**{**BASE, **kw, **measure})
        on = train(cfg, True, device)
        off = off_runs[off_name]
        if case in MEASURED:
            result["ab"][case] = _ab_result(rank, on, off, dataclasses.asdict(cfg))
        steps = []
        for i, (a, b) in enumerate(zip(on.steps, off.steps)):
            steps.append(
                {
                    "loss_equal": a.loss == b.loss,
                    "grads_equal": _same(on.grads[i], off.grads[i]),
                    "params_equal": _same(on.params[i], off.params[i]),
                    "attempt": a.attempt,
                    "enabled": a.enabled,
                    "capture": a.capture,
                    "overflow_ranks": a.stash_overflow_ranks,
                    "overbudget_ranks": a.overbudget_ranks,
                    "stashes": a.stashes,
                    "pops": a.pops,
                    "params": len(on.params[i]),
                    "paged_nothing": a.record["paged_nothing"],
                    "record": {
                        k: a.record[k] for k in ("step", "pool_growth", "microbatch_tokens")
                    },
                }
            )
        result["cases"][case] = steps
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    sys.exit(main())
