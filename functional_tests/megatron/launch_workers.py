"""Run Megatron functional workers in one process group: ``main(argv)``, one process per rank.

``python -m torch.distributed.run --nproc_per_node=4 -m functional_tests.megatron.launch_workers
--workers train_worker,pipeline_worker --out DIR``, or the same under ``functional_tests.
forkrun`` (what :func:`functional_tests.megatron.run_workers` launches). Each worker module
(``train_worker``, ``pipeline_worker``, ``builtin_worker``, ``worker``) has ``STEPS`` and
``run_cases(rank, world, out) -> dict``; the launch runs them one after another on gloo, so
megatron-core's import (about 5 s a process) and gloo's set-up are paid once, and writes each
worker's results to ``DIR/<worker>/rank<r>.json`` with the world size, the worker's step count
and the megatron-core release imported.

A rank whose peers died would wait in a collective for ever: after ``--timeout-s`` every rank
dumps its stacks and exits.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import importlib
import json
import sys
from pathlib import Path

# torch, megatron-core and te_paged are imported in main(), not here: megatron-core's
# dist_checkpointing.save starts a multiprocessing manager per rank with "spawn", which imports
# this module again (as __mp_main__) in a new process: 3 s of CPU a rank for torch's import.


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", required=True, help="comma-separated worker module names")
    parser.add_argument("--out", type=Path, required=True, help="folder for <worker>/rank<r>.json")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="watchdog: exit after")
    args = parser.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    import torch

    from te_paged.integrations.megatron import cpu_shims

    cpu_shims.install()
    torch.set_num_threads(1)
    import torch.distributed as dist

    from functional_tests.megatron import worker_module
    from te_paged.integrations.megatron.releases import installed_version

    workers = [importlib.import_module(worker_module(name))
               for name in args.workers.split(",")]  # fmt: skip
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        for name, worker in zip(args.workers.split(","), workers, strict=True):
            out = args.out / name.rsplit(".", 1)[-1]
            out.mkdir(parents=True, exist_ok=True)
            results = {
                "world_size": world,
                "steps": worker.STEPS,
                "megatron_core": installed_version(),
                **worker.run_cases(rank, world, out),
            }
            dist.barrier()
            (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    finally:
        dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
