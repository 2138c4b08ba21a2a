"""Stash copies on a pack stream, reloads on an unpack stream: the ordering, proven on CPU.

The manager runs with :class:`RecordingStreams`, which records every launch, wait and keep and
runs side-stream work as late as the waits allow; :func:`check_program` then finds every access
not ordered after the one it depends on. Gradients must be bitwise those without stashing, the
checker must find nothing, and dropping the waits of any one rule must make it find something.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from te_paged import PagedStashManager
from te_paged.stash import streams as streams_mod
from te_paged.stash.streams import (
    COMPUTE,
    PACK,
    UNPACK,
    CaptureError,
    CudaStreams,
    RecordingStreams,
    Streams,
    check_program,
)

from .test_manager import MarkedLinear

ROWS, HIDDEN, LAYERS = 40, 16, 3


def _manager(fake: RecordingStreams | None, lookahead: int = 1) -> PagedStashManager:
    m = PagedStashManager(
        page_size=8,
        buffer_size_factor_cuda=1.5,
        reload_lookahead=lookahead,
        skip_immediate_backward=False,
    )
    if fake is not None:
        m._streams = fake
    return m


class _Model:
    """``LAYERS`` marked linears with tanh, each in a scope with its layer number."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ws = [torch.randn(HIDDEN, HIDDEN, generator=g, requires_grad=True)
                   for _ in range(LAYERS)]  # fmt: skip

    def forward(self, manager, x, n, layers=range(LAYERS)):
        mask = (torch.arange(ROWS) < n)[:, None]
        num_tokens = torch.tensor(n)
        h = x
        for i in layers:
            scope = manager.scope(ROWS, num_tokens, 24, layer=i + 1) if manager else _null()
            with scope:
                h = torch.where(mask, torch.tanh(MarkedLinear.apply(h, self.ws[i])), 0.0)
        return h


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _inputs(step: int, mb: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(100 * step + mb)
    return torch.randn(ROWS, HIDDEN, generator=g).requires_grad_(), 17 + 3 * mb + step


def _step(manager, step: int, schedule: str) -> list[torch.Tensor]:
    """One step of ``schedule`` over 3 microbatches; returns every gradient."""
    model = _Model(step)
    xs = [_inputs(step, mb) for mb in range(3)]
    outs = {}

    def fwd(mb: int) -> None:
        outs[mb] = model.forward(manager, xs[mb][0], xs[mb][1])

    def bwd(mb: int) -> None:
        outs.pop(mb).sum().backward()

    if schedule == "sequential":
        order = [("f", 0), ("b", 0), ("f", 1), ("b", 1), ("f", 2), ("b", 2)]
    elif schedule == "accumulate":  # te_paged's own loop: forward all, backward all (reversed)
        order = [("f", 0), ("f", 1), ("f", 2), ("b", 2), ("b", 1), ("b", 0)]
    elif schedule == "1f1b":
        order = [("f", 0), ("f", 1), ("b", 0), ("f", 2), ("b", 1), ("b", 2)]
    else:
        raise AssertionError(schedule)
    for kind, mb in order:
        (fwd if kind == "f" else bwd)(mb)
    return [w.grad for w in model.ws] + [x.grad for x, _ in xs]


def _run(manager, schedule: str, steps: int = 3) -> list[list[torch.Tensor]]:
    grads = []
    for step in range(steps):
        if manager is not None:
            manager.reset()
        grads.append(_step(manager, step, schedule))
    if manager is not None:
        manager.reset()
    return grads


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for ga, gb in zip(a, b, strict=True)
               for x, y in zip(ga, gb, strict=True))  # fmt: skip


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("schedule", ["sequential", "accumulate", "1f1b"])
def test_side_streams_are_bitwise_and_hazard_free(schedule, lookahead, lazy) -> None:
    fake = RecordingStreams(lazy=lazy)
    manager = _manager(fake, lookahead)
    on = _run(manager, schedule)
    assert _equal(on, _run(None, schedule))
    assert fake.hazards() == []
    launches = [op.name for op in fake.program if op.kind == "launch"]
    assert launches.count("stash") == launches.count("pop") == 2 * 3 * LAYERS  # 2 captured steps
    assert manager.stats().pops == 0  # reset after the last step


# Layers whose backward follows their forward at once, per step: each microbatch's last layer
# when run in turn, the last forwarded one's when all forwards come first, none under 1F1B
# (every forward is followed by another microbatch's backward or forward).
KEPT = {"sequential": 3, "accumulate": 1, "1f1b": 0}


