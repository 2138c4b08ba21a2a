"""The test guard for invariant 2: no device→host read inside forward/backward."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FORBIDDEN = frozenset(
    {
        "aten::_local_scalar_dense",  # item(), bool(), int(), tolist()
        "aten::item",
        "aten::nonzero",
        "aten::argwhere",
        "aten::masked_select",
    }
)
_FORBIDDEN_PREFIXES = ("aten::unique", "aten::_unique")  # data-dependent output shapes
_PATCHED = ("tolist", "numpy")
_BODY = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _raiser(name: str):
    def read(self, *args, **kwargs):
        raise AssertionError(f"host read: Tensor.{name}")

    return read


class NoHostReads(TorchDispatchMode):
    """Raises ``AssertionError("host read: ...")`` on every op that reads device data on the host
    or has a data-dependent shape (``repeat_interleave`` counts unless given ``output_size``).

    ``Tensor.tolist`` and ``Tensor.numpy`` read CPU memory below the dispatcher, so they are
    patched to raise while the guard is active. The CPU autograd engine runs backward on the
    calling thread, so the guard sees backward too.

    A dispatch mode is off while its own handler runs, so an op's Python body (te_paged's stash
    ops: the kernel wrappers) would run unguarded: the guard re-enters itself around those.
    """

    _depth = 0  # the guard re-enters itself (see below): patch on the outermost entry only

    def __enter__(self):
        if self._depth == 0:
            self._saved = {name: getattr(torch.Tensor, name) for name in _PATCHED}
            for name in _PATCHED:
                setattr(torch.Tensor, name, _raiser(name))
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            for name, fn in self._saved.items():
                setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _FORBIDDEN or name.startswith(_FORBIDDEN_PREFIXES):
            raise AssertionError(f"host read: {name}")
        if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
            raise AssertionError(f"host read: {name} without output_size")
        if name.startswith("te_paged::"):  # run the op's body (past this mode) with the guard on
            with self:
                return func.redispatch(_BODY, *args, **kwargs)
        return func(*args, **kwargs)
