"""How often a gloo collective's buffers outlive the collective, as torch's ``MemTracker`` sees it.

Each rank, per iteration, under ``MemTracker``: allocate a send buffer ``x`` and a receive buffer
(1 MiB each at the default size), ``all_to_all_single``, drop ``x``, allocate a third buffer.
Were ``x`` freed when the collective returned, the peak would be two buffers; an iteration
whose peak is three buffers saw ``x`` still held, by gloo's worker thread, which completes the
collective (waking the caller) before it drops its own references. With more ranks than cores
the worker can be descheduled in between. ``te-paged ab`` on CPU meets the same thing as a
rank whose peak is a collective's buffers higher than its peers' (``ABResult.memory``).

    python benchmarks/gloo_linger.py --ranks 4 --iterations 300

Run it on an idle machine and again beside a CPU load (e.g. two ``python -c 'while True:
pass'``); the counts go to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, iterations: int, numel: int) -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    buffer = numel * 4
    counts: dict[int, int] = {}
    for _ in range(iterations):
        tracker = MemTracker()
        with tracker:
            x = torch.ones(numel)
            out = torch.empty(numel)
            dist.all_to_all_single(out, x)
            del x
            y = torch.zeros(numel)
            del y
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        counts[peak // buffer] = counts.get(peak // buffer, 0) + 1
    print(f"rank {rank}: iterations by peak (buffers): {dict(sorted(counts.items()))}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--mib", type=float, default=1.0, help="each buffer's size (MiB)")
    args = parser.parse_args()
    numel = int(args.mib * 2**20) // 4 // args.ranks * args.ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.ranks, port, args.iterations, numel), nprocs=args.ranks)


if __name__ == "__main__":
    main()