@pytest.mark.parametrize("schedule", list(KEPT))
def test_side_streams_with_the_last_layer_kept(schedule) -> None:
    fake = RecordingStreams()
    manager = _manager(fake, 1)
    manager.skip_immediate_backward = True  # before the capture step
    on = _run(manager, schedule)
    assert _equal(on, _run(None, schedule))
    assert fake.hazards() == []
    launches = [op.name for op in fake.program if op.kind == "launch"]
    paged = 2 * (3 * LAYERS - KEPT[schedule])  # 2 captured steps
    assert launches.count("stash") == launches.count("pop") == paged


def _captured(schedule: str, lookahead: int) -> tuple[RecordingStreams, list[torch.Tensor]]:
    """The capture step and a paged step eagerly, then step 2 inside a CUDA graph capture
    (``RecordingStreams.capture``), as the GPU check (``benchmarks/gpu_check``, checks 4 and 5)
    captures one on a GPU."""
    fake = RecordingStreams()
    manager = _manager(fake, lookahead)
    for step in range(2):  # the paged step leaves side-stream events behind
        manager.reset()
        _step(manager, step, schedule)
    manager.reset()
    with fake.capture():
        grads = _step(manager, 2, schedule)
    return fake, grads


@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("schedule", ["sequential", "accumulate", "1f1b"])
def test_a_step_captured_in_a_cuda_graph_keeps_the_capture_rules(schedule, lookahead) -> None:
    # On an H200 the first stash inside the graph waited on the unpack stream's event from the
    # eager step before it (cudaErrorStreamCaptureIsolation): reset() joins the side streams
    # and forgets their events, and a full forward and backward ends joined.
    fake, grads = _captured(schedule, lookahead)
    assert _equal([grads], [_step(None, 2, schedule)])
    assert fake.hazards() == []


def test_a_capture_of_a_forward_alone_needs_join_side_streams() -> None:
    # Stash copies no backward waited for: the compute stream must join them before the
    # capture ends; join_side_streams() does, without a host sync.
    for join in (False, True):
        fake = RecordingStreams()
        manager = _manager(fake)
        manager.reset()
        _step(manager, 0, "sequential")
        manager.reset()
        x, n = _inputs(1, 0)
        with contextlib.ExitStack() as stack:
            if not join:
                stack.enter_context(pytest.raises(CaptureError, match=r"Unjoined.*pack"))
            with fake.capture():
                _Model(1).forward(manager, x, n)
                if join:
                    manager.join_side_streams()


def test_the_capture_model_refuses_what_cuda_refuses() -> None:
    fake = RecordingStreams()
    before = fake.record(UNPACK)
    with pytest.raises(CaptureError, match="Isolation"), fake.capture():
        fake.wait(COMPUTE, before, "join")
    with pytest.raises(CaptureError, match="not joined"), fake.capture():
        fake.launch(PACK, lambda: None, "stash")
    with fake.capture():  # an eager wait before the fork, the fork by a captured event, the join
        fake.wait(PACK, before, "eager")
        fake.wait(PACK, fake.record(COMPUTE), "stash after produce")
        fake.launch(PACK, lambda: None, "stash")
        fake.wait(COMPUTE, fake.record(PACK), "join")
    with pytest.raises(CaptureError, match="Isolation"), fake.capture():
        fake.wait(PACK, fake.record(COMPUTE), "stash after produce")
        fake.wait(PACK, before, "reuse after pop")


def _lookahead_program(lookahead: int) -> list[tuple[str, str]]:
    fake = RecordingStreams()
    manager = _manager(fake, lookahead)
    manager.reset()
    _step(manager, 0, "sequential")  # capture
    manager.reset()
    start = len(fake.program)
    model = _Model(1)
    x, n = _inputs(1, 0)
    model.forward(manager, x, n).sum().backward()
    return [(op.name, op.stream.value) for op in fake.program[start:]
            if op.name in ("pop", "use reload")]  # fmt: skip


def test_backward_prefetches_the_previous_layers() -> None:
    # layer 3's backward uses its reload; with look-ahead 1, layer 2's pop is already enqueued
    # before that first use, and layer 1's before layer 2's first use.
    ops = _lookahead_program(1)
    assert ops[:3] == [("pop", "unpack"), ("pop", "unpack"), ("use reload", "compute")]
    assert _lookahead_program(0)[:3] == [
        ("pop", "unpack"), ("use reload", "compute"), ("pop", "unpack"),
    ]  # fmt: skip
    assert _lookahead_program(2)[:4] == [("pop", "unpack")] * 3 + [("use reload", "compute")]


