"""The paged-stash manager: pools, flags, statistics and the saved-tensor scope.

Lifecycle (one manager per model, shared by all its MoE layers; never a process-wide singleton)::

    manager = PagedStashManager(page_size=64, buffer_size_factor_cuda=1.1)
    for step in ...:
        manager.reset()                       # step boundary (allocation-free after step 2)
        for layer in layers:
            with manager.scope(max_num_tokens, num_tokens_dev, avg_num_tokens):
                out = layer(...)              # marked saved tensors are paged
        loss.backward()                       # unpack hooks pop them back
        manager.stats()                       # one host read, if the caller wants it

* **capture** (first step): every marked saved tensor is truncated to its actual rows (counts
  read on the host) and restored in backward; the manager learns each (dtype, hidden) key and
  the peak of concurrently live rows, actual and balanced-case.
* **captured** (later steps): the first ``reset()`` after capture allocates one pool per key of
  ``ceil(factor × peak balanced pages)`` pages (balanced rows of each live tensor rounded up to
  whole pages) (and a host tier with the CPU factor);
  stash and pop then run the kernels, which read counts on the device.

On CUDA (``stream_overlap``, the default there) stash copies run on a pack stream and reloads
on an unpack stream, ordered by events only (:mod:`te_paged.stash.streams`); a backward
reload prefetches the ``reload_lookahead`` scopes opened before its own (the previous layers of
the same forward pass).

The manager lives on one device (default: the current accelerator, i.e. CUDA's current device
when CUDA is available, else the CPU); a scope's ``num_tokens`` and every tensor it pages must
be on it (``ValueError`` otherwise, naming both devices). Pool (re)allocation is logged at INFO
on the ``te_paged.stash.manager`` logger (see docs/design.md, "Logging").
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import math
import warnings
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from te_paged.config.checks import (
    require_bool,
    require_device,
    require_int,
)
from te_paged.kernels import KernelBackend, backend_choices, resolve_backend, stash_copy, stash_pop
from te_paged.kernels.layout import FLAGS_LEN, META_LEN, Flag, Meta, State, Tier
from te_paged.markers import (
    MarkerKind,
    grouped_tensor_marker,
    is_checkpoint_without_output_tensor,
)
from te_paged.stash.buffer import (
    MAX_KEYS,
    PagedStashBuffer,
    StashKey,
    key_code,
    key_from_code,
    storage_dtype,
)
from te_paged.stash.sizing import check_factor, describe_factor, pool_pages
from te_paged.stash.streams import COMPUTE, PACK, UNPACK, CudaStreams, Streams
from te_paged.telemetry import TimelineEvent, nvtx_range

__all__ = ["PagedStashManager", "StashMode", "StashStats"]

logger = logging.getLogger(__name__)
_MIB = 2**20


_MAX_PAGE_SIZE = 2**31 - 1


def _current_device() -> torch.device:
    """Where the model computes by default: CUDA's current device when CUDA is available (this
    initialises CUDA, so it is called at construction, never at import), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StashMode(enum.Enum):
    CAPTURE = "capture"
    CAPTURED = "captured"


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


@dataclasses.dataclass
class StashStats:
    """Statistics of the current step (``reset()`` clears the per-step counters)."""

    mode: StashMode
    stashes: int
    pops: int
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
    capture_peak_balanced_rows: dict[str, int]
    capture_peak_balanced_pages: dict[str, int]
    capture_peak_pages: dict[str, int]  # observed: the real rows in whole pages
    capture_peak_static_pages: dict[str, int]  # every tensor at its static rows: no saving
    pages_demanded: dict[str, int]  # the step's peak need, stored or not (State.DEMAND_HWM)


class _Group:
    """The tensors one scope paged and not yet reloaded, for the reload look-ahead: ``prev``
    is the scope opened just before in the same forward pass (None at its first layer)."""

    __slots__ = ("handles", "layer", "prev")

    def __init__(self, layer: int | None, prev: _Group | None) -> None:
        self.handles: list[_Paged] = []
        self.layer = layer
        self.prev = prev


@dataclasses.dataclass(frozen=True)
class _Scope:
    max_num_tokens: int
    num_tokens: torch.Tensor
    avg_num_tokens: int
    layer: int | None  # names the NVTX ranges of the tensors paged in this scope
    group: _Group | None = None  # with stream overlap: the look-ahead's view of this scope
    #: (storage, offset, shape, strides, dtype) -> (weak reference, version, handle) of what
    #: this scope paged: bytes two ops save (torchtitan's experts feed one input to two
    #: grouped GEMMs) are paged once.
    paged: dict = dataclasses.field(default_factory=dict)


