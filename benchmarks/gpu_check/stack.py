"""The small expert stacks of checks 2-5: chained ``TEGroupedMLP``s or ``MoELayer``s (one rank)
sharing one manager, their inputs and one training step; and the CUDA-graph replay of checks 4
and 5.

Shape suffixes as in te_paged: rows of a ``TEGroupedMLP`` are permuted expert rows (``ROWS``
static, the routing's counts real), tokens of a ``MoELayer`` are routed inside it.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from .common import RUN, all_same

NO_OVERLAP = "stream_overlap not available (PagedStashManager takes no stream_overlap keyword)"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The stacks' sizes: ``rows`` static rows of ``TEGroupedMLP`` (tokens per expert from
    ``routing``, one list per step, 8 experts), ``tokens`` of ``MoELayer`` (x top-2 x cf 2)."""

    hidden: int
    ffn: int
    rows: int
    tokens: int
    routing: tuple[tuple[int, ...], ...]


_ROUTING = ((300, 0, 120, 90, 200, 40, 160, 110), (10, 250, 130, 70, 180, 100, 90, 170))
_FULL = Sizes(hidden=256, ffn=512, rows=2048, tokens=512, routing=_ROUTING)
#: A smoke run's: an eighth of the rows and tokens, a quarter of the widths.
_SMOKE = Sizes(hidden=64, ffn=128, rows=256, tokens=64,
               routing=tuple(tuple(n // 8 for n in step) for step in _ROUTING))  # fmt: skip


def sizes() -> Sizes:
    return _SMOKE if RUN.smoke else _FULL


def cfg(**kw):
    from te_paged.config import MoEConfig

    s = sizes()
    base = {
        "hidden_size": s.hidden,
        "moe_ffn_hidden_size": s.ffn,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_expert_rank_capacity_factor": 2.0,
        "params_dtype": torch.bfloat16,
        "moe_paged_stash_kernel_backend": RUN.backend,
    }
    if kw.get("recompute_modules"):
        base["recompute_granularity"] = "selective"
    return MoEConfig(**{**base, **kw})


def has_overlap() -> bool:
    from te_paged.stash import PagedStashManager

    return "stream_overlap" in inspect.signature(PagedStashManager).parameters


def overlaps() -> list[bool | None]:
    """The stream-overlap settings to test: both when the manager has the switch (off only on
    CPU, which has no streams), else its default only (None)."""
    if not has_overlap():
        return [None]
    return [False, True] if RUN.cuda else [False]


def no_overlap() -> str:
    """Why the overlap-on variant is not measured."""
    if not has_overlap():
        return NO_OVERLAP
    return f"stream overlap needs CUDA (dry run on {RUN.device})"


def overlap_label(overlap: bool | None) -> str:
    return {None: "manager default", False: "overlap off", True: "overlap on"}[overlap]


def manager(config, overlap: bool | None = None):
    """``config``'s manager on the run's device; ``overlap`` True/False is its
    ``stream_overlap`` (None: the manager's default)."""
    from te_paged.stash import PagedStashManager

    return PagedStashManager.from_config(config, RUN.device, stream_overlap=overlap)


class Stack:
    """``layers`` chained ``TEGroupedMLP``s (``kind="experts"``, fed permuted rows) or
    ``MoELayer``s (``kind="layer"``, one rank), sharing one manager (None: paged stash OFF).
    The same ``seed`` gives the same weights ON and OFF."""

    def __init__(self, kind: str, config, layers: int = 2, seed: int = 0, overlap=None) -> None:
        from te_paged.moe import MoELayer, TEGroupedMLP

        self.kind = kind
        self.manager = manager(config, overlap) if config.moe_paged_stash else None
        torch.manual_seed(seed)
        dev = RUN.device
        if kind == "experts":
            self.layers = [TEGroupedMLP(8, config, manager=self.manager, device=dev)
                           for _ in range(layers)]  # fmt: skip
        else:
            self.layers = [MoELayer(config, None, self.manager, device=dev, seed=seed * 100 + i)
                           for i in range(layers)]  # fmt: skip

    def parameters(self) -> list[torch.Tensor]:
        return [q for layer in self.layers for q in layer.parameters()]

    def forward(self, inputs) -> torch.Tensor:
        h = inputs[0]
        for layer in self.layers:
            h, _ = layer(h, *inputs[1:])
        return h


def inputs(kind: str, step: int) -> tuple[torch.Tensor, ...]:
    s, dev = sizes(), RUN.device
    g = torch.Generator(device="cpu").manual_seed(step)
    if kind == "experts":
        x = torch.randn(s.rows, s.hidden, generator=g).to(dev, torch.bfloat16).requires_grad_()
        p = torch.rand(s.rows, generator=g).to(dev).requires_grad_()
        return x, torch.tensor(s.routing[step % 2], device=dev), p
    return (torch.randn(s.tokens, s.hidden, generator=g).to(dev, torch.bfloat16).requires_grad_(),)


def grads(stack: Stack) -> list[torch.Tensor]:
    return [q.grad for q in stack.parameters() if q.grad is not None]


def step(stack: Stack, index: int, batch=None) -> list[torch.Tensor]:
    """One step (``manager.reset()``, forward, backward): the output and every gradient."""
    if stack.manager is not None:
        stack.manager.reset()
    batch = batch or inputs(stack.kind, index)
    h = stack.forward(batch)
    h.float().square().sum().backward()
    leaves = [t for t in batch if t.requires_grad]
    out = [h.detach()] + [t.grad for t in leaves] + [g.clone() for g in grads(stack)]
    for t in leaves:
        t.grad = None
    for layer in stack.layers:
        layer.zero_grad(set_to_none=True)
    return out


def clean_stash(stack: Stack, what: str) -> None:
    s = stack.manager.stats()
    if s.overflow or s.invalid or not s.stashes == s.pops > 0:
        raise AssertionError(f"{what}: stash not used cleanly: {s}")


def replay(kind: str, fp8: str | None, overlap) -> str:
    """Capture one captured ON step (forward + backward) in a CUDA graph; replay it with new
    data (and, for MoELayer, new routing) and compare with eager OFF, bitwise (checks 4, 5)."""
    on = Stack(kind, cfg(moe_paged_stash=True, fp8=fp8), overlap=overlap)
    off = Stack(kind, cfg(fp8=fp8))
    static = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs(kind, 0)]

    def load(index: int) -> None:
        with torch.no_grad():
            for s, t in zip(static, inputs(kind, index)):
                s.copy_(t)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the capture step, then one captured step, eagerly
        for index in range(2):
            load(index)
            step(on, index, static)
    torch.cuda.current_stream().wait_stream(side)
    on.manager.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = on.forward(static)
        h.float().square().sum().backward()
    replays = (1, 0, 1, 2)
    for index in replays:
        load(index)
        on.manager.reset()
        graph.replay()
        torch.cuda.synchronize()
        got = [h.detach()] + [t.grad for t in static if t.requires_grad] + grads(on)
        if not all_same(got, step(off, index)):
            raise AssertionError(f"replay with step {index}'s data differs from eager OFF")
        s = on.manager.stats()
        if s.overflow or s.invalid:
            raise AssertionError(f"replay with step {index}'s data: {s}")
    return f"{len(replays)} replays bitwise equal to eager OFF"
