from __future__ import annotations

import pytest
import torch

from te_paged.kernels import Meta, Tier, torch_stash_copy, torch_stash_pop
from te_paged.kernels.layout import FLAGS_LEN, META_LEN
from te_paged.stash import PagedStashBuffer, StashKey, storage_dtype


def random_bits(rows: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A ``dtype`` tensor with arbitrary bit patterns (NaN payloads, -0, FP8 specials)."""
    g = torch.Generator().manual_seed(seed)
    bits = storage_dtype(dtype)
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, (rows, hidden), generator=g, dtype=torch.int64)
    return raw.to(bits).view(dtype)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous copy of ``t``: the kernels then keep their bookkeeping in a host list
    and write it back (their path for tensors not on the CPU) instead of writing in place."""
    out = torch.zeros(2 * t.numel(), dtype=t.dtype)[::2]
    return out.copy_(t)


class KernelHarness:
    """Drive the reference kernels on one buffer, the way the manager does."""

    def __init__(self, buffer: PagedStashBuffer, strided: bool = False) -> None:
        self.buffer = buffer
        self.wrap = _strided if strided else (lambda t: t)
        if strided:
            buffer.free_P, buffer.host_free_P, buffer.state = (
                _strided(buffer.free_P), _strided(buffer.host_free_P), _strided(buffer.state)
            )  # fmt: skip
        self.flags = self.wrap(torch.zeros(FLAGS_LEN, dtype=torch.int64))

    def stash(self, x: torch.Tensor, num_tokens: int, tokens_per_row: int = 1):
        rows_RH = x.view(storage_dtype(x.dtype))
        pages = torch.full((-(-x.shape[0] // self.buffer.page_size),), -1, dtype=torch.int32)
        pages, meta = self.wrap(pages), self.wrap(torch.zeros(META_LEN, dtype=torch.int64))
        torch_stash_copy(
            rows_RH,
            torch.tensor([num_tokens]),
            tokens_per_row,
            self.buffer.page_size,
            *self.buffer.kernel_args(),
            self.flags,
            pages,
            meta,
        )
        return pages, meta

    def pop(self, record, like: torch.Tensor, zero_padding: bool = True) -> torch.Tensor:
        pages, meta = record
        out = torch.full_like(like.view(storage_dtype(like.dtype)), 7)
        torch_stash_pop(
            out,
            self.buffer.page_size,
            *self.buffer.kernel_args(),
            self.flags,
            pages,
            meta,
            zero_padding,
        )
        return out.view(like.dtype)

    @staticmethod
    def tier(record) -> Tier:
        return Tier(int(record[1][Meta.TIER]))


@pytest.fixture
def make_harness():
    def make(dtype=torch.float32, hidden=4, pages=4, page_size=2, host_pages=0) -> KernelHarness:
        buf = PagedStashBuffer(StashKey(dtype, hidden), pages, page_size, "cpu", host_pages)
        return KernelHarness(buf)

    return make
