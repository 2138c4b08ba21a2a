"""A single grouped weight ``[E, O, I]`` or bias ``[E, O]`` with the part of Transformer Engine's
grouped storage API that TE's tests and users read.

In TE 2.19+ (``single_grouped_weight`` / ``single_grouped_bias``) the parameter is a
``GroupedTensor``: one flat buffer (``rowwise_data``) holding the ``E`` members back to back,
with its shape metadata (docs/dev/te-2.20.2-grouped-storage.md). te_paged's is a plain
``nn.Parameter`` of shape ``[E, O, I]``; :class:`GroupedParameter` adds TE's read-only names as
views of it, so that TE-style code —
``module.weight.rowwise_data.view_as(w).copy_(w)``, ``split_into_quantized_tensors()`` — reads
and writes the parameter itself. Rebinding a buffer (``param.rowwise_data = other``, as
megatron-core's DDP does for TE's ``GroupedTensor``) is refused: the storage is the parameter's.

Worked example, ``E = 2``, ``O = 3``, ``I = 4``: ``rowwise_data`` is the 24 elements of the
parameter, ``logical_shape`` ``(6, 4)``, ``tensor_shapes`` ``[(3, 4), (3, 4)]``, ``offsets``
``[0, 12, 24]``, ``quantized_tensors[1]`` the parameter's ``[1]`` (a ``(3, 4)`` view).
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["GroupedParameter"]


class GroupedParameter(nn.Parameter):
    """An ``nn.Parameter`` ``[E, ...]`` whose members are ``self[e]``, with TE's grouped
    storage names (module docstring). Unquantised: ``columnwise_data`` and ``quantizer`` are
    None, as in TE's unquantised ``GroupedTensor``."""

    @property
    def rowwise_data(self) -> Tensor:
        """The members back to back, flat: a view, so writes land in the parameter."""
        return self.data.view(-1)

    @rowwise_data.setter
    def rowwise_data(self, value: object) -> None:
        raise AttributeError(
            "rowwise_data of te_paged's grouped parameter is a view of the parameter itself, not "
            "a buffer that can be replaced: write into it (rowwise_data.copy_(...)), or replace "
            "the parameter's .data"
        )

    @property
    def columnwise_data(self) -> None:
        return None

    @property
    def quantizer(self) -> None:
        return None

    @property
    def num_tensors(self) -> int:
        return self.shape[0]

    @property
    def tensor_shapes(self) -> list[tuple[int, ...]]:
        return [tuple(self.shape[1:])] * self.shape[0]

    @property
    def logical_shape(self) -> tuple[int, int]:
        """The members stacked as rows: ``(E·O, I)``, or ``(E·O, 1)`` for a bias."""
        inner = self.shape[2:].numel() if self.dim() > 2 else 1
        return (self.shape[0] * self.shape[1], inner)

    @property
    def offsets(self) -> list[int]:
        """Each member's first element in ``rowwise_data``, and the end."""
        step = self.shape[1:].numel()
        return [e * step for e in range(self.shape[0] + 1)]

    @property
    def quantized_tensors(self) -> list[Tensor]:
        """The members, as views (TE: the per-member tensors of its storage)."""
        return list(self.data.unbind(0))

    def split_into_quantized_tensors(self) -> list[Tensor]:
        return self.quantized_tensors
