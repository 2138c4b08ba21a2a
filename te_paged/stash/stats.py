"""The manager's statistics (:class:`StashStats`, one host read) and its timeline events."""

from __future__ import annotations

import dataclasses
import enum

import torch

from te_paged.kernels.layout import Flag, Meta, State, Tier
from te_paged.stash.buffer import (
    PagedStashBuffer,
)
from te_paged.telemetry import TimelineEvent


class StashMode(enum.Enum):
    """The manager's mode: the capture step, then paged steps."""

    CAPTURE = "capture"
    CAPTURED = "captured"


@dataclasses.dataclass
class StashStats:
    """Statistics of the current step (``reset()`` clears the per-step counters)."""

    mode: StashMode
    stashes: int
    pops: int
    stashes_skipped: int  # tensors kept unpaged: their backward came first (skip_immediate_…)
    bytes_stashed: int
    tensors_spilled: int
    overflow: bool
    host_spill: bool
    invalid: bool  # a record popped twice, or token counts that cannot be right (see Flag)
    pool_pages: dict[str, int]
    host_pool_pages: dict[str, int]
    pages_high_water: dict[str, int]
    host_pages_high_water: dict[str, int]
    pool_bytes: int
    host_pool_bytes: int
    capture_peak_rows: dict[str, int]
    capture_peak_balanced_rows: dict[str, int]  # every marked tensor, kept ones too: S
    capture_peak_balanced_pages: dict[str, int]
    capture_peak_pages: dict[str, int]  # observed: the real rows in whole pages
    capture_peak_static_pages: dict[str, int]  # every tensor at its static rows: no saving
    pages_demanded: dict[str, int]  # the step's peak need, stored or not (State.DEMAND_HWM)


class StashReporting:
    """Part of :class:`~te_paged.stash.PagedStashManager` (mixed into it; uses its
    attributes): see the module docstring."""

    def _trace(self, kind: str, buffer: PagedStashBuffer, meta: torch.Tensor) -> None:
        if self.timeline is None:
            return
        self.join_side_streams()  # telemetry reads the pool's state: not for speed
        state = buffer.state.tolist()
        rows = int(meta[Meta.ROWS]) if int(meta[Meta.TIER]) == int(Tier.DEVICE) else 0
        live = self._live_rows.get(buffer.key, 0) + (rows if kind == "stash" else -rows)
        self._live_rows[buffer.key] = live
        pages = buffer.num_pages - (state[State.TAIL] - state[State.HEAD])
        self.timeline.append(
            TimelineEvent(len(self.timeline), kind, str(buffer.key), pages, live, self.page_size)
        )

    def stats(self) -> StashStats:
        """Read the step's statistics (one device→host copy per pool; not for the hot path)."""
        self.join_side_streams()
        self._streams.note("stats", reads=["flags", *(("pool", k) for k in self.buffers)])
        flags = self.flags.tolist()
        pool_pages, host_pages, hwm, host_hwm, demanded = {}, {}, {}, {}, {}
        bytes_stashed, spilled = self._capture_bytes, 0
        for key, buf in self.buffers.items():
            state = buf.state.tolist()
            name = str(key)
            pool_pages[name], host_pages[name] = buf.num_pages, buf.host_num_pages
            hwm[name], host_hwm[name] = state[State.HWM], state[State.HOST_HWM]
            demanded[name] = state[State.DEMAND_HWM]
            bytes_stashed += state[State.ROWS_STASHED] * key.hidden * buf.pool_NH.element_size()
            spilled += state[State.SPILLED]
        return StashStats(
            mode=self.mode,
            stashes=self._stashes,
            pops=self._pops,
            stashes_skipped=self._skipped,
            bytes_stashed=bytes_stashed,
            tensors_spilled=spilled,
            overflow=flags[Flag.OVERFLOW] > 0,
            host_spill=flags[Flag.HOST_SPILL] > 0,
            invalid=flags[Flag.INVALID] > 0,
            pool_pages=pool_pages,
            host_pool_pages=host_pages,
            pages_high_water=hwm,
            host_pages_high_water=host_hwm,
            pool_bytes=sum(b.pool_bytes for b in self.buffers.values()),
            host_pool_bytes=sum(b.host_pool_bytes for b in self.buffers.values()),
            capture_peak_rows={str(k): p.peak_rows for k, p in self._peaks.items()},
            capture_peak_balanced_rows={
                str(k): p.peak_balanced_all for k, p in self._peaks.items()
            },
            capture_peak_balanced_pages={
                str(k): p.peak_balanced_pages for k, p in self._peaks.items()
            },
            capture_peak_pages={str(k): p.peak_pages for k, p in self._peaks.items()},
            capture_peak_static_pages={str(k): p.peak_static_pages for k, p in self._peaks.items()},
            pages_demanded=demanded,
        )