def test_the_lookahead_stays_within_a_forward_pass() -> None:
    # Microbatch 1's first layer is opened after microbatch 0's last: layer numbers fall, so
    # a new forward pass starts and microbatch 1's backward never prefetches microbatch 0.
    fake = RecordingStreams()
    manager = _manager(fake, lookahead=LAYERS)
    _run(manager, "accumulate", steps=1)
    manager.reset()
    model = _Model(1)
    (x0, n0), (x1, n1) = _inputs(1, 0), _inputs(1, 1)
    out0, out1 = model.forward(manager, x0, n0), model.forward(manager, x1, n1)
    start = len(fake.program)
    out1.sum().backward()
    pops = [op for op in fake.program[start:] if op.name == "pop"]
    assert len(pops) == LAYERS  # microbatch 1's layers only
    out0.sum().backward()
    assert fake.hazards() == []


def _scenario(manager) -> list[torch.Tensor]:
    """Every ordering the rules guard, in three captured steps:

    * a plain forward and backward (look-ahead 1);
    * a partial backward (to the second layer's input), then a forward, then the rest: the
      forward's stashes come while the first layer's prefetched pop may still be running;
    * a forward whose backward never runs, then ``stats()`` and ``reset()``.
    """
    grads = []
    for step in range(3):
        if manager is not None:
            manager.reset()
        model = _Model(step)
        x, n = _inputs(step, 0)
        model.forward(manager, x, n).sum().backward()
        x1, n1 = _inputs(step, 1)
        first = model.forward(manager, x1, n1, layers=[0])
        mid = first.detach().requires_grad_()
        out = model.forward(manager, mid, n1, layers=[1, 2])
        (g_mid,) = torch.autograd.grad(out.sum(), mid)  # prefetches the first layer's reload
        x2, n2 = _inputs(step, 2)
        extra = model.forward(manager, x2, n2, layers=[1])
        first.backward(g_mid)
        extra.sum().backward()
        model.forward(manager, x2, n2)  # never backward
        if manager is not None:
            manager.stats()
        grads.append([w.grad for w in model.ws] + [x.grad, x1.grad, x2.grad])
    if manager is not None:
        manager.reset()
    return grads


# What the checker reports when the waits (or keeps) of each rule are dropped.
_EXPECTED = {
    "stash after produce": "a source copied before it was produced",
    "reuse after pop": "pages reused",
    "pop after stash": "a pool page read before the write that filled it",
    "reload after alloc": "a reload written while its memory was still in use",
    "use after reload": "a reload used before it completed",
    "join": "flags read before the side streams finished",
    "keep source": "an original buffer released before its copy completed",
    "keep record": "a record released before its last use completed",
    "keep reload": "a reload buffer released before its write completed",
}


def test_the_scenario_is_bitwise_and_hazard_free() -> None:
    fake = RecordingStreams()
    assert _equal(_scenario(_manager(fake)), _scenario(None))
    assert fake.hazards() == []
    assert set(fake.whys) == set(_EXPECTED)  # every rule is exercised


@pytest.mark.parametrize("why", sorted(_EXPECTED))
def test_dropping_any_rule_is_caught(why) -> None:
    fake = RecordingStreams(drop={why})
    try:
        on = _scenario(_manager(fake))
    except ValueError:  # a pop ran before its stash and read a record nobody wrote
        assert why == "pop after stash"
        on = None
    assert fake.dropped.get(why)
    rules = {h.rule for h in fake.hazards()}
    assert any(_EXPECTED[why] in r for r in rules), (why, rules)
    if why == "use after reload":  # backward read buffers the lazy pop had not filled yet
        assert on is not None and not _equal(on, _scenario(None))


