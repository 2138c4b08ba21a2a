"""The ``triton`` stash backend: :mod:`te_paged.kernels.triton_stash`, imported on first use
(choosing a backend must not pay for, or initialise, Triton)."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["triton_available"]


def triton_available() -> tuple[bool, str]:
    """``(ok, reason)``: whether the Triton kernels can run here."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'te_paged[triton]')"
    return True, ""


def triton_usable(device: torch.device) -> tuple[bool, str]:
    ok, reason = triton_available()
    if not ok:
        return ok, reason
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        # TRITON_INTERPRET is read here and nowhere else.
        return False, (
            f"on device {device} it needs Triton's interpreter: set TRITON_INTERPRET=1 before "
            "importing te_paged, or use 'torch'"
        )
    return True, ""


@functools.cache
def _kernels():
    """The kernels' module, imported at the first stash (a cached call: an import statement
    per call would cost more than the rest of the host path's look-ups together)."""
    from te_paged.kernels import triton_stash

    return triton_stash


def triton_copy(*args: object) -> None:
    _kernels().triton_stash_copy(*args)


def triton_pop(*args: object) -> None:
    _kernels().triton_stash_pop(*args)
