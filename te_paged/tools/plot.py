"""``te-paged ab --plot``: pool occupancy over the step and peak memory ON vs OFF (matplotlib)."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

__all__ = ["plot_ab"]


def plot_ab(result, path: str | Path | BinaryIO, fmt: str | None = None) -> None:
    """Write a PNG: pages in use per pool over rank 0's last ON step (stash/pop events), and
    each rank's peak memory ON (with the pool) vs OFF."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # optional dependency
        raise RuntimeError("--plot needs matplotlib: pip install 'te_paged[plot]'") from e
    fig, (occ, mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    events = result.ranks[0].timeline
    for key in sorted({e["key"] for e in events}):
        pages, ys = 0, []
        for e in events:  # each pool's occupancy, held between its own events
            pages = e["pages_in_use"] if e["key"] == key else pages
            ys.append(pages)
        occ.step(range(len(events)), ys, where="post", label=f"pool {key}")
    occ.set_xlabel("stash/pop event (forward, then backward)")
    occ.set_ylabel("pages in use")
    occ.set_title("Pool occupancy, rank 0, last step")
    if events:
        occ.legend(fontsize="small")
    ranks = [r.rank for r in result.ranks]
    mib = 2**20
    step = [-1 if r.memory_step is None else r.memory_step for r in result.ranks]
    on = [(r.on[i].peak_bytes + r.pool_bytes) / mib for r, i in zip(result.ranks, step)]
    off = [r.off[i].peak_bytes / mib for r, i in zip(result.ranks, step)]
    width = 0.4
    mem.bar([x - width / 2 for x in ranks], off, width, label="paged stash OFF")
    mem.bar([x + width / 2 for x in ranks], on, width, label="paged stash ON (incl. pool)")
    mem.set_xlabel("rank")
    mem.set_ylabel("peak activation memory (MiB)")
    mem.set_title("Peak memory, last step")
    mem.set_xticks(ranks)
    mem.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format=fmt)
    plt.close(fig)
