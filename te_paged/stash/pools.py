"""The manager's pools: sized from the capture step's peaks, agreed across the
expert-parallel group, allocated at ``reset()``, grown by the runner (``grow``), and logged.

Each (dtype, row width) key gets ``ceil(|factor| × peak pages)`` device pages (the balanced
peak for a positive factor, the observed one for a negative, :mod:`te_paged.stash.sizing`),
plus a host tier with the CPU factor. With a ``pool_group`` the ranks take the group's largest
sizes (one ``all_gather`` per allocation), so every rank of an expert-parallel group holds the
same pools.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings

import torch
import torch.distributed as dist

from te_paged.config.checks import (
    require_int,
)
from te_paged.stash.buffer import (
    MAX_KEYS,
    PagedStashBuffer,
    StashKey,
    key_code,
    key_from_code,
)
from te_paged.stash.sizing import describe_factor, pool_pages
from te_paged.stash.stats import StashMode
from te_paged.telemetry import nvtx_range

logger = logging.getLogger("te_paged.stash.manager")  # the manager logs the pools
_MIB = 2**20


@dataclasses.dataclass
class _Peak:
    live_rows: int = 0
    peak_rows: int = 0
    live_pages: int = 0  # each live tensor's real rows in whole pages (a negative factor's peak)
    peak_pages: int = 0
    live_balanced: int = 0
    peak_balanced: int = 0
    live_balanced_pages: int = 0
    peak_balanced_pages: int = 0
    max_rows: int = 0  # the largest static buffer (rows) of any tensor of the key
    live_static_pages: int = 0  # each live tensor's static rows (its whole buffer) in pages
    peak_static_pages: int = 0  # a pool this large saves nothing over not stashing
    # The balanced peak of every marked tensor, those skip_immediate_backward keeps unpaged
    # included (the fields above leave them out: the pools never hold them): S, the bytes
    # the memory model prices (te_paged.tools.ab), counts every stashed layer.
    live_balanced_all: int = 0
    peak_balanced_all: int = 0
    # With a declared max_tokens_per_rank: the same three page peaks (balanced, observed,
    # static) with every tensor scaled to a microbatch of that many tokens, what the pools are
    # sized from (PagedStashManager's docstring); equal to the above without one.
    live_declared: tuple[int, int, int] = (0, 0, 0)
    peak_declared: tuple[int, int, int] = (0, 0, 0)

    def clear_live(self) -> None:
        self.live_rows = self.live_pages = self.live_balanced = self.live_balanced_pages = 0
        self.live_static_pages = self.live_balanced_all = 0
        self.live_declared = (0, 0, 0)


class PoolAllocation:
    """Part of :class:`~te_paged.stash.PagedStashManager` (mixed into it; uses its
    attributes): see the module docstring."""

    def pool_pages_for(self, key: StashKey) -> tuple[int, int]:
        """``(device pages, host pages)`` the pool of ``key`` gets from the captured peaks.

        Each factor's sign chooses the peak (Megatron's convention, see
        :mod:`te_paged.stash.sizing`): positive, the balanced-case peak; negative, the capture
        step's observed peak. Peaks are counted in pages (each live tensor's rows rounded up to
        whole pages), not rows: a tensor always occupies whole pages, so a rows-based size
        undercounts whenever tensors are small against the page size.
        """
        balanced, observed, _ = self.sizing_peaks(key)
        dev = max(1, pool_pages(self.buffer_size_factor_cuda, balanced, observed))
        dev = max(dev, self._floors.get(key, 0))  # grown by grow(): never smaller again
        host = pool_pages(self.buffer_size_factor_cpu, balanced, observed)
        return dev, host

    def capture_peaks(self, key: StashKey) -> tuple[int, int, int]:
        """``(balanced, observed, static)`` peak pages of ``key`` in the capture step: every
        live tensor at the balanced row count, at its real rows, at its static buffer's rows (a
        pool of the static peak saves nothing over not stashing; none can need more)."""
        peak = self._peaks[key]
        return peak.peak_balanced_pages, peak.peak_pages, peak.peak_static_pages

    def sizing_peaks(self, key: StashKey) -> tuple[int, int, int]:
        """``(balanced, observed, static)`` peak pages the pools of ``key`` are sized from:
        the capture step's (:meth:`capture_peaks`), or, with a declared
        ``max_tokens_per_rank``, the capture step's with every tensor scaled to a microbatch of
        that many tokens per rank."""
        if self.max_tokens_per_rank is None:
            return self.capture_peaks(key)
        return self._peaks[key].peak_declared

    def static_peak_pages(self, key: StashKey) -> int:
        """The largest static peak of ``key`` so far, in pages: every live tensor at its
        static buffer's rows, maximised over the capture step (:meth:`sizing_peaks`) and every
        paged step since (a larger microbatch has larger static buffers). A pool this large
        saves nothing over not stashing, the bound pool growth keeps to."""
        step = self._step_static.get(key)
        return max(self.sizing_peaks(key)[2], self._static_seen.get(key, 0), step[1] if step else 0)

    def step_static_pages(self) -> dict[StashKey, int]:
        """This step's static peak per key (pages; paged steps: counted on the host at each
        stash and pop; the capture step: its own)."""
        if self.mode is StashMode.CAPTURE:
            return {k: p.peak_static_pages for k, p in self._peaks.items()}
        return {k: counts[1] for k, counts in self._step_static.items()}

    def _count_static(self, key: StashKey, max_rows: int, sign: int) -> None:
        """A paged step's host count of live static pages (a stash ``sign`` 1, a pop -1)."""
        counts = self._step_static.get(key)  # [live, peak], mutated in place: the hot path
        if counts is None:
            counts = self._step_static[key] = [0, 0]
        counts[0] += sign * -(-max_rows // self.page_size)
        if counts[0] > counts[1]:
            counts[1] = counts[0]

    def _fold_step_static(self) -> None:
        """At a step boundary: the step's static peaks into the largest seen."""
        for key, (_, peak) in self._step_static.items():
            if peak > self._static_seen.get(key, 0):
                self._static_seen[key] = peak
        self._step_static.clear()

    def scale_static_peaks(self, ratio: float) -> None:
        """The static buffers grew by ``ratio`` since the capture step (a runner raised a
        receive budget): so do the capture step's static peaks, the bound pool growth keeps
        to (a pool of the old bound would overflow on every step the new buffers fill)."""
        if ratio > 1:
            for peak in self._peaks.values():
                peak.peak_static_pages = math.ceil(peak.peak_static_pages * ratio)
                peak.max_rows = math.ceil(peak.max_rows * ratio)
                b, o, static = peak.peak_declared
                peak.peak_declared = (b, o, math.ceil(static * ratio))

    @property
    def keys(self) -> list[StashKey]:
        """The pool keys the capture step found (empty before it)."""
        return list(self._peaks)

    def grow(
        self, pages: dict[StashKey, int], *, reallocate_all: bool = False
    ) -> dict[StashKey, tuple[int, int]]:
        """Make the device pool of each key hold at least ``pages[key]`` pages from the next
        :meth:`reset` on; a pool already that large is left alone. Returns ``{key: (old pages,
        new pages)}`` of the pools that grow. The pools in use stay as they are until then
        (a step's statistics still describe them), and the next ``reset()`` reallocates the
        grown ones — or, with ``reallocate_all``, every pool, so that the ranks of a
        ``pool_group`` allocate, and agree, at the same step even where only some grew. A runner
        calls it after a step that needed more than a pool holds (or than its headroom).
        """
        grown = {}
        for key, want in pages.items():
            if key not in self._peaks:
                raise KeyError(f"no pool key {key} in this manager (keys: {self.keys})")
            want = require_int(f"pages[{key}]", want, minimum=1)
            held = self.buffers.get(key)
            old = held.num_pages if held is not None else self.pool_pages_for(key)[0]
            if want > old:
                self._floors[key] = want
                grown[key] = (old, want)
        self._reallocate.update(self.buffers if reallocate_all else grown)
        return grown

    def _allocate(self) -> None:
        new = []
        with nvtx_range("te_paged.allocate"):
            sizes = {k: self.pool_pages_for(k) for k in self._peaks if k not in self.buffers}
            sizes = self._agree(sizes)
            if self._allocations == 0:
                self._warn_page_size()
            for key, (dev, host) in sizes.items():
                try:
                    buffer = PagedStashBuffer(key, dev, self.page_size, self.device, host)
                except (RuntimeError, MemoryError) as e:
                    width = key.row_bytes
                    raise RuntimeError(
                        f"could not allocate the {key} pool: {dev} device (+ {host} host) pages "
                        f"x page_size={self.page_size} rows x {width} bytes a row = "
                        f"{(dev + host) * self.page_size * width / 2**30:.2f} GiB ({e})"
                    ) from e
                self.buffers[key] = buffer
                new.append(buffer)
        self._allocations += 1
        if logger.isEnabledFor(logging.INFO):
            self._log_allocation(new)

    def _warn_page_size(self) -> None:
        """A page larger than every saved tensor's buffer: each tensor takes one mostly empty
        page, and the pool is mostly padding (e.g. page_size=2**20 for 16-row buffers)."""
        largest = max((p.max_rows for p in self._peaks.values()), default=0)
        if 0 < largest < self.page_size:
            used = 100 * largest / self.page_size
            warnings.warn(
                f"page_size={self.page_size} rows, but no saved tensor has more than {largest} "
                f"rows: each takes a whole page and fills at most {used:.2g}% of it; choose a "
                "page_size well below the expert buffers' rows (the usual is 64)",
                stacklevel=3,
            )

    def _agree(self, sizes: dict[StashKey, tuple[int, int]]) -> dict[StashKey, tuple[int, int]]:
        """With a ``pool_group``, the group's largest (device, host) pages per key: one
        ``all_gather`` of a fixed-length vector (:data:`MAX_KEYS` triples of key code and
        pages), so ranks holding different keys still exchange vectors of one length."""
        group = self.pool_group
        if group is None or not (dist.is_available() and dist.is_initialized()):
            return sizes
        world = dist.get_world_size(group)
        if world == 1:
            return sizes
        if len(sizes) > MAX_KEYS:
            raise ValueError(
                f"{len(sizes)} pool keys to allocate; agreeing their sizes across the group "
                f"has room for {MAX_KEYS} (one pool per dtype and row width)"
            )
        mine = torch.zeros(3 * MAX_KEYS, dtype=torch.int64)
        for i, (key, (dev, host)) in enumerate(sizes.items()):
            mine[3 * i : 3 * i + 3] = torch.tensor([key_code(key), dev, host])
        # The group's backend decides where the vector must live (gloo: CPU, NCCL: CUDA).
        device = self.device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        mine = mine.to(device)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine, group=group)
        agreed = dict(sizes)
        for row in torch.stack(every).cpu().view(world, MAX_KEYS, 3).tolist():
            for code, dev, host in row:
                key = key_from_code(code) if code else None
                if key in agreed:
                    agreed[key] = (max(agreed[key][0], dev), max(agreed[key][1], host))
        return agreed

    def _log_allocation(self, new: list[PagedStashBuffer]) -> None:
        why = (
            "sized from the capture step"
            if self._allocations == 1
            else "reallocated after release() (a runner's fallback frees them) or grow()"
        )
        pools = []
        for b in new:
            host = f", host tier {b.host_num_pages} pages" if b.host_num_pages else ""
            pools.append(
                f"{b.key}: {b.num_pages} pages of {self.page_size} rows, "
                f"{b.pool_bytes / _MIB:.2f} MiB (capture peak "
                f"{self._peaks[b.key].peak_balanced_pages} balanced / "
                f"{self._peaks[b.key].peak_pages} observed pages; buffer_size_factor_cuda "
                f"{describe_factor(self.buffer_size_factor_cuda)}"
                + (
                    f", sized for max_tokens_per_rank={self.max_tokens_per_rank}: "
                    f"{self.sizing_peaks(b.key)[0]} balanced / {self.sizing_peaks(b.key)[1]} "
                    "observed pages"
                    if self.max_tokens_per_rank is not None
                    else ""
                )
                + (f", grown to at least {self._floors[b.key]}" if b.key in self._floors else "")
                + f"{host})"
            )
        total = sum(b.pool_bytes + b.host_pool_bytes for b in new) / _MIB
        where = str(self.device)
        if dist.is_available() and dist.is_initialized():
            where = f"rank {dist.get_rank()}, {where}"
        logger.info(
            "PagedStashManager (%s): pools %s: %s; %.2f MiB in all",
            where, why, "; ".join(pools), total,
        )  # fmt: skip
