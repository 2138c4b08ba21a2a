"""The streams the manager orders its stash copies and reloads on, and a checking fake.

On CUDA (``stream_overlap``, the default there) a manager copies a layer's saved tensors into
the pool on a *pack* stream and reloads them on a separate *unpack* stream, so that both overlap
the expert GEMMs on the *compute* stream (the stream current when the manager is used). Every
dependency between streams is an event, never a host synchronisation, so a step stays sync-free
and capturable in a CUDA graph. The manager states each dependency through :class:`Streams`:

``record(stream)``
    An event after the work enqueued on ``stream`` so far.
``wait(stream, event, why)``
    Work enqueued on ``stream`` from now on starts after ``event``; ``why`` names the rule the
    wait keeps (below), for the fake's mutation tests.
``launch(stream, fn, name, reads, writes)``
    Enqueue ``fn`` (a kernel) on ``stream``; ``reads``/``writes`` name what it touches.
``note(name, reads, writes, releases)``
    Work the compute stream does outside the manager (producing a saved tensor, using a
    reload, freeing a buffer), for the fake's checker; nothing on CUDA.
``keep_until(tensor, resource, stream, why)``
    ``tensor``'s memory is not reused before the work enqueued on ``stream`` so far completed,
    even if it is freed on the host now (CUDA: ``Tensor.record_stream``).

The rules the manager's waits keep (the ``why`` of each):

* ``stash after produce`` — a stash copy reads its source after the compute stream wrote it;
* ``reuse after pop`` — a stash takes pages only after every earlier pop (which may have freed
  them) completed; with ``pop after stash`` this makes the pool's bookkeeping (free list,
  counters, flags) one sequence in the order the host issued it;
* ``pop after stash`` — a pop reads pages only after the stash that filled them completed;
* ``reload after alloc`` — a reload writes its buffer only after the compute stream's earlier
  work, which may still use that memory, completed;
* ``use after reload`` — the compute stream uses a reload only after it completed;
* ``join`` — the compute stream reads flags and counters, or resets the pools, only after all
  side-stream work completed;
* ``keep source`` / ``keep record`` / ``keep reload`` — a buffer used on a side stream is not
  reused before that use completed.

:class:`RecordingStreams` keeps the program (every launch, note, record and wait, in host
order), runs side-stream work as late as the waits allow (so a missing wait shows as wrong data
too), and :func:`check_program` finds every access that is not ordered after the one it
depends on. Dropping the waits of one ``why`` (``drop=``) is the mutation test of that rule.
Its :meth:`RecordingStreams.capture` adds the two rules CUDA graph capture enforces on a
capture that forks side streams (isolation and join), so that a capture's failures show on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Hashable, Iterable

import torch

__all__ = [
    "COMPUTE",
    "PACK",
    "UNPACK",
    "CaptureError",
    "CudaStreams",
    "Event",
    "Hazard",
    "RecordingStreams",
    "Streams",
    "check_program",
]


class Stream(enum.Enum):
    COMPUTE = "compute"
    PACK = "pack"
    UNPACK = "unpack"


COMPUTE, PACK, UNPACK = Stream.COMPUTE, Stream.PACK, Stream.UNPACK


class Event:
    """A point in a stream's work (:meth:`Streams.record`)."""


class Streams:
    """The interface (module docstring). The base class is the CUDA-free no-op: nothing to
    order, as every stream is the compute stream."""

    overlap = False

    def record(self, stream: Stream) -> Event | None:
        return None

    def wait(self, stream: Stream, event: Event | None, why: str) -> None:
        return None

    def launch(
        self,
        stream: Stream,
        fn: Callable[[], None],
        name: str,
        reads: Iterable[Hashable] = (),
        writes: Iterable[Hashable] = (),
    ) -> None:
        fn()

    def note(
        self,
        name: str,
        reads: Iterable[Hashable] = (),
        writes: Iterable[Hashable] = (),
        releases: Iterable[Hashable] = (),
    ) -> None:
        return None

    def keep_until(
        self, tensor: torch.Tensor, resource: Hashable, stream: Stream, why: str
    ) -> None:
        return None


class _CudaEvent(Event):
    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event


