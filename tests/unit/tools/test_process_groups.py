"""``megatron_ab.destroy_groups_made_inside``: a block that makes process groups (Megatron's
``initialize_model_parallel``) leaves none alive, nor their gloo threads."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from te_paged.tools.megatron_ab import destroy_groups_made_inside
from te_paged.torch_compat import TORCH_RELEASE


def _gloo_loop_threads() -> int:
    """Threads of this process that gloo's TCP transport runs, one per live gloo group."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


def _threads_once_settled(expected: int | None = None, timeout_s: float = 10.0) -> int:
    """gloo's loop threads once their number holds for 0.3 s (or equals ``expected``): a group
    starts its thread at its first collective and a destroyed one ends it, each a little after
    the call returns (one suite run counted the default group's thread after its collective)."""
    deadline = time.monotonic() + timeout_s
    last, since = _gloo_loop_threads(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _gloo_loop_threads()
        if now == expected:
            return now
        if now != last:
            last, since = now, time.monotonic()
        elif expected is None and time.monotonic() - since >= 0.3:
            return now
    return _gloo_loop_threads()


def test_groups_made_inside_are_destroyed_and_their_threads_end(tmp_path) -> None:
    started_here = not dist.is_initialized()
    if started_here:
        store = (tmp_path / "store").as_uri()
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        # The default group (an earlier test's, in the suite) connects, and starts its own
        # thread, at its first collective: before the count.
        dist.all_reduce(torch.ones(1))
        groups_before, threads_before = set(distributed_c10d._world.pg_map), _threads_once_settled()
        with destroy_groups_made_inside():
            # Held in a reference cycle, as a model's modules hold their groups: only the
            # garbage collector frees them (and so ends their threads).
            held: dict = {"groups": [dist.new_group([0]) for _ in range(3)]}
            held["self"] = held
            for group in held["groups"]:
                dist.all_reduce(torch.ones(1), group=group)
            # torch 2.13's and 2.15's gloo name their loop threads; 2.10's leaves them unnamed,
            # uncounted here (the groups' destruction is still checked).
            named = TORCH_RELEASE >= (2, 13)
            assert _threads_once_settled(threads_before + 3) == threads_before + 3 * named
            del held, group
        assert set(distributed_c10d._world.pg_map) == groups_before
        assert _threads_once_settled(threads_before) == threads_before
    finally:
        if started_here:
            dist.destroy_process_group()
