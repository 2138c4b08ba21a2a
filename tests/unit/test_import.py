"""`import te_paged` needs no GPU, no Triton, no Transformer Engine and initialises no CUDA (nor
imports Dynamo)."""

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
        import te_paged.moe, te_paged.grouped, te_paged.runtime, te_paged.cli
        assert not torch.cuda.is_initialized(), "importing te_paged initialised CUDA"
        # Dynamo's import is 1.2 s of CPU a process (the CLI, each rank that never compiles);
        # on a torch too old to compile te_paged, the import builds the refusal with it
        from te_paged.torch_compat import COMPILE_RELEASE, TORCH_RELEASE
        if TORCH_RELEASE >= COMPILE_RELEASE:
            assert "torch._dynamo" not in sys.modules, "importing te_paged imported torch._dynamo"
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


def test_import_and_a_compiled_layer_are_silent_with_warnings_as_errors() -> None:
    """No deprecated torch API (torch 2.15 renamed the opaque-object names te_paged's compiled
    stash registers; the old ones warn, through both ``warnings`` and torch's logger): the
    import and, where the running torch compiles te_paged, a paged step of a compiled layer
    raise no warning and print nothing."""
    code = textwrap.dedent(
        r"""
        import warnings
        warnings.simplefilter("error")
        import torch
        import te_paged
        # torch 2.13's Dynamo makes an autograd.Function instance itself while it traces one
        # (torch's own deprecation, gone in 2.15): not an API te_paged calls.
        warnings.filterwarnings(
            "ignore", r"<class 'torch\.autograd\.function\.Function'> should not be",
            DeprecationWarning,
        )
        from te_paged.moe import TEGroupedMLP
        from te_paged.torch_compat import COMPILE_RELEASE, TORCH_RELEASE
        if TORCH_RELEASE >= COMPILE_RELEASE:  # older: compiling is refused (test_torch_compat)
            cfg = te_paged.MoEConfig(
                hidden_size=16, moe_ffn_hidden_size=16, num_moe_experts=2,
                moe_expert_rank_capacity_factor=2.0, moe_paged_stash=True,
                moe_paged_stash_page_size=4, moe_paged_stash_skip_immediate_backward=False,
                moe_use_grouped_tensor=True, params_dtype=torch.bfloat16,
            )
            manager = te_paged.PagedStashManager.from_config(cfg, "cpu")
            mlp = TEGroupedMLP(2, cfg, manager=manager)
            mlp.compile(backend="aot_eager", fullgraph=True)
            for step in range(2):  # the capture step, then a paged one
                manager.reset()
                x = torch.randn(32, 16, dtype=torch.bfloat16, requires_grad=True)
                out, _ = mlp(x, torch.tensor([5, 7]), torch.rand(32))
                out.float().sum().backward()
            assert manager.traced_scopes == 1 and manager.stats().stashes > 0
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok" and out.stderr == "", (
        "import te_paged or a compiled step wrote to stderr (a deprecated torch API?):\n"
        + out.stderr[-3000:]
    )