def test_checker_orders_through_events_and_keeps() -> None:
    fake = RecordingStreams(lazy=False)
    ran = []
    fake.note("produce", writes=["x"])
    fake.wait(PACK, fake.record(COMPUTE), "w")
    fake.launch(PACK, lambda: ran.append("copy"), "copy", reads=["x"], writes=["y"])
    fake.note("free x", releases=["x"])  # no keep: released while the copy may run
    fake.note("read y", reads=["y"])  # no wait: read before the copy completed
    rules = sorted(h.rule for h in check_program(fake.program))
    assert ran == ["copy"] and len(rules) == 2
    fake.keep_until(torch.empty(0), "x", PACK, "k")  # too late: recorded after the free
    assert len(check_program(fake.program)) == 2

    fake = RecordingStreams()
    fake.note("produce", writes=["x"])
    fake.wait(PACK, fake.record(COMPUTE), "w")
    fake.launch(PACK, lambda: ran.append("lazy"), "copy", reads=["x"], writes=["y"])
    fake.keep_until(torch.empty(0), "x", PACK, "k")
    fake.note("free x", releases=["x"])
    assert ran == ["copy"]  # lazy: not run yet
    event = fake.record(PACK)
    fake.wait(UNPACK, event, "w")
    fake.launch(UNPACK, lambda: ran.append("second"), "second", reads=["y"], writes=["z"])
    fake.wait(COMPUTE, fake.record(UNPACK), "w")  # runs the pack stream first, then unpack
    assert ran == ["copy", "lazy", "second"]
    fake.note("read z", reads=["z"])
    assert check_program(fake.program) == []


def test_stream_overlap_is_cuda_only_and_off_by_default_on_cpu() -> None:
    m = PagedStashManager()
    assert m.stream_overlap is False and type(m._streams) is Streams
    assert m.reload_layers == 1  # reloads only when backward uses them
    assert _manager(RecordingStreams(), lookahead=2).reload_layers == 3
    with pytest.raises(ValueError, match="stream_overlap=True needs a CUDA device"):
        PagedStashManager(stream_overlap=True)
    with pytest.raises(ValueError, match="reload_lookahead"):
        PagedStashManager(reload_lookahead=-1)
    with pytest.raises(TypeError, match="stream_overlap"):
        PagedStashManager(stream_overlap="yes")


def test_cuda_streams_map_to_cuda_calls(monkeypatch) -> None:
    # No GPU here: stand-ins for torch.cuda's streams and events record what CudaStreams asks.
    calls = []

    class Stream:
        def __init__(self, device=None) -> None:
            calls.append(("new stream", device))

        def wait_event(self, event) -> None:
            calls.append(("wait", self, event))

    class Event:
        def record(self, stream) -> None:
            calls.append(("record", self, stream))

    current = Stream()
    calls.clear()

    class Ctx:
        def __init__(self, s) -> None:
            self.s = s

        def __enter__(self) -> None:
            calls.append(("enter", self.s))

        def __exit__(self, *exc: object) -> None:
            calls.append(("exit", self.s))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    s = CudaStreams(torch.device("cuda", 0))
    assert calls == []  # side streams are created lazily
    produced = s.record(COMPUTE)
    s.wait(PACK, produced, "w")
    pack = calls[-1][1]
    assert calls[1] == ("new stream", torch.device("cuda", 0)) and calls[-1][2] is produced.event
    s.launch(PACK, lambda: calls.append("kernel"), "stash")
    assert calls[-3:] == [("enter", pack), "kernel", ("exit", pack)]
    kept = types.SimpleNamespace(record_stream=lambda stream: calls.append(("keep", stream)))
    s.keep_until(kept, "x", PACK, "keep")
    assert calls[-1] == ("keep", pack)
    s.wait(UNPACK, None, "w")  # nothing to wait for: no call
    assert calls[-1] == ("keep", pack)
    s.wait(COMPUTE, s.record(UNPACK), "join")
    unpack = calls[-2][2]
    assert unpack is not pack and calls[-1][1] is current
    assert streams_mod.CudaStreams.overlap


@pytest.mark.parametrize("fuser", [False, True])
def test_te_grouped_mlp_under_the_runner_with_side_streams(fuser, monkeypatch) -> None:
    # The real expert layers (both paths) in PagedStashRunner steps, side streams lazily run:
    # bitwise the reference, no hazard, and the runner joins the side streams before it reads
    # the flags.
    from ..runtime.test_runner import _reference, grads, make, step_fn

    cfg = {"use_transformer_engine_op_fuser": fuser}
    model, manager = make(cfg)
    fake = manager._streams = RecordingStreams()
    from te_paged.runtime import PagedStashRunner

    joins = []
    join = manager.join_side_streams
    monkeypatch.setattr(manager, "join_side_streams", lambda: (joins.append(1), join())[1])
    runner = PagedStashRunner(model, manager)
    for step in range(3):
        model.zero_grad()
        before = len(joins)
        _, rec = runner.step(step_fn(model, step))
        assert rec.attempt == 1 and len(joins) > before
        assert all(torch.equal(a, b) for a, b in zip(grads(model), _reference(step, cfg_kw=cfg)))
    assert fake.hazards() == []
    assert fake.whys["use after reload"] and fake.whys["pop after stash"]
