"""``GroupedTensor``: one static token-major buffer plus its device-side group boundaries.

Shape suffixes: ``R`` rows (the static ``max_num_tokens``; the real rows are a prefix),
``H`` hidden (elements per row), ``E`` groups (experts / GEMMs), ``C`` columns of any
token-major tensor, ``P = R + E·(align-1)`` rows of a regrouped one (:func:`align_groups`).

The row count ``R`` is fixed for a step (it is the buffer's worst-case budget), so every shape
below is static; only the *values* of ``split_sizes``/``offsets`` change with the routing, and
they stay on the device. Nothing here reads a device value on the host, so a ``GroupedTensor``
can be built and consumed inside a CUDA graph.

Worked example (``R = 8``, ``E = 3``, ``split_sizes = [2, 0, 3]``)::

    offsets    = [2, 2, 5]            # int32 cumulative ends: what torch._grouped_mm takes
    num_rows   = 5                    # offsets[-1], a 0-dim device tensor
    row_mask() = [T, T, T, T, T, F, F, F]
    group_ids()= [0, 0, 2, 2, 2, 3, 3, 3]   # padding rows get the dummy group E = 3
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # fp8 is only a field type here; importing it eagerly would couple the modules
    from te_paged.grouped.fp8 import Fp8Tensor

__all__ = ["GroupedTensor", "align_groups", "offsets_from_splits"]

#: ``torch._grouped_mm`` takes int32 offsets, so a buffer may hold at most this many rows.
_MAX_ROWS = torch.iinfo(torch.int32).max


def _check_splits(split_sizes: object, device: torch.device, name: str = "split_sizes") -> None:
    if not isinstance(split_sizes, torch.Tensor):
        raise TypeError(
            f"{name} must be an integer tensor on {device}, got {type(split_sizes).__name__}: "
            "keep the per-group counts on the device (a Python list would need the host to "
            f"know them), e.g. torch.tensor({name}, device={str(device)!r})"
        )
    if (
        split_sizes.dtype.is_floating_point
        or split_sizes.dtype.is_complex
        or (split_sizes.dtype == torch.bool)
    ):
        raise TypeError(f"{name} must be an integer tensor, got dtype {split_sizes.dtype}")
    if split_sizes.dim() != 1 or split_sizes.numel() < 1:
        raise ValueError(
            f"{name} must be 1-D with one entry per group (>= 1), got shape "
            f"{tuple(split_sizes.shape)}"
        )
    if split_sizes.device != device:
        raise ValueError(
            f"{name} is on {split_sizes.device} but the data is on {device}: move it with "
            f"{name}.to({str(device)!r}) before the step (on CUDA a host tensor would force a "
            "copy and a sync every call)"
        )


def offsets_from_splits(split_sizes_E: torch.Tensor, max_rows: int) -> torch.Tensor:
    """int32 cumulative group ends ``[E]``, computed on the device (no host read).

    Negative sizes count as 0 and ends are clamped to ``max_rows``, so invalid counts can never
    make a grouped GEMM read or write past the buffer, or see decreasing offsets. Such counts are
    an error that :func:`invalid_splits` detects, on the device, for the caller to count: the
    clamping only keeps the kernels in bounds until the step is refused.
    """
    return split_sizes_E.clamp(min=0).cumsum(0).clamp_(max=max_rows).to(torch.int32)


def splits_are_invalid(split_sizes_E: torch.Tensor, max_rows: int) -> torch.Tensor:
    """int64 0-dim, 1 if any size is negative or they sum past ``max_rows``, else 0 (on the
    device, no host read): what the legacy path raises ``ValueError`` for."""
    bad = (split_sizes_E < 0).any() | (split_sizes_E.sum() > max_rows)
    return bad.to(torch.int64)


def row_mask_from_offsets(offsets_E: torch.Tensor, max_rows: int) -> torch.Tensor:
    """bool ``[R]``: True for the real rows ``[0, offsets[-1])``. Static shape."""
    return torch.arange(max_rows, device=offsets_E.device) < offsets_E[-1]


def group_ids_from_offsets(offsets_E: torch.Tensor, max_rows: int) -> torch.Tensor:
    """int64 ``[R]``: the group of each row, ``E`` for padding rows. Static shape."""
    rows_R = torch.arange(max_rows, device=offsets_E.device, dtype=offsets_E.dtype)
    return torch.searchsorted(offsets_E, rows_R, right=True)


def align_groups(
    t_RC: torch.Tensor, offsets_E: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Regroup ``t_RC`` so every group starts at a multiple of ``align`` rows, zero-filled.

    CUDA's grouped GEMM needs every group's extent along the reduction dimension to be a
    multiple of 16 bytes (it asserts on the device, killing the context); a GEMM that reduces
    over tokens (a weight gradient) runs on this layout instead.

    Returns ``[P, C]`` with ``P = R + E·(align-1)`` (a static bound) and its int32 group ends.
    Sync-free: a gather with a device index, no host read. Example, ``align=4``, splits
    ``[2, 0, 3]``: rows ``a a | b b b`` become ``a a 0 0 | b b b 0``, then zero rows up to
    ``P``; ends ``[4, 4, 8]``.
    """
    rows, groups = t_RC.shape[0], offsets_E.shape[0]
    ends_E = offsets_E.long()
    splits_E = torch.diff(ends_E, prepend=ends_E.new_zeros(1))
    padded_E = (splits_E + align - 1) // align * align
    pad_ends_E = padded_E.cumsum(0)
    shift_E = (pad_ends_E - padded_E) - (ends_E - splits_E)  # padded start - start
    rows_P = torch.arange(rows + groups * (align - 1), device=t_RC.device)
    group_P = torch.searchsorted(pad_ends_E, rows_P, right=True).clamp_(max=groups - 1)
    src_P = rows_P - shift_E[group_P]
    real_P1 = (src_P < ends_E[group_P]).unsqueeze(1)
    # where(), not a multiply: a clamped source index may point at a NaN padding row.
    t_PC = torch.where(real_P1, t_RC.index_select(0, src_P.clamp_(0, rows - 1)), 0)
    return t_PC, pad_ends_E.to(torch.int32)