class CudaStreams(Streams):
    """A pack and an unpack stream on ``device``, created on first use; the compute stream is
    whichever stream is current when the manager is called (as torch's own ops use)."""

    overlap = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side: dict[Stream, torch.cuda.Stream] = {}

    def _stream(self, stream: Stream) -> torch.cuda.Stream:
        if stream is COMPUTE:
            return torch.cuda.current_stream(self.device)
        s = self._side.get(stream)
        if s is None:
            s = self._side[stream] = torch.cuda.Stream(self.device)
        return s

    def record(self, stream: Stream) -> Event:
        event = torch.cuda.Event()
        event.record(self._stream(stream))
        return _CudaEvent(event)

    def wait(self, stream: Stream, event: Event | None, why: str) -> None:
        if event is not None:
            self._stream(stream).wait_event(event.event)

    def launch(self, stream, fn, name, reads=(), writes=()) -> None:
        with torch.cuda.stream(self._stream(stream)):
            fn()

    def keep_until(
        self, tensor: torch.Tensor, resource: Hashable, stream: Stream, why: str
    ) -> None:
        tensor.record_stream(self._stream(stream))


# ------------------------------------------------------------------------------ the fake


@dataclasses.dataclass(frozen=True)
class _FakeEvent(Event):
    stream: Stream
    position: int  # the stream's launches before it
    index: int = -1  # its record op in the program (-1: not recorded, e.g. a drain's)
    captured: bool = False  # recorded on a stream inside a graph capture (a node of the graph)


class CaptureError(RuntimeError):
    """A wait or launch that CUDA stream capture refuses (:meth:`RecordingStreams.capture`)."""


@dataclasses.dataclass
class _Op:
    """One entry of the recorded program."""

    index: int  # host order
    stream: Stream
    kind: str  # "launch" | "note" | "record" | "wait" | "keep"
    name: str = ""
    reads: tuple = ()
    writes: tuple = ()
    releases: tuple = ()
    event: _FakeEvent | None = None
    why: str = ""
    fn: Callable[[], None] | None = None


@dataclasses.dataclass(frozen=True)
class Hazard:
    """An access not ordered after the access it depends on."""

    rule: str
    resource: Hashable
    first: str  # the earlier access (host order), "op #i name"
    second: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.second} is not ordered after {self.first} ({self.resource})"


