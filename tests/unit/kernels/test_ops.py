"""The stash ops' eager shortcut: a plain call when nothing watches, the opaque op otherwise."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from te_paged.kernels import KernelBackend, State, get_backend, stash_copy, stash_pop
from te_paged.kernels.layout import FLAGS_LEN, META_LEN
from te_paged.kernels.ops import _direct
from te_paged.stash import PagedStashBuffer, StashKey
from tests.triton_device import triton_device


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _round_trip(mode=None, backend=KernelBackend.TORCH) -> tuple[torch.Tensor, PagedStashBuffer]:
    """Stash 5 of 6 rows into pages of 2 and pop them back, the two calls inside ``mode``."""
    device = triton_device() if backend == KernelBackend.TRITON else torch.device("cpu")
    buf = PagedStashBuffer(StashKey(torch.float32, 8), 4, 2, device)
    src = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).view(torch.int32)
    src = src.to(device)
    dst, n = torch.full_like(src, 7), torch.tensor([5], device=device)
    flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=device)
    rec = torch.empty(3, dtype=torch.int32, device=device)
    meta = torch.empty(META_LEN, dtype=torch.int64, device=device)
    with mode or contextlib.nullcontext():
        stash_copy(backend, src, n, 1, 2, *buf.kernel_args(), flags, rec, meta)
        stash_pop(backend, dst, 2, *buf.kernel_args(), flags, rec, meta, True)
    assert int(buf.state[State.TAIL]) - int(buf.state[State.HEAD]) == 4
    assert torch.equal(dst[:5], src[:5]) and not dst[5:].any()
    return dst, buf


def test_plain_eager_calls_the_kernel_directly() -> None:
    x = torch.zeros(2)
    torch_kernels, triton_kernels = get_backend(KernelBackend.TORCH), get_backend("triton")
    assert _direct(torch_kernels, x) and _direct(triton_kernels, x)
    assert not _direct(torch_kernels, torch.nn.Parameter(x))  # a subclass: the op


@pytest.mark.parametrize("backend", [KernelBackend.TORCH, KernelBackend.TRITON])
def test_a_dispatch_mode_sees_one_opaque_op_and_the_same_result(backend) -> None:
    direct_dst, direct_buf = _round_trip(backend=backend)
    recorder = _Recorder()
    dst, buf = _round_trip(recorder, backend)
    assert recorder.ops == ["te_paged::stash_copy", "te_paged::stash_pop"]
    assert torch.equal(dst, direct_dst)
    assert all(torch.equal(a, b) for a, b in zip(buf.kernel_args(), direct_buf.kernel_args()))


def test_a_function_mode_gets_the_op() -> None:
    with _PassThrough():
        assert not _direct(get_backend(KernelBackend.TORCH), torch.zeros(2))
    _round_trip(_PassThrough())


def test_auto_on_cuda_without_triton_refuses_the_syncing_fallback(monkeypatch) -> None:
    # Before: `auto` silently picked the reference kernels, which read counts on the host, so
    # sync-freedom and graph capture broke with no word.
    from te_paged.kernels import resolve_backend, triton_backend

    monkeypatch.setattr(triton_backend, "triton_available", lambda: (False, "it is not installed"))
    with pytest.raises(ValueError, match="set moe_paged_stash_kernel_backend='torch' to accept"):
        resolve_backend("auto", torch.device("cuda"))
    assert resolve_backend("auto", torch.device("cpu")).name == "torch"
    assert resolve_backend("torch", torch.device("cuda")).name == "torch"
    monkeypatch.setattr(triton_backend, "triton_available", lambda: (True, ""))
    assert resolve_backend("auto", torch.device("cuda")).name == "triton"
