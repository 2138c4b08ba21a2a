"""The distributed tests' ranks: forked from a forkserver that imported torch and the test's
module once (about 4 s of CPU a rank on 2 cores when each imports them; where the session's
forkserver already runs, with other modules, the ranks import what it lacks), each writing
``rank<r>.pt`` into a folder the test then reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp


def run_ranks(module: str, worker: Callable[[int, str], None], out: Path, world: int) -> list:
    """``worker(rank, str(out))`` on ``world`` ranks; every rank's ``rank<r>.pt``, in order."""
    mp.set_forkserver_preload([module])
    mp.start_processes(worker, args=(str(out),), nprocs=world, join=True,
                       start_method="forkserver")  # fmt: skip
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
