"""A stash+pop round trip is two device launches: one Triton launch per stash, one per pop, and
no torch op that would launch a kernel on a GPU (a ``copy_`` to install a counter, a ``zero_``
of a record). Counted on CPU: the launches by :func:`recorded_launches`, the torch ops by name
(:func:`torch_ops`). Before the fused kernels a round trip was 4 Triton launches (alloc, move;
move, free); megatron-core 0.19.2's is 2 Triton launches and 4 torch ops."""

from __future__ import annotations

import collections

import pytest
import torch

pytest.importorskip("triton", reason="the Triton stash kernels need `pip install triton`")

from te_paged import PagedStashManager, mark_grouped_tensor
from te_paged.kernels import FLAGS_LEN, META_LEN, Meta, State, stash_copy, stash_pop
from te_paged.stash import PagedStashBuffer, StashKey
from te_paged.tools.launches import recorded_launches, torch_ops
from tests.triton_device import triton_device

BUDGET = 2  # device launches per stash+pop round trip


def _round_trip_args(device, rows=12, hidden=16, page_size=4):
    buf = PagedStashBuffer(StashKey(torch.bfloat16, hidden), 8, page_size, device)
    src = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0))
    src = src.bfloat16().view(torch.int16).to(device)
    flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=device)
    pages = torch.empty(-(-rows // page_size), dtype=torch.int32, device=device)
    meta = torch.empty(META_LEN, dtype=torch.int64, device=device)
    return buf, src, (*buf.kernel_args(), flags, pages, meta)


def test_a_stash_pop_round_trip_is_one_launch_each() -> None:
    device = triton_device()
    buf, src, args = _round_trip_args(device)
    dst = torch.full_like(src, 7)
    n = torch.tensor([9], device=device)

    def round_trip() -> None:
        stash_copy("triton", src, n, 1, 4, *args)
        stash_pop("triton", dst, 4, *args, True)

    with recorded_launches(execute=True) as run:
        round_trip()
    assert [launch.name for launch in run.launches] == ["_stash_kernel", "_pop_kernel"]
    # The launches did the whole round trip: the rows, the zeroed padding, every page back.
    assert torch.equal(dst[:9], src[:9]) and not dst[9:].any()
    assert int(buf.state[State.TAIL]) - int(buf.state[State.HEAD]) == 8
    assert args[-1][Meta.POPPED] == 1
    with recorded_launches() as run:  # the torch ops, Triton's interpreter kept out
        ops = torch_ops(round_trip)
    assert run.count + len(ops) <= BUDGET, (run.launches, ops)


class _Marked(torch.autograd.Function):
    """``y = 2x`` that saves its marked input, as the grouped GEMMs do."""

    @staticmethod
    def forward(ctx, x):
        mark_grouped_tensor(x)
        ctx.save_for_backward(x)
        return 2 * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x != 0)


def _step(manager: PagedStashManager | None, device, layers=3) -> torch.Tensor:
    x = torch.randn(16, 8, device=device, generator=None).requires_grad_()
    n = torch.tensor(11, device=device)
    h = x
    for _ in range(layers):
        if manager is None:
            h = _Marked.apply(h)
        else:
            with manager.scope(16, n, 8):
                h = _Marked.apply(h)
    h.sum().backward()
    return x.grad


def test_the_manager_adds_two_launches_per_paged_tensor_and_no_torch_op() -> None:
    device = triton_device()
    manager = PagedStashManager(page_size=4, kernel_backend="triton", device=device,
                                skip_immediate_backward=False)  # fmt: skip
    manager.reset()
    _step(manager, device)  # the capture step: sizes the pools
    manager.reset()
    with recorded_launches() as off_run:
        off = collections.Counter(torch_ops(lambda: _step(None, device)))
    with recorded_launches() as on_run:
        on = collections.Counter(torch_ops(lambda: _step(manager, device)))
    assert off_run.count == 0
    names = collections.Counter(launch.name for launch in on_run.launches)
    assert names == {"_stash_kernel": 3, "_pop_kernel": 3}  # 3 layers, one tensor each
    assert on - off == collections.Counter(), on - off  # paging added no device op