@dataclasses.dataclass
class GroupedTensor:
    """A token-major buffer ``data [R, H]`` split into ``E`` consecutive row groups.

    ==================  =============================  ============================================
    field               shape / dtype                  meaning
    ==================  =============================  ============================================
    ``data``            ``[R, H]``                     rows of group ``g`` are
                                                       ``[offsets[g-1], offsets[g])``; rows from
                                                       ``offsets[-1]`` on are padding
    ``split_sizes``     int64 ``[E]`` (device)         rows per group
    ``offsets``         int32 ``[E]`` (device)         cumulative ends, clamped to ``R``
    ``fp8``             :class:`Fp8Tensor` or None     optional FP8 copy of ``data``
    ==================  =============================  ============================================

    Build it with :meth:`from_splits`; the constructor only validates.
    """

    data: torch.Tensor
    split_sizes: torch.Tensor
    offsets: torch.Tensor
    fp8: Fp8Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor) or self.data.dim() != 2:
            raise ValueError(
                "GroupedTensor.data must be a 2-D [max_rows, hidden] tensor, got "
                f"{type(self.data).__name__} of shape {tuple(getattr(self.data, 'shape', ()))}"
            )
        if self.data.shape[0] > _MAX_ROWS:
            raise ValueError(f"GroupedTensor.data has {self.data.shape[0]} rows; grouped GEMM "
                             f"offsets are int32, so at most {_MAX_ROWS}")  # fmt: skip
        device = self.data.device
        _check_splits(self.split_sizes, device, "split_sizes")
        if self.split_sizes.dtype != torch.int64:
            raise TypeError(f"split_sizes must be int64, got {self.split_sizes.dtype} "
                            "(from_splits converts)")  # fmt: skip
        if not isinstance(self.offsets, torch.Tensor) or self.offsets.dtype != torch.int32:
            raise TypeError(
                "offsets must be an int32 tensor (torch._grouped_mm's offset type), got "
                f"{getattr(self.offsets, 'dtype', type(self.offsets).__name__)}"
            )
        if self.offsets.shape != self.split_sizes.shape or self.offsets.device != device:
            raise ValueError(
                f"offsets ({tuple(self.offsets.shape)} on {self.offsets.device}) must match "
                f"split_sizes ({tuple(self.split_sizes.shape)}) and live on {device}"
            )
        if self.fp8 is not None and tuple(self.fp8.data.shape) != tuple(self.data.shape):
            raise ValueError(f"fp8.data has shape {tuple(self.fp8.data.shape)} but data has "
                             f"{tuple(self.data.shape)}")  # fmt: skip

    @classmethod
    def from_splits(
        cls,
        data: torch.Tensor,
        split_sizes: torch.Tensor,
        *,
        fp8: Fp8Tensor | None = None,
    ) -> GroupedTensor:
        """Group ``data [R, H]`` by the device tensor ``split_sizes [E]`` (no host read)."""
        if not isinstance(data, torch.Tensor) or data.dim() != 2:
            raise ValueError(
                "from_splits expects a 2-D [max_rows, hidden] tensor, got "
                f"{type(data).__name__} of shape {tuple(getattr(data, 'shape', ()))}"
            )
        _check_splits(split_sizes, data.device)
        split_sizes_E = split_sizes.to(torch.int64)
        offsets_E = offsets_from_splits(split_sizes_E, data.shape[0])
        return cls(data, split_sizes_E, offsets_E, fp8)

    @property
    def num_groups(self) -> int:
        return self.split_sizes.numel()

    @property
    def max_rows(self) -> int:
        """The static row count ``R`` (the budget), known on the host."""
        return self.data.shape[0]

    @property
    def hidden(self) -> int:
        return self.data.shape[1]

    @property
    def num_rows(self) -> torch.Tensor:
        """The real row count as a 0-dim int32 device tensor (``offsets[-1]``)."""
        return self.offsets[-1]

    def row_mask(self) -> torch.Tensor:
        """bool ``[R]``, True for real rows (static shape; compare on the device)."""
        return row_mask_from_offsets(self.offsets, self.max_rows)

    def group_ids(self) -> torch.Tensor:
        """int64 ``[R]``: each row's group, ``num_groups`` for padding rows."""
        return group_ids_from_offsets(self.offsets, self.max_rows)