class RecordingStreams(Streams):
    """The checking fake: records the program and runs side-stream work lazily.

    ``lazy=True`` (default) runs a side stream's work only when the compute stream waits for it
    (directly or through another stream), or at :meth:`drain`: the latest moment any order the
    waits allow. ``drop`` is a set of ``why`` labels whose waits and keeps are ignored (the
    mutation tests); each dropped call is still counted in :attr:`dropped`.
    """

    overlap = True

    def __init__(self, *, lazy: bool = True, drop: Iterable[str] = ()) -> None:
        self.lazy = lazy
        self.drop = frozenset(drop)
        self.program: list[_Op] = []
        self.whys: dict[str, int] = {}  # every why asked for, and how often
        self.dropped: dict[str, int] = {}
        self._queued: dict[Stream, list[_Op]] = {PACK: [], UNPACK: []}
        self._done: dict[Stream, int] = {PACK: 0, UNPACK: 0}
        self._length: dict[Stream, int] = {COMPUTE: 0, PACK: 0, UNPACK: 0}
        self._capturing: set[Stream] | None = None  # the streams in the open capture, if any

    @contextlib.contextmanager
    def capture(self):
        """The program inside is a CUDA graph captured on the compute stream (as under
        ``torch.cuda.graph``), with the rules CUDA enforces on the side streams it forks:

        * a side stream joins the capture by waiting on an event recorded inside it; work
          launched on a side stream that has not joined would not be in the graph (CUDA runs
          it once, eagerly; a replay skips it), so it is refused here;
        * isolation (``cudaErrorStreamCaptureIsolation``): a stream in the capture may not wait
          on an event recorded outside it, e.g. before the capture began;
        * join (``cudaErrorStreamCaptureUnjoined``): when the capture ends, the compute stream
          has waited on the last launch of every side stream that joined.

        Each refusal raises :class:`CaptureError`, naming the CUDA error.
        """
        if self._capturing is not None:
            raise CaptureError("a capture is already open")
        self._capturing = {COMPUTE}
        try:
            yield
            stamps = _vector_clocks(self.program)
            seen = next((c for s, _, c in reversed(stamps) if s is COMPUTE), {})
            for stream in sorted(self._capturing - {COMPUTE}, key=lambda s: s.value):
                launched = sum(op.stream is stream and op.kind == "launch" for op in self.program)
                if seen.get(stream, 0) < launched:
                    raise CaptureError(
                        f"cudaErrorStreamCaptureUnjoined: the {stream.value} stream's last work "
                        "in the capture is not waited on by the compute stream when it ends"
                    )
        finally:
            self._capturing = None

    def _add(self, op: _Op) -> _Op:
        self.program.append(op)
        return op

    def _skip(self, why: str) -> bool:
        self.whys[why] = self.whys.get(why, 0) + 1
        if why in self.drop:
            self.dropped[why] = self.dropped.get(why, 0) + 1
            return True
        return False

    def record(self, stream: Stream) -> Event:
        captured = self._capturing is not None and stream in self._capturing
        event = _FakeEvent(stream, self._length[stream], len(self.program), captured)
        self._add(_Op(len(self.program), stream, "record", event=event))
        return event

    def wait(self, stream: Stream, event: Event | None, why: str) -> None:
        if event is None or self._skip(why):
            return
        if self._capturing is not None:
            self._capture_wait(stream, event, why)
        op = self._add(_Op(len(self.program), stream, "wait", event=event, why=why))
        if stream is COMPUTE:
            self._run_to(event)  # the host goes on only once the event's work ran
        else:
            self._enqueue(stream, op)

    def _capture_wait(self, stream: Stream, event: _FakeEvent, why: str) -> None:
        capturing = self._capturing
        if stream in capturing and not event.captured:
            raise CaptureError(
                f"cudaErrorStreamCaptureIsolation: the {stream.value} stream, inside the capture, "
                f"waits ({why!r}) on an event the {event.stream.value} stream recorded outside it"
            )
        if event.captured:
            capturing.add(stream)  # the fork: from now on this stream's work is in the graph

    def launch(self, stream, fn, name, reads=(), writes=()) -> None:
        if self._capturing is not None and stream not in self._capturing:
            raise CaptureError(
                f"{name!r} launched on the {stream.value} stream during a capture it has not "
                "joined: the graph would not hold it"
            )
        op = self._add(_Op(len(self.program), stream, "launch", name, tuple(reads),
                           tuple(writes), fn=fn))  # fmt: skip
        if stream is COMPUTE:
            fn()
        else:
            self._enqueue(stream, op)
            if not self.lazy:
                self._run_to(_FakeEvent(stream, self._length[stream]))

    def note(self, name, reads=(), writes=(), releases=()) -> None:
        self._add(_Op(len(self.program), COMPUTE, "note", name, tuple(reads), tuple(writes),
                      tuple(releases)))  # fmt: skip

    def keep_until(
        self, tensor: torch.Tensor, resource: Hashable, stream: Stream, why: str
    ) -> None:
        if self._skip(why):
            return
        event = _FakeEvent(stream, self._length[stream])
        self._add(_Op(len(self.program), stream, "keep", reads=(resource,), event=event, why=why))

    def _enqueue(self, stream: Stream, op: _Op) -> None:
        self._queued[stream].append(op)
        self._length[stream] += op.kind == "launch"

    def _run_to(self, event: _FakeEvent) -> None:
        """Run ``event.stream``'s queued work up to its ``event.position``-th launch, running
        first whatever that work waits for."""
        if event.stream is COMPUTE:
            return  # the host has run it already
        queue = self._queued[event.stream]
        while self._done[event.stream] < event.position:
            op = queue.pop(0)
            if op.kind == "wait":
                self._run_to(op.event)
            else:
                self._done[event.stream] += 1
                op.fn()

    def drain(self) -> None:
        """Run all queued side-stream work (the end of the program)."""
        for stream in (PACK, UNPACK):
            self._run_to(_FakeEvent(stream, self._length[stream]))
        for stream in (PACK, UNPACK):  # a wait left at the tail of a queue
            self._queued[stream].clear()

    def hazards(self) -> list[Hazard]:
        return check_program(self.program)


