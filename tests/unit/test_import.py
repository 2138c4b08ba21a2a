"""`import te_paged` needs no GPU, no Triton, no Transformer Engine and initialises no CUDA."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_without_triton_or_te_touches_no_cuda() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None               # any import of triton now fails
        sys.modules["transformer_engine"] = None
        import torch
        import te_paged, te_paged.stash, te_paged.kernels, te_paged.markers, te_paged.config
        assert not torch.cuda.is_initialized(), "importing te_paged initialised CUDA"
        assert "triton" not in sys.modules or sys.modules["triton"] is None
        names = [n for n in te_paged.__all__ if n.startswith("_")]
        assert not names, names
        for n in te_paged.__all__:
            getattr(te_paged, n)
        # the CPU reference path works without Triton
        m = te_paged.PagedStashManager(page_size=4, device="cpu")
        assert m.backend.name == te_paged.KernelBackend.TORCH
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
