"""One page pool per (dtype, hidden size).

Shape suffixes: ``P`` pages, ``S`` page size (rows per page), ``H`` hidden (elements per row),
``N = P·S`` pool rows.
"""

from __future__ import annotations

import dataclasses

import torch

from te_paged.config.checks import require_device, require_int
from te_paged.kernels.layout import STATE_LEN, State

__all__ = ["MAX_KEYS", "PagedStashBuffer", "StashKey", "key_code", "key_from_code", "storage_dtype"]

_BITS_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype a pool of ``dtype`` stores: same width, raw bits (FP8 → bytes).

    Storing bits rather than values makes "stash only moves bytes" literal: NaN payloads,
    negative zeros and FP8 encodings round-trip exactly.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype, got {dtype!r}")
    if dtype.is_complex or dtype == torch.bool:
        raise TypeError(f"paged stash cannot store tensors of dtype {dtype}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return _BITS_BY_ITEMSIZE[itemsize]


@dataclasses.dataclass(frozen=True)
class StashKey:
    """Pools are shared by every saved tensor with the same dtype and row width."""

    dtype: torch.dtype
    hidden: int

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}x{self.hidden}"

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of this key's pool."""
        return self.hidden * self.dtype.itemsize


#: Pool keys (dtype, row width) a rank may hold: the fixed room of the collectives that carry
#: per-key figures (the runner's per-step reduction, the pool-size agreement at allocation).
MAX_KEYS = 16

# Pool keys as int64 codes for collectives: (index of the dtype among torch's dtypes + 1)
# << 32 | row width. Every rank runs the same torch, so the index agrees; 0 is "no key".
# E.g. float32 x 4096 -> (index(float32) + 1) * 2**32 + 4096.
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


def key_code(key: StashKey) -> int:
    """``key`` as a positive int64 (see ``_DTYPES``)."""
    if not 0 < key.hidden < 2**32:
        raise ValueError(f"pool key {key}: its row width does not fit the collectives' code")
    return (_DTYPES.index(key.dtype) + 1) << 32 | key.hidden


def key_from_code(code: int) -> StashKey:
    return StashKey(_DTYPES[(code >> 32) - 1], code & (2**32 - 1))


class PagedStashBuffer:
    """A device pool ``[P·S, H]``, an optional host tier, their free lists and counters.

    The free lists are circular queues of page ids on the pool's device; ``state`` holds their
    monotone head/tail counters and statistics (layout in :mod:`te_paged.kernels.layout`).
    Construction is the only allocation: :meth:`reset` restores the initial state in place.
    """

    def __init__(
        self,
        key: StashKey,
        num_pages: int,
        page_size: int,
        device: torch.device | str,
        host_num_pages: int = 0,
    ) -> None:
        if not isinstance(key, StashKey):
            raise TypeError(f"key must be a StashKey(dtype, hidden), got {key!r}")
        require_int("key.hidden", key.hidden, minimum=1)
        storage_dtype(key.dtype)  # refuses dtypes the pool cannot store
        require_int("num_pages", num_pages, minimum=1)
        require_int("page_size", page_size, minimum=1)
        require_int("host_num_pages", host_num_pages, minimum=0)
        device = require_device("device", device)
        self.key = key
        self.page_size = page_size
        self.num_pages = num_pages
        self.host_num_pages = host_num_pages
        self.device = device
        bits = storage_dtype(key.dtype)
        # Zero-filled rather than empty: pool contents are then a deterministic function of the
        # stash history, which is what the reference-vs-Triton tests compare.
        self.pool_NH = torch.zeros(num_pages * page_size, key.hidden, dtype=bits, device=device)
        self.free_P = torch.arange(num_pages, dtype=torch.int32, device=device)
        # A pinned host tier is only possible with CUDA; on CPU the "host tier" is plain memory.
        pin = device.type == "cuda"
        self.host_pool_NH = torch.zeros(
            host_num_pages * page_size, key.hidden, dtype=bits, pin_memory=pin
        )
        if device.type == "cpu":
            self.host_pool_NH = self.host_pool_NH.to(device)
        self.host_free_P = torch.arange(host_num_pages, dtype=torch.int32, device=device)
        self.state = torch.zeros(STATE_LEN, dtype=torch.int64, device=device)
        self.state[State.TAIL] = num_pages
        self.state[State.HOST_TAIL] = host_num_pages
        self._initial_state = self.state.clone()
        self._initial_free = self.free_P.clone()
        self._initial_host_free = self.host_free_P.clone()

    def reset(self) -> None:
        """Return every page to the free lists and clear the counters; allocates nothing."""
        self.free_P.copy_(self._initial_free)
        self.host_free_P.copy_(self._initial_host_free)
        self.state.copy_(self._initial_state)

    @property
    def pool_bytes(self) -> int:
        """Device bytes held by the pool (the page data only)."""
        return self.pool_NH.numel() * self.pool_NH.element_size()

    @property
    def host_pool_bytes(self) -> int:
        return self.host_pool_NH.numel() * self.host_pool_NH.element_size()

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """``(dev_pool, dev_free, host_pool, host_free, state)`` in the kernels' order."""
        return (self.pool_NH, self.free_P, self.host_pool_NH, self.host_free_P, self.state)

    def __repr__(self) -> str:
        return (
            f"PagedStashBuffer({self.key}, pages={self.num_pages}, host_pages="
            f"{self.host_num_pages}, page_size={self.page_size}, device={self.device})"
        )
