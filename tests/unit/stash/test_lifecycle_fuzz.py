"""Random interleavings of forward (in a scope), backward, dropped graphs, reset and release.

Whatever the order, every backward either returns gradients bitwise equal to the same
computation without stashing, raises (a tensor stashed before a reset()/release() refuses to
reload), or runs in a step the manager flagged (overflow: the runner reruns it). Never wrong
data without a flag, and the free lists never hold more pages than the pool.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from te_paged import PagedStashManager
from te_paged.kernels.layout import State

from .test_manager import MarkedLinear

ROWS, H = 24, 8
OPS = st.sampled_from(
    ["forward", "forward", "backward", "backward", "drop", "reset", "reset", "release"]
)
#: The interleaving the issue reported: a reset() between a forward and its backward.
RESET_BETWEEN = ["forward", "backward", "reset", "forward", "reset", "forward", "backward",
                 "backward"]  # fmt: skip


def _inputs(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, H, generator=g)
    x[n:] = 5.0  # stale padding: the reference masks it out as the stashed path does
    w = torch.randn(H, H, generator=g)
    return x, w


def _loss(x, w, n):
    mask = (torch.arange(ROWS) < n)[:, None]
    return torch.where(mask, torch.tanh(MarkedLinear.apply(x, w)), 0.0).sum()


def _reference(seed: int, n: int) -> list[torch.Tensor]:
    x, w = (t.requires_grad_() for t in _inputs(seed, n))
    _loss(x, w, n).backward()
    return [x.grad[:n], w.grad]


def _free_lists_consistent(manager: PagedStashManager) -> bool:
    for buf in manager.buffers.values():
        s = buf.state.tolist()
        if not 0 <= s[State.TAIL] - s[State.HEAD] <= buf.num_pages:
            return False
        if not 0 <= s[State.HOST_TAIL] - s[State.HOST_HEAD] <= buf.host_num_pages:
            return False
    return True


@settings(max_examples=200, deadline=None)
@example(ops=RESET_BETWEEN, counts=[10] * 14, factor=3.0)
@given(
    ops=st.lists(OPS, min_size=1, max_size=14),
    counts=st.lists(st.integers(1, ROWS), min_size=14, max_size=14),
    factor=st.sampled_from([0.5, 1.0, 3.0]),
)
def test_every_backward_is_correct_refused_or_flagged(ops, counts, factor) -> None:
    manager = PagedStashManager(page_size=4, buffer_size_factor_cuda=factor)
    pending = []  # (loss, x, w, seed, n)
    for i, op in enumerate(ops):
        if op == "forward":
            n = counts[i]
            x, w = (t.requires_grad_() for t in _inputs(i, n))
            try:
                with manager.scope(ROWS, torch.tensor(n), 12):
                    loss = _loss(x, w, n)
            except RuntimeError as e:  # a forward after release(), before reset()
                assert "call reset() at the step boundary before the next forward" in str(e)
                continue
            pending.append((loss, x, w, i, n))
        elif op == "backward" and pending:
            loss, x, w, seed, n = pending.pop(0)
            try:
                loss.backward()
            except RuntimeError as e:
                assert "stashed before the last reset()/release()" in str(e)
                continue
            got = [x.grad[:n], w.grad]
            stats = manager.stats()
            correct = all(torch.equal(a, b) for a, b in zip(got, _reference(seed, n)))
            assert correct or stats.overflow or stats.invalid, (ops, i)
        elif op == "drop" and pending:
            pending.pop(0)
        elif op == "reset":
            manager.reset()
        elif op == "release":
            manager.release()
        assert _free_lists_consistent(manager), (ops, i)