class _Captured:
    """Capture-step stand-in for a paged tensor: the actual rows, exactly sized."""

    __slots__ = (
        "balanced", "dtype", "generation", "key", "max_rows", "reloaded", "rows", "rows_RH",
        "shape",
    )  # fmt: skip

    def __init__(self, **kw: object) -> None:
        self.reloaded: torch.Tensor | None = None
        for k, v in kw.items():
            setattr(self, k, v)


class _Paged:
    """Handle autograd keeps instead of a paged tensor; reloads it once, on first unpack."""

    __slots__ = (
        "buffer", "dtype", "generation", "group", "id", "layer", "max_rows", "meta", "pages_M",
        "reload_event", "reloaded", "shape", "used",
    )  # fmt: skip

    def __init__(self, **kw: object) -> None:
        self.reloaded: torch.Tensor | None = None
        self.group: _Group | None = None
        self.reload_event = None
        self.used = False  # the compute stream has waited for the reload
        for k, v in kw.items():
            setattr(self, k, v)


class PagedStashManager:
    """Owns the page pools of one model, the shared device flags and the statistics.

    ``device`` (default ``None``: CUDA's current device when CUDA is available, else the CPU)
    is where the pools and flags live; it must be the device the experts compute on. A bare
    ``"cuda"`` means CUDA's current device.

    ``stream_overlap`` (default: on for CUDA; CPU has no streams) runs stash copies and reloads
    on their own streams; turn it off to debug, e.g. a suspected ordering problem.
    ``reload_lookahead`` (default 1) is how many earlier scopes a backward reload prefetches
    (0: reload each tensor when backward first uses it).

    ``pool_group`` (default ``None``: each rank sizes its own pools) is a process group whose
    ranks agree on pool sizes: every allocation then takes, per pool key, the largest size any
    rank of the group asks for (one ``all_gather`` per allocation, none per step), so the ranks
    of an expert-parallel group hold the same pools. Every rank of the group must then call
    :meth:`reset` at the same steps (a runner does); :class:`~te_paged.runtime.PagedStashRunner`
    sets it to the expert-parallel group unless told ``per_rank_pools=True``.
    """

    def __init__(
        self,
        *,
        page_size: int = 64,
        buffer_size_factor_cuda: float = 1.10,
        buffer_size_factor_cpu: float = 0.0,
        device: torch.device | str | None = None,
        kernel_backend: KernelBackend | str = KernelBackend.AUTO,
        zero_padding: bool = True,
        record_timeline: bool = False,
        stream_overlap: bool | None = None,
        reload_lookahead: int = 1,
        pool_group: dist.ProcessGroup | None = None,
    ) -> None:
        page_size = require_int("page_size", page_size, minimum=1)
        if page_size > _MAX_PAGE_SIZE:
            raise ValueError(
                f"page_size={page_size} rows: a page holds at most {_MAX_PAGE_SIZE} rows (the "
                "kernels address a page's rows with 32-bit offsets); the usual is 64"
            )
        # Megatron's sign convention: > 0 sizes from the balanced peak, < 0 from the observed one
        # (te_paged/stash/sizing.py); 0 device pages: every stash would spill or overflow.
        buffer_size_factor_cuda = check_factor(
            "buffer_size_factor_cuda", buffer_size_factor_cuda, zero_ok=False
        )
        buffer_size_factor_cpu = check_factor(
            "buffer_size_factor_cpu", buffer_size_factor_cpu, zero_ok=True
        )
        device = _current_device() if device is None else require_device("device", device)
        if device.type == "cuda" and device.index is None:
            # Compared with tensors' devices, which always carry an index.
            device = torch.device("cuda", torch.cuda.current_device())
        kernel_backend = getattr(kernel_backend, "value", kernel_backend)
        if kernel_backend not in backend_choices():
            allowed = ", ".join(repr(n) for n in backend_choices())
            raise ValueError(f"kernel_backend={kernel_backend!r} is not one of {allowed}")
        require_bool("zero_padding", zero_padding)
        require_bool("record_timeline", record_timeline)
        if stream_overlap is None:
            stream_overlap = device.type == "cuda"
        require_bool("stream_overlap", stream_overlap)
        if stream_overlap and device.type != "cuda":
            raise ValueError(
                f"stream_overlap=True needs a CUDA device, but this manager is on {device}: there "
                "are no streams to overlap on (leave it None: on for CUDA, off elsewhere)"
            )
        reload_lookahead = require_int("reload_lookahead", reload_lookahead, minimum=0)
        self.page_size = page_size
        self.buffer_size_factor_cuda = buffer_size_factor_cuda
        self.buffer_size_factor_cpu = buffer_size_factor_cpu
        self.device = torch.device(device)
        self.backend = resolve_backend(kernel_backend, self.device)
        self.zero_padding = zero_padding
        self.stream_overlap = stream_overlap
        self.reload_lookahead = reload_lookahead
        # Streams: the no-op base class without overlap (everything on the compute stream).
        self._streams: Streams = CudaStreams(self.device) if stream_overlap else Streams()
        self._last_side: dict = {PACK: None, UNPACK: None}  # events after the latest stash/pop
        self._last_group: _Group | None = None
        self._tensor_ids = 0  # names the resources of each paged tensor for the streams' fake
        self._disabled_depth = 0  # see disabled(): the one switch that turns stashing off
        self.mode = StashMode.CAPTURE
        self.flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=self.device)
        self.buffers: dict[StashKey, PagedStashBuffer] = {}
        self._peaks: dict[StashKey, _Peak] = {}
        self._scope: _Scope | None = None
        self._stashes = 0
        self._pops = 0
        self._capture_bytes = 0
        #: With ``record_timeline``, pool occupancy after every captured-mode stash and pop.
        #: Each event reads the pool state on the host: telemetry for small runs, not for speed.
        self.timeline: list[TimelineEvent] | None = [] if record_timeline else None
        self._live_rows: dict[StashKey, int] = {}
        # Every scope's (layer, num_tokens, max_num_tokens) of the current step (see
        # invalid_counts); reset() clears it, so it holds one step's small count tensors.
        self._step_counts: list[tuple[int | None, torch.Tensor, int]] = []
        # Bumped by reset()/release(), which hand every page out again: a handle stashed
        # before refuses to unpack (its rows may be another tensor's by now).
        self._generation = 0
        # A step boundary without reset(): an optimizer stepped after this manager stashed, and
        # reset() has not run since. The next stash warns (once): see _check_step_boundary.
        self._stepped_since_reset = False
        self._warned_no_reset = False
        self._allocations = 0  # pool allocations so far: the first sizes from the capture step
        self.pool_group = pool_group
        # Device pages per key that grow() set: a pool is never allocated smaller again.
        self._floors: dict[StashKey, int] = {}
        self._reallocate: set[StashKey] = set()  # pools the next reset() allocates anew
        handle = register_optimizer_step_post_hook(
            functools.partial(_note_optimizer_step, weakref.ref(self))
        )
        weakref.finalize(self, handle.remove)

    @classmethod
    def from_config(
        cls,
        config: object,
        device: torch.device | str | None = None,
        *,
        stream_overlap: bool | None = None,
        reload_lookahead: int = 1,
    ) -> PagedStashManager:
        """Build from an :class:`~te_paged.config.MoEConfig` (or anything with its fields), on
        ``device`` (default: the current accelerator, as the constructor's)."""
        return cls(
            page_size=config.moe_paged_stash_page_size,
            buffer_size_factor_cuda=config.moe_paged_stash_buffer_size_factor_cuda,
            buffer_size_factor_cpu=config.moe_paged_stash_buffer_size_factor_cpu,
            device=device,
            kernel_backend=config.moe_paged_stash_kernel_backend,
            stream_overlap=stream_overlap,
            reload_lookahead=reload_lookahead,
        )

    # ------------------------------------------------------------------------------ on / off

    @property
    def enabled(self) -> bool:
        """False while any :meth:`disabled` block is open: scopes then install no hooks."""
        return self._disabled_depth == 0

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Stash nothing inside this block (the runner's dropless rerun, a dropless forward).

        The only way to turn stashing off. Blocks are counted, so owners compose in any
        order: e.g. a runner's rerun and a layer's dropless forward both open one, and
        stashing comes back only when the last one closes. A scope opened while disabled
        stays a no-op for its whole block, even if the manager is re-enabled inside it.
        """
        self._disabled_depth += 1
        try:
            yield
        finally:
            self._disabled_depth -= 1

    # ----------------------------------------------------------------------------- lifecycle

    def reset(self) -> None:
        """Step boundary. After a capture step this allocates the pools (once); otherwise it
        returns every page and clears flags and counters in place, allocating nothing."""
        if self._scope is not None:
            raise RuntimeError("PagedStashManager.reset() called inside an open scope")
        self.join_side_streams()
        self._streams.note("reset", writes=["flags", *(("pool", k) for k in self.buffers)])
        self._last_group = None
        self._generation += 1
        if self.mode is StashMode.CAPTURE and self._peaks:
            self.mode = StashMode.CAPTURED
        if self._reallocate:  # grow(): the old pools go, the next lines allocate the new ones
            gone = [("pool", k) for k in self._reallocate if k in self.buffers]
            self._streams.note("regrow", releases=gone)
            for key in self._reallocate:
                self.buffers.pop(key, None)
            self._reallocate.clear()
        if self.mode is StashMode.CAPTURED and len(self.buffers) < len(self._peaks):
            self._allocate()
        for buffer in self.buffers.values():
            buffer.reset()
        self.flags.zero_()
        self._stashes = self._pops = self._capture_bytes = 0
        self._stepped_since_reset = False
        self._live_rows.clear()
        self._step_counts.clear()
        if self.timeline is not None:
            self.timeline.clear()
        for peak in self._peaks.values():
            peak.live_rows = peak.live_pages = 0
            peak.live_balanced = peak.live_balanced_pages = peak.live_static_pages = 0

    def clear_flags(self) -> None:
        """Zero the flags in place, keeping the pools and pages (allocation-free, sync-free):
        for a driver that reads the flags again after a rerun, e.g. Megatron's runner."""
        self.join_side_streams()
        self._streams.note("clear_flags", writes=["flags"])
        self.flags.zero_()

    def invalid_counts(self) -> list[tuple[int | None, int, int]]:
        """``(layer, num_tokens, max_num_tokens)`` of each scope of this step whose token count
        its static buffer cannot hold (negative, or more than ``max_num_tokens``): where an
        ``INVALID`` flag of the kernels came from. Reads every count on the host: for the error
        path after a step (the runners call it before raising ``InvalidCountsError``)."""
        self.join_side_streams()
        bad = []
        for layer, num_tokens, max_tokens in self._step_counts:
            n = int(num_tokens.item())
            if n < 0 or n > max_tokens:
                bad.append((layer, n, max_tokens))
        return bad

    def release(self) -> None:
        """Free every pool (e.g. before a dropless rerun); the next ``reset()`` reallocates them
        from the captured peaks."""
        self.join_side_streams()
        self._streams.note("release", releases=[("pool", k) for k in self.buffers])
        self._last_group = None
        self._generation += 1
        if self.buffers:
            logger.debug("freed the paged-stash pools (%s)", ", ".join(map(str, self.buffers)))
        self.buffers.clear()

    @property
    def reload_layers(self) -> int:
        """Layers of static-size reloads live at a step's peak: one (backward's current layer),
        plus the ``reload_lookahead`` prefetched ones when overlapping on streams."""
        return 1 + self.reload_lookahead if self._streams.overlap else 1

    def join_side_streams(self) -> None:
        """Make the current (compute) stream wait for all stash copies and reloads enqueued so
        far on the side streams: events, no host sync; a no-op without stream overlap. Call it
        before reading :attr:`flags` or a pool's state on the compute stream (``reset()``,
        ``stats()`` and the runners do)."""
        for stream in (PACK, UNPACK):
            self._streams.wait(COMPUTE, self._last_side[stream], "join")

    def pool_pages_for(self, key: StashKey) -> tuple[int, int]:
        """``(device pages, host pages)`` the pool of ``key`` gets from the captured peaks.

        Each factor's sign chooses the peak (Megatron's convention, see
        :mod:`te_paged.stash.sizing`): positive, the balanced-case peak; negative, the capture
        step's observed peak. Peaks are counted in pages (each live tensor's rows rounded up to
        whole pages), not rows: a tensor always occupies whole pages, so a rows-based size
        undercounts whenever tensors are small against the page size.
        """
        peak = self._peaks[key]
        balanced, observed = peak.peak_balanced_pages, peak.peak_pages
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

    def scale_static_peaks(self, ratio: float) -> None:
        """The static buffers grew by ``ratio`` since the capture step (a runner raised a
        receive budget): so do the capture step's static peaks, the bound pool growth keeps
        to (a pool of the old bound would overflow on every step the new buffers fill)."""
        if ratio > 1:
            for peak in self._peaks.values():
                peak.peak_static_pages = math.ceil(peak.peak_static_pages * ratio)
                peak.max_rows = math.ceil(peak.max_rows * ratio)

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

    # ---------------------------------------------------------------------------------- scope

    @contextlib.contextmanager
    def scope(
        self,
        max_num_tokens: int,
        num_tokens: torch.Tensor,
        avg_num_tokens: int,
        *,
        layer: int | None = None,
    ) -> Iterator[None]:
        """Page the marked tensors autograd saves inside this block.

        ``max_num_tokens`` is the static row count of the expert buffers, ``num_tokens`` a
        tensor on the manager's device holding the actual count (a prefix), ``avg_num_tokens``
        the balanced-case estimate used to size the pools. ``layer`` (the expert module's
        ``layer_number``) names the NVTX ranges of the stashes and pops
        (``te_paged.stash.layer<N>``).

        Saved tensors that an outer ``saved_tensors_hooks`` already owns are left to it: inside
        torch's non-reentrant checkpoint (its first forward and its recomputation) or
        ``save_on_cpu``, the scope installs nothing. Otherwise the inner hooks would win, and a
        checkpointed layer would be paged twice, its recomputed tensors never popped (pages
        held to the step's end, the pool sized double). A reentrant checkpoint (Megatron's
        full and ``moe`` recompute) runs its first forward without grad, saving nothing, and
        its recomputation in backward with no outer hooks: that forward is paged and popped
        layer by layer.
        """
        if not self.enabled:
            yield
            return
        if self._scope is not None:
            raise RuntimeError("paged-stash scopes do not nest: one scope per expert group")
        if _saved_tensors_owned_outside():
            yield
            return
        if not isinstance(num_tokens, torch.Tensor) or num_tokens.numel() != 1:
            raise TypeError("num_tokens must be a one-element integer tensor on the device")
        if num_tokens.dtype.is_floating_point or num_tokens.dtype == torch.bool:
            raise TypeError(f"num_tokens must be an integer tensor, got {num_tokens.dtype}")
        self._check_device("num_tokens", num_tokens)
        require_int("max_num_tokens", max_num_tokens, minimum=1)
        require_int("avg_num_tokens", avg_num_tokens, minimum=0)
        if layer is not None:
            require_int("layer", layer, minimum=0)
        group = None
        if self._streams.overlap and self.mode is StashMode.CAPTURED:
            last = self._last_group
            same_pass = last is not None and (
                layer is None or last.layer is None or last.layer < layer
            )  # layer numbers rise through a forward pass; a fall starts a new one
            group = self._last_group = _Group(layer, last if same_pass else None)
        self._scope = _Scope(max_num_tokens, num_tokens.reshape(1), avg_num_tokens, layer, group)
        # Kept (a reference, no copy) for invalid_counts(): which layer an INVALID flag came from.
        self._step_counts.append((layer, self._scope.num_tokens, max_num_tokens))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._scope = None

    def _check_device(self, name: str, t: torch.Tensor) -> None:
        if t.device == self.device:
            return
        raise ValueError(
            f"{name} is on {t.device} but this PagedStashManager is on {self.device}: build the "
            f"manager on the device the experts compute on, e.g. PagedStashManager(..., "
            f"device='{t.device}') or PagedStashManager.from_config(config, '{t.device}') (the "
            "default is CUDA's current device when CUDA is available, else the CPU)"
        )

    def _check_step_boundary(self) -> None:
        if not self._stepped_since_reset or self._warned_no_reset:
            return
        self._warned_no_reset = True
        state = (
            "still in capture mode: it reads token counts on the host at every stash and keeps "
            "exact-size copies instead of a pool"
            if self.mode is StashMode.CAPTURE
            else "keeping the last step's pages, flags and counters: an overflow flag stays "
            "set, and every later stash of this manager is then a no-op"
        )
        warnings.warn(
            "PagedStashManager: a new step is stashing, but reset() was not called after the "
            f"last optimizer step; the manager is {state}. Call manager.reset() at every step "
            "boundary, or drive the step with PagedStashRunner / MegatronPagedStashRunner, "
            "which do it for you.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _layout(self, t: torch.Tensor, kind: MarkerKind, scope: _Scope) -> tuple[StashKey, int]:
        per_row = kind.tokens_per_row
        if scope.max_num_tokens % per_row:
            raise ValueError(
                f"an MXFP8 scale-inverse has one row per {per_row} tokens, but "
                f"max_num_tokens={scope.max_num_tokens} is not a multiple of {per_row}: "
                f"pad the budget to a multiple of {per_row}"
            )
        max_rows = scope.max_num_tokens // per_row
        if t.numel() % max_rows:
            raise ValueError(
                f"marked saved tensor of shape {tuple(t.shape)} ({t.numel()} elements) is not "
                f"{max_rows} token rows (max_num_tokens={scope.max_num_tokens}, "
                f"{per_row} token(s) per row): only token-major [max_num_tokens, ...] tensors "
                "may be marked"
            )
        if t.shape[0] != max_rows:  # numel may divide for a transposed or reshaped tensor
            raise ValueError(
                f"marked saved tensor of shape {tuple(t.shape)} is not token-major: its first "
                f"dimension must be the scope's {max_rows} rows (max_num_tokens="
                f"{scope.max_num_tokens}, {per_row} token(s) per row); mark the [rows, ...] "
                "tensor itself, not a transposed or flattened view"
            )
        return StashKey(t.dtype, t.numel() // max_rows), max_rows

    def _pack(self, t: torch.Tensor) -> object:
        scope = self._scope
        kind = grouped_tensor_marker(t)
        if scope is None or kind is None or t.dim() == 0 or t.numel() == 0:
            return t
        if is_checkpoint_without_output_tensor(t):
            return t  # recompute owns this storage (and every view of it)
        self._check_device("a marked saved tensor", t)
        # The same bytes saved again (the same tensor, or a view with its layout) while the
        # tensor paged first is alive, so its storage is: one copy serves both.
        layout = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
        seen = scope.paged.get(layout)
        if seen is not None and seen[0]() is not None and seen[1] == t._version:
            return seen[2]
        handle = self._pack_new(t, kind, scope)
        scope.paged[layout] = (weakref.ref(t), t._version, handle)
        return handle

    def _pack_new(self, t: torch.Tensor, kind: MarkerKind, scope: _Scope) -> object:
        key, max_rows = self._layout(t, kind, scope)
        rows_RH = t.contiguous().view(max_rows, key.hidden).view(storage_dtype(t.dtype))
        self._check_step_boundary()
        self._stashes += 1
        if self.mode is StashMode.CAPTURE:
            return self._capture_pack(t, key, kind, max_rows, rows_RH, scope)
        buffer = self.buffers.get(key)
        if buffer is None and key in self._peaks:
            raise RuntimeError(
                "the pools were freed by release() and not allocated again: call reset() at "
                "the step boundary before the next forward (it reallocates them)"
            )
        if buffer is None:
            raise RuntimeError(
                f"saved tensor with key {key} was not seen during the capture step (keys: "
                f"{sorted(map(str, self._peaks))}): every (dtype, hidden) the layers stash must "
                "appear in the first step, which sizes the pools; use a new manager for a model "
                "whose stashed tensors change"
            )
        pages_M = torch.empty(-(-max_rows // self.page_size), dtype=torch.int32, device=t.device)
        meta = torch.empty(META_LEN, dtype=torch.int64, device=t.device)
        args = (*buffer.kernel_args(), self.flags, pages_M, meta)
        self._tensor_ids += 1

        def copy() -> None:
            with nvtx_range("te_paged.stash", scope.layer):
                stash_copy(self.backend, rows_RH, scope.num_tokens, kind.tokens_per_row,
                           self.page_size, *args)  # fmt: skip

        if self._streams.overlap:
            self._stash_on_side(copy, self._tensor_ids, key, rows_RH, scope, (pages_M, meta))
        else:
            copy()
        self._trace("stash", buffer, meta)
        handle = _Paged(
            id=self._tensor_ids,
            buffer=buffer,
            max_rows=max_rows,
            pages_M=pages_M,
            meta=meta,
            shape=t.shape,
            dtype=t.dtype,
            generation=self._generation,
            layer=scope.layer,
        )
        if scope.group is not None:
            handle.group = scope.group
            scope.group.handles.append(handle)
        return handle

    def _stash_on_side(
        self,
        copy,
        tid: int,
        key: StashKey,
        rows_RH: torch.Tensor,
        scope: _Scope,
        record: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Enqueue a stash copy on the pack stream (rules in :mod:`te_paged.stash.streams`)."""
        s = self._streams
        source, rec = ("source", tid), ("record", tid)
        s.note("produce", writes=[source, rec])  # the layer's output and the record's memory
        produced = s.record(COMPUTE)
        s.wait(PACK, produced, "stash after produce")
        s.wait(PACK, self._last_side[UNPACK], "reuse after pop")
        s.launch(PACK, copy, "stash", reads=[source],
                 writes=[("pages", tid), ("pool", key), rec, "flags"])  # fmt: skip
        self._last_side[PACK] = s.record(PACK)
        # The source (often a temporary .contiguous() copy) and the token count are freed by
        # the caller from now on: their memory must not be reused before the copy read them.
        s.keep_until(rows_RH, source, PACK, "keep source")
        s.keep_until(scope.num_tokens, source, PACK, "keep source")
        for t in record:
            s.keep_until(t, rec, PACK, "keep record")
        s.note("drop source", releases=[source])

    def _capture_pack(
        self,
        t: torch.Tensor,
        key: StashKey,
        kind: MarkerKind,
        max_rows: int,
        rows_RH: torch.Tensor,
        scope: _Scope,
    ) -> object:
        n = int(scope.num_tokens.item())  # the capture step may read counts on the host
        rows = -(-n // kind.tokens_per_row)
        if n < 0 or rows > max_rows:  # invalid input (the kernels flag it the same way)
            self.flags[Flag.INVALID] += 1
            rows = min(max(rows, 0), max_rows)
        self._capture_bytes += rows * key.hidden * rows_RH.element_size()
        balanced = min(max_rows, -(-scope.avg_num_tokens // kind.tokens_per_row))
        peak = self._peaks.setdefault(key, _Peak())
        peak.live_rows += rows
        peak.live_pages += -(-rows // self.page_size)
        peak.live_balanced += balanced
        peak.live_balanced_pages += -(-balanced // self.page_size)
        peak.peak_rows = max(peak.peak_rows, peak.live_rows)
        peak.peak_pages = max(peak.peak_pages, peak.live_pages)
        peak.peak_balanced = max(peak.peak_balanced, peak.live_balanced)
        peak.peak_balanced_pages = max(peak.peak_balanced_pages, peak.live_balanced_pages)
        peak.live_static_pages += -(-max_rows // self.page_size)
        peak.peak_static_pages = max(peak.peak_static_pages, peak.live_static_pages)
        peak.max_rows = max(peak.max_rows, max_rows)
        handle = _Captured(
            key=key,
            max_rows=max_rows,
            rows=rows,
            rows_RH=rows_RH[:rows].clone(),
            shape=t.shape,
            dtype=t.dtype,
            balanced=balanced,
            generation=self._generation,
        )
        return handle

    def _unpack(self, handle: object) -> torch.Tensor:
        if isinstance(handle, (_Paged, _Captured)) and handle.reloaded is None:
            if handle.generation != self._generation:
                raise RuntimeError(
                    "backward reached a tensor stashed before the last reset()/release(), "
                    "which handed its pages out again: it cannot be reloaded. Call reset() at "
                    "step boundaries only, after every backward of the step (the runners do)"
                )
        if isinstance(handle, _Paged) and self._streams.overlap:
            return self._unpack_on_side(handle)
        if isinstance(handle, _Paged):
            if handle.reloaded is None:
                buffer = handle.buffer
                out_RH = torch.empty(
                    handle.max_rows,
                    buffer.key.hidden,
                    dtype=buffer.pool_NH.dtype,
                    device=buffer.device,
                )
                args = (*buffer.kernel_args(), self.flags, handle.pages_M, handle.meta)
                with nvtx_range("te_paged.pop", handle.layer):
                    stash_pop(self.backend, out_RH, self.page_size, *args, self.zero_padding)
                self._trace("pop", buffer, handle.meta)
                handle.reloaded = out_RH.view(handle.dtype).view(handle.shape)
                self._pops += 1
            return handle.reloaded
        if isinstance(handle, _Captured):
            if handle.reloaded is None:
                out_RH = torch.empty(
                    handle.max_rows,
                    handle.key.hidden,
                    dtype=handle.rows_RH.dtype,
                    device=handle.rows_RH.device,
                )
                out_RH[: handle.rows].copy_(handle.rows_RH)
                if self.zero_padding:
                    out_RH[handle.rows :].zero_()
                peak = self._peaks[handle.key]
                peak.live_rows -= handle.rows
                peak.live_pages -= -(-handle.rows // self.page_size)
                peak.live_balanced -= handle.balanced
                peak.live_balanced_pages -= -(-handle.balanced // self.page_size)
                peak.live_static_pages -= -(-handle.max_rows // self.page_size)
                handle.rows_RH = None
                handle.reloaded = out_RH.view(handle.dtype).view(handle.shape)
                self._pops += 1
            return handle.reloaded
        return handle

    def _unpack_on_side(self, handle: _Paged) -> torch.Tensor:
        """Reload ``handle`` (and the rest of its scope) on the unpack stream if not yet done,
        prefetch the ``reload_lookahead`` scopes before it, then make the compute stream wait
        for ``handle``'s reload, once."""
        group = handle.group
        if handle.reloaded is None:
            for h in [handle, *(group.handles if group is not None else ())]:
                if h.reloaded is None:
                    self._reload(h)
        prev = group.prev if group is not None else None
        for _ in range(self.reload_lookahead):
            if prev is None:
                break
            for h in list(prev.handles):
                if h.reloaded is None and h.generation == self._generation:
                    self._reload(h)
            prev = prev.prev
        if not handle.used:
            self._streams.wait(COMPUTE, handle.reload_event, "use after reload")
            handle.used = True
        self._streams.note("use reload", reads=[("reload", handle.id)])
        return handle.reloaded

    def _reload(self, handle: _Paged) -> None:
        """Enqueue ``handle``'s pop on the unpack stream into a buffer allocated on the compute
        stream; its pages go back to the free list when the pop completes."""
        s, buffer = self._streams, handle.buffer
        tid = handle.id
        reload, rec = ("reload", tid), ("record", tid)
        out_RH = torch.empty(
            handle.max_rows, buffer.key.hidden, dtype=buffer.pool_NH.dtype, device=buffer.device
        )
        s.note("allocate reload", writes=[reload])
        allocated = s.record(COMPUTE)
        args = (*buffer.kernel_args(), self.flags, handle.pages_M, handle.meta)

        def pop() -> None:
            with nvtx_range("te_paged.pop", handle.layer):
                stash_pop(self.backend, out_RH, self.page_size, *args, self.zero_padding)

        s.wait(UNPACK, allocated, "reload after alloc")
        s.wait(UNPACK, self._last_side[PACK], "pop after stash")
        s.launch(UNPACK, pop, "pop", reads=[("pages", tid), rec, "flags"],
                 writes=[reload, ("pool", buffer.key)])  # fmt: skip
        handle.reload_event = self._last_side[UNPACK] = s.record(UNPACK)
        # Freed on the compute stream whenever autograd drops them (a prefetched reload that
        # backward never uses included): not reused before the pop completed.
        s.keep_until(out_RH, reload, UNPACK, "keep reload")
        for t in (handle.pages_M, handle.meta):
            s.keep_until(t, rec, UNPACK, "keep record")
        s.note("drop record", releases=[rec])
        s.note("drop reload", releases=[reload])
        handle.reloaded = out_RH.view(handle.dtype).view(handle.shape)
        if handle.group is not None:
            handle.group.handles.remove(handle)  # the look-ahead keeps no reload alive
        self._trace("pop", buffer, handle.meta)
        self._pops += 1

    # ------------------------------------------------------------------------------ reporting

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
            capture_peak_balanced_rows={str(k): p.peak_balanced for k, p in self._peaks.items()},
            capture_peak_balanced_pages={
                str(k): p.peak_balanced_pages for k, p in self._peaks.items()
            },
            capture_peak_pages={str(k): p.peak_pages for k, p in self._peaks.items()},
            capture_peak_static_pages={str(k): p.peak_static_pages for k, p in self._peaks.items()},
            pages_demanded=demanded,
        )


def _note_optimizer_step(ref: weakref.ref, optimizer: object, args: object, kwargs: object) -> None:
    """Global optimizer-step hook of one manager (weakly held): an optimizer step after the
    manager stashed is a step boundary, after which reset() must come before the next stash."""
    manager = ref()
    if manager is not None and manager._stashes:
        manager._stepped_since_reset = True


def _saved_tensors_owned_outside() -> bool:
    """Whether a ``saved_tensors_hooks`` context is already active (torch keeps one stack)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
