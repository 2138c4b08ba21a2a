"""The paged-stash manager: its lifecycle and flags. Its pools (:mod:`te_paged.stash.pools`),
the saved-tensor hooks that page and reload (:mod:`te_paged.stash.packing`), the scope that
installs them (:mod:`te_paged.stash.scopes`) and its statistics (:mod:`te_paged.stash.stats`)
are mixins in their own modules.

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
import functools
import logging
import warnings
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from te_paged.config import MoEConfig
from te_paged.config.checks import (
    require_bool,
    require_device,
    require_int,
)
from te_paged.kernels import KernelBackend, backend_choices, resolve_backend
from te_paged.kernels.compiled import (
    StashPort,
    StashSite,
    compile_used,
)
from te_paged.kernels.layout import FLAGS_LEN, Flag
from te_paged.stash.buffer import (
    PagedStashBuffer,
    StashKey,
)
from te_paged.stash.packing import Packing, _Group, _Scope
from te_paged.stash.pools import PoolAllocation, _Peak
from te_paged.stash.scopes import Scopes
from te_paged.stash.sizing import check_factor
from te_paged.stash.stats import StashMode, StashReporting, StashStats
from te_paged.stash.streams import COMPUTE, PACK, UNPACK, CudaStreams, Streams
from te_paged.telemetry import TimelineEvent

__all__ = ["PagedStashManager", "StashMode", "StashStats"]

logger = logging.getLogger(__name__)
_MAX_PAGE_SIZE = 2**31 - 1


def _current_device() -> torch.device:
    """Where the model computes by default: CUDA's current device when CUDA is available (this
    initialises CUDA, so it is called at construction, never at import), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PagedStashManager(PoolAllocation, Packing, Scopes, StashReporting):
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

    ``skip_immediate_backward`` keeps unpaged the tensors of the scopes whose backward
    follows their forward at once (found in the capture step, by the order scopes open; see
    :mod:`te_paged.stash.packing`): no copy into pages and straight back, and pools sized
    without them. Gradients are the same either way; :attr:`StashStats.stashes_skipped`
    counts the tensors kept.

    ``max_tokens_per_rank`` (default ``None``) declares the largest microbatch, in tokens per
    rank entering the MoE layers, that any step will bring (variable-length workloads: packed
    sequences, RL rollouts, batching by token count); ``router_topk`` (required with it) turns
    it into the rows a scope's tensors scale with (``avg_num_tokens`` is tokens x top-k). The
    capture step then sizes the pools as if each of its tensors came from a microbatch that
    large, so that no later step outgrows them. Without it the pools are sized from the capture
    step's microbatches and a runner grows them at each new maximum
    (docs/choosing-factors.md, "Variable-length workloads").
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
        skip_immediate_backward: bool = True,
        max_tokens_per_rank: int | None = None,
        router_topk: int | None = None,
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
        require_bool("skip_immediate_backward", skip_immediate_backward)
        self.page_size = page_size
        self.buffer_size_factor_cuda = buffer_size_factor_cuda
        self.buffer_size_factor_cpu = buffer_size_factor_cpu
        self.device = torch.device(device)
        self.backend = resolve_backend(kernel_backend, self.device)
        self.zero_padding = zero_padding
        self.stream_overlap = stream_overlap
        self.reload_lookahead = reload_lookahead
        self.skip_immediate_backward = skip_immediate_backward
        self.max_tokens_per_rank: int | None = None
        self._declared_tokens = 0  # max_tokens_per_rank x router_topk: the rows it scales to
        # Paged steps' static pages per key: (live, peak) this step, and the largest peak of any
        # step so far (te_paged.stash.pools: the bound of pool growth).
        self._step_static: dict[StashKey, list[int]] = {}
        self._static_seen: dict[StashKey, int] = {}
        # skip_immediate_backward (te_paged.stash.packing): the scopes the capture step found
        # immediate, by their place in the step's order; the scopes opened in this step; the
        # (index, layer) of the scope whose first pop would make it immediate (capture) or that
        # a paged step keeps unpaged and has not popped yet; the capture step's stashes and
        # pops in order, to recount the pool peaks without the immediate scopes.
        self._immediate: set[int] = set()
        self._scopes_opened = 0
        self._pending: tuple[int, int | None] | None = None
        self._capture_log: list = []
        self._skipped = 0
        self._warned_skip_missed = False
        # Streams: the no-op base class without overlap (everything on the compute stream).
        self._streams: Streams = CudaStreams(self.device) if stream_overlap else Streams()
        self._last_side: dict = {PACK: None, UNPACK: None}  # events after the latest stash/pop
        self._last_group: _Group | None = None
        self._tensor_ids = 0  # names the resources of each paged tensor for the streams' fake
        self._disabled_depth = 0  # see disabled(): the one switch that turns stashing off
        # torch.compile (te_paged.kernels.compiled): this manager and an unnamed layer as op
        # arguments, and the handles a compiled forward saved under tickets, until loaded.
        self._port, self._site = StashPort(self), StashSite()
        self._tickets: dict[int, object] = {}
        self._ticket_ids = 0
        self._traced_scopes: dict[int, _Scope | None] = {}  # id -> scope (None: outer hooks')
        self._traced_ids = 0
        # paged_nothing(): this step's scopes opened with grad, those an outer saved-tensor
        # hooks context owned, those a compiled graph opened, saved tensors the hooks passed
        # unmarked; and whether the warning was given.
        self._step_scopes = self._step_scopes_outside = self._step_scopes_traced = 0
        self._step_unmarked = 0
        self._warned_paged_nothing = False
        self.mode = StashMode.CAPTURE
        self.flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=self.device)
        self.buffers: dict[StashKey, PagedStashBuffer] = {}
        self._peaks: dict[StashKey, _Peak] = {}
        self._scope: _Scope | None = None
        self._scope_owned_outside = False  # the open scope left its tensors to outer hooks
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
        if max_tokens_per_rank is not None:
            self.declare_max_tokens_per_rank(max_tokens_per_rank, router_topk)
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
            # Megatron's TransformerConfig has no such field: te_paged's default there.
            skip_immediate_backward=getattr(
                config,
                "moe_paged_stash_skip_immediate_backward",
                MoEConfig.moe_paged_stash_skip_immediate_backward,
            ),
            # Nor this one (None there: sized from the capture step, grown by a runner).
            max_tokens_per_rank=getattr(config, "moe_max_tokens_per_rank", None),
            router_topk=(
                config.moe_router_topk
                if getattr(config, "moe_max_tokens_per_rank", None) is not None
                else None
            ),
        )

    def declare_max_tokens_per_rank(self, tokens: int | None, router_topk: int | None) -> None:
        """Declare (or, with ``None``, withdraw) the largest microbatch of any step, in tokens
        per rank, with the router's top-k (see the class docstring). Before the capture step
        only: it sizes the pools from what that step records."""
        if tokens is None:
            self.max_tokens_per_rank, self._declared_tokens = None, 0
            return
        tokens = require_int("max_tokens_per_rank", tokens, minimum=1)
        if router_topk is None:
            raise ValueError(
                f"max_tokens_per_rank={tokens} needs router_topk (the router's top-k): a "
                "scope's rows are tokens x top-k. PagedStashManager.from_config(config) "
                "takes both from the config"
            )
        router_topk = require_int("router_topk", router_topk, minimum=1)
        if self.mode is not StashMode.CAPTURE or self._peaks:
            raise RuntimeError(
                f"max_tokens_per_rank={tokens} declared after the capture step began: the "
                "pools are sized from what it recorded. Declare it before the first step (on "
                "the manager, the runner or MoEConfig.moe_max_tokens_per_rank)"
            )
        self.max_tokens_per_rank, self._declared_tokens = tokens, tokens * router_topk

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
        self.paged_nothing()  # the step that ends here: said once if it paged nothing
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
        self._stashes = self._pops = self._capture_bytes = self._skipped = 0
        self._scopes_opened, self._pending = 0, None
        self._tickets.clear()
        self._traced_scopes.clear()
        self._step_scopes = self._step_scopes_outside = self._step_scopes_traced = 0
        self._step_unmarked = 0
        self._capture_log.clear()
        self._stepped_since_reset = False
        self._live_rows.clear()
        self._fold_step_static()
        self._step_counts.clear()
        if self.timeline is not None:
            self.timeline.clear()
        for peak in self._peaks.values():
            peak.clear_live()

    def add_flag(self, flag: Flag, count: torch.Tensor) -> None:
        """Add ``count`` (a one-element integer tensor on the device) to ``flag``: in place,
        no read. Under torch.compile an op of the graph (``te_paged::flag_add``), ordered with
        the stash's own: the flags are written by kernels the compiler does not see, so they
        are never a graph value it could write back over them."""
        if torch.compiler.is_compiling():
            torch.ops.te_paged.flag_add(count, self._port, int(flag))
        else:
            self.flags[flag] += count

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
        self._tickets.clear()  # a compiled forward's handles whose backward never ran
        self._traced_scopes.clear()

    def paged_nothing(self) -> str | None:
        """Why this step (since the last ``reset()``) paged nothing, although stashing was on
        and scopes opened with grad enabled; None when it paged, kept or captured a tensor, or
        opened no such scope. The first time a step pages nothing the cause is logged at
        WARNING (once per manager); the runners put it in the step record. Host counters only.
        """
        if not self._step_scopes or self._stashes or self._skipped:
            return None
        cause = self._paged_nothing_cause()
        if not self._warned_paged_nothing:
            self._warned_paged_nothing = True
            logger.warning(
                "PagedStashManager: paged stash is on and this step opened %d scope(s) with "
                "grad enabled, but paged nothing: %s. The saved activations stayed at their "
                "static size: no memory was saved.",
                self._step_scopes,
                cause,
            )
        return cause

    def _paged_nothing_cause(self) -> str:
        if self._step_scopes_outside == self._step_scopes:
            return (
                "an outer saved_tensors_hooks context owned what autograd saved in every "
                "scope (torch.autograd.graph.save_on_cpu, or torch.utils.checkpoint with "
                "use_reentrant=False around the experts), and te_paged leaves those tensors to "
                "it; open the scopes outside such a context, or use a reentrant checkpoint"
            )
        compiled = compile_used()
        if self._step_scopes_traced:
            return (
                "the scopes a compiled graph opened saved no marked tensor through "
                "te_paged.stash.save_for_backward: under torch.compile only te_paged's autograd "
                "functions (and producers that save through that helper) page; a marker on a "
                "tensor a plain op saves is not seen there"
            )
        if compiled:
            return (
                f"the scopes' hooks saw {self._step_unmarked} saved tensor(s), none marked, and "
                "torch.compile ran in this process: what a compiled region saves are the "
                "compiler's values, not the objects the producers marked. Compile the whole "
                "MoE layer (te_paged's scope inside the compiled code), or leave it eager"
            )
        return (
            f"the scopes' hooks saw {self._step_unmarked} saved tensor(s), none marked: the "
            "layers' producers marked nothing (moe_paged_stash off in the layers' config, or "
            "a producer that does not call mark_grouped_tensor on what it saves)"
        )

    @property
    def stashes_skipped(self) -> int:
        """Saved tensors kept unpaged in this step so far (``skip_immediate_backward``): a host
        counter, no read."""
        return self._skipped

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
        # Covered: every later stash or pop first waits on a compute-stream event recorded
        # after this join. Forgetting them also keeps a CUDA graph captured after a reset from
        # waiting on events recorded before the capture (cudaErrorStreamCaptureIsolation).
        self._last_side = {PACK: None, UNPACK: None}

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


def _note_optimizer_step(ref: weakref.ref, optimizer: object, args: object, kwargs: object) -> None:
    """Global optimizer-step hook of one manager (weakly held): an optimizer step after the
    manager stashed is a step boundary, after which reset() must come before the next stash."""
    manager = ref()
    if manager is not None and (manager._stashes or manager._skipped):
        manager._stepped_since_reset = True
