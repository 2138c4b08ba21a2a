"""Where the Triton kernels run in a test: the CPU under the interpreter, else CUDA."""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> torch.device:
    """CPU under the interpreter; CUDA when the kernels are compiled (skip without a GPU)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 compiles the kernels, which needs a CUDA device")
    return torch.device("cuda")