def check_program(program: list[_Op]) -> list[Hazard]:
    """Every hazard of ``program`` (a :class:`RecordingStreams` recording).

    Happens-before is computed with vector clocks: an op on a stream follows everything earlier
    on that stream and everything before each event that stream waited on. Per resource, in
    host order: a read must follow the last write before it (read after write); a write or a
    release must follow the last write and every read since (write after read/write) — except
    that a release may instead follow an op through a ``keep`` of that resource on the op's
    stream recorded after the op (the memory is not reused before that stream's work then). A
    release means "the owner may free it from now on": it leaves the contents for later reads.
    """
    stamps = _vector_clocks(program)
    kept: dict[Hashable, list[tuple[Stream, int]]] = {}
    hazards: list[Hazard] = []
    last_write: dict[Hashable, int] = {}
    reads_since: dict[Hashable, list[int]] = {}

    def before(a: int, b: int) -> bool:
        stream, seq, _ = stamps[a]
        return stamps[b][2][stream] >= seq

    def label(i: int) -> str:
        op = program[i]
        return f"op #{i} {op.name or op.kind} on {op.stream.value}"

    def kept_past(resource: Hashable, a: int) -> bool:
        stream, seq, _ = stamps[a]
        return any(s is stream and upto >= seq for s, upto in kept.get(resource, ()))

    for i, op in enumerate(program):
        if op.kind == "keep":
            kept.setdefault(op.reads[0], []).append((op.stream, op.event.position))
        if op.kind not in ("launch", "note"):
            continue
        for r in op.reads:
            w = last_write.get(r)
            if w is not None and not before(w, i):
                hazards.append(Hazard(_rule(r, "read"), r, label(w), label(i)))
            reads_since.setdefault(r, []).append(i)
        for r, what in [*((r, "write") for r in op.writes), *((r, "release") for r in op.releases)]:
            earlier = [*reads_since.get(r, ()), *([last_write[r]] if r in last_write else [])]
            for a in earlier:
                if a == i or before(a, i):
                    continue
                if what == "release" and kept_past(r, a):
                    continue
                hazards.append(Hazard(_rule(r, what), r, label(a), label(i)))
            if what == "write":  # a release ("may be freed from now on") leaves the contents
                last_write[r] = i
                reads_since[r] = []
    return hazards


def _vector_clocks(program: list[_Op]) -> list[tuple[Stream, int, dict[Stream, int]]]:
    """Per op of ``program``: its stream, its sequence number there (launches and notes so
    far) and its vector clock (how far into each stream it is ordered after)."""
    clock: dict[Stream, dict[Stream, int]] = {s: {t: 0 for t in Stream} for s in Stream}
    stamps: list[tuple[Stream, int, dict[Stream, int]]] = []
    for op in program:
        own = clock[op.stream]
        if op.kind in ("launch", "note"):
            own[op.stream] += 1
        elif op.kind == "wait":  # what the event's stream had seen when it was recorded
            upto = stamps[op.event.index][2]
            for s in Stream:
                own[s] = max(own[s], upto[s])
        stamps.append((op.stream, own[op.stream], dict(own)))
    return stamps


_RULES = {
    ("pages", "read"): "a pool page read before the write that filled it",
    ("pool", "write"): "pages reused before the pop that freed them completed",
    ("pool", "read"): "the pool's bookkeeping read out of order",
    ("source", "read"): "a source copied before it was produced",
    ("source", "release"): "an original buffer released before its copy completed",
    ("reload", "read"): "a reload used before it completed",
    ("reload", "write"): "a reload written while its memory was still in use",
    ("reload", "release"): "a reload buffer released before its write completed",
    ("record", "read"): "a record read before it was written",
    ("record", "release"): "a record released before its last use completed",
    ("flags", "read"): "flags read before the side streams finished",
}


def _rule(resource: Hashable, what: str) -> str:
    kind = resource[0] if isinstance(resource, tuple) and resource else resource
    return _RULES.get((kind, what), f"{what} of {kind} out of order")
