"""``CudaStreams`` itself, on CPU: torch.cuda's Stream, Event and stream context replaced by
fakes that log what they are asked to do. The recording fake (``RecordingStreams``) checks
the manager's rules; this checks that the CUDA implementation turns each of them into the
CUDA calls that keep it: a wait into ``wait_event`` on the waiting stream, an event recorded on
the stream it names, a launch inside its stream, a kept buffer into ``record_stream``."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from te_paged.stash.streams import COMPUTE, PACK, UNPACK, CudaStreams


class FakeStream:
    ids = itertools.count()

    def __init__(self, device=None, name: str | None = None) -> None:
        self.name = name or f"side{next(FakeStream.ids)}"

    def wait_event(self, event) -> None:
        LOG.append(("wait", self.name, event.id))


class FakeEvent:
    ids = itertools.count()

    def __init__(self) -> None:
        self.id = next(FakeEvent.ids)

    def record(self, stream) -> None:
        LOG.append(("record", stream.name, self.id))


class FakeTensor:
    def record_stream(self, stream) -> None:
        LOG.append(("keep", stream.name))


LOG: list[tuple] = []
CURRENT = FakeStream(name="compute")


@contextlib.contextmanager
def fake_stream_context(stream):
    LOG.append(("enter", stream.name))
    yield
    LOG.append(("exit", stream.name))


@pytest.fixture
def cuda(monkeypatch):
    LOG.clear()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: CURRENT)
    monkeypatch.setattr(torch.cuda, "stream", fake_stream_context)
    return CudaStreams(torch.device("cuda", 0))


def test_each_rule_becomes_the_cuda_call_that_keeps_it(cuda) -> None:
    # A stash after its producer, then a reload used by the compute stream: the manager's
    # sequence for one tensor (docs: streams.py's rules).
    produced = cuda.record(COMPUTE)
    cuda.wait(PACK, produced, "stash after produce")
    cuda.launch(PACK, lambda: LOG.append(("kernel", "copy")), "copy")
    stashed = cuda.record(PACK)
    cuda.keep_until(FakeTensor(), "source", PACK, "keep source")
    cuda.wait(UNPACK, stashed, "pop after stash")
    cuda.launch(UNPACK, lambda: LOG.append(("kernel", "pop")), "pop")
    reloaded = cuda.record(UNPACK)
    cuda.wait(COMPUTE, reloaded, "use after reload")
    cuda.wait(COMPUTE, None, "join")  # nothing recorded yet on a stream: nothing to wait for
    pack, unpack = cuda._side[PACK].name, cuda._side[UNPACK].name
    assert pack != unpack and "compute" not in (pack, unpack)
    e = [produced.event.id, stashed.event.id, reloaded.event.id]
    assert LOG == [
        ("record", "compute", e[0]),
        ("wait", pack, e[0]),  # the copy reads the source after the compute stream wrote it
        ("enter", pack), ("kernel", "copy"), ("exit", pack),
        ("record", pack, e[1]),
        ("keep", pack),  # the source's memory is not reused before the copy ran
        ("wait", unpack, e[1]),  # the pop reads the pages after the copy filled them
        ("enter", unpack), ("kernel", "pop"), ("exit", unpack),
        ("record", unpack, e[2]),
        ("wait", "compute", e[2]),  # the compute stream uses the reload after it was made
    ]  # fmt: skip


def test_side_streams_are_made_once_and_the_compute_stream_is_the_current_one(cuda) -> None:
    first = cuda._stream(PACK)
    assert cuda._stream(PACK) is first and cuda._stream(UNPACK) is not first
    assert cuda._stream(COMPUTE) is CURRENT
