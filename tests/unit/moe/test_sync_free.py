"""The captured ON step with the Triton kernels performs no device→host read."""

from __future__ import annotations

import pytest
import torch

from tests.host_reads import NoHostReads

from .harness import build, config, run_step

pytest.importorskip("triton")


def test_guard_catches_a_host_read() -> None:
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        torch.tensor([3]).item()


@pytest.mark.parametrize("fuser", [False, True])
@pytest.mark.parametrize("fp8", [None, "mxfp8", "nvfp4"])
def test_captured_step_is_sync_free_and_matches_the_reference(fuser, fp8) -> None:
    kw = {"use_transformer_engine_op_fuser": fuser, "fp8": fp8, "moe_paged_stash": True}
    triton_cfg = config(moe_paged_stash_kernel_backend="triton", **kw)
    manager, layers = build(triton_cfg)
    torch_cfg = config(moe_paged_stash_kernel_backend="torch", **kw)
    ref_manager, ref_layers = build(torch_cfg)
    run_step(manager, layers, triton_cfg, 0)  # capture step: may read counts on the host
    run_step(ref_manager, ref_layers, torch_cfg, 0)
    manager.reset()  # allocates the pools, outside the guarded step
    ref_manager.reset()
    with NoHostReads():
        on = run_step(manager, layers, triton_cfg, 1)
    ref = run_step(ref_manager, ref_layers, torch_cfg, 1)
    assert all(torch.equal(a, b) for a, b in zip(on, ref))
    stats, ref_stats = manager.stats(), ref_manager.stats()
    assert stats.stashes == stats.pops > 0 and not stats.overflow
    for key, buf in manager.buffers.items():  # identical pool state after the step
        other = ref_manager.buffers[key]
        for a, b in zip(buf.kernel_args(), other.kernel_args()):
            assert torch.equal(a, b), key
    assert stats.pages_high_water == ref_stats.pages_high_water


def test_guard_sees_backward_too() -> None:
    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            g.sum().item()
            return g

    x = torch.ones(3, requires_grad=True)
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        ReadsInBackward.apply(x).sum().backward()


@pytest.mark.parametrize("wrapper", ["triton_stash_copy", "triton_stash_pop"])
def test_mutation_a_host_read_inside_a_kernel_wrapper_fails_the_guard(monkeypatch, wrapper):
    # The wrappers run inside te_paged's ops, where a dispatch mode is off unless it re-enters
    # itself: before, a .item() added here passed the sync-freedom test.
    from te_paged.kernels import triton_stash

    original = getattr(triton_stash, wrapper)

    def reads_the_count(*args):
        args[0].sum().item()  # one host read, as a careless edit would add
        return original(*args)

    monkeypatch.setattr(triton_stash, wrapper, reads_the_count)
    cfg = config(moe_paged_stash_kernel_backend="triton", moe_paged_stash=True)
    manager, layers = build(cfg)
    run_step(manager, layers, cfg, 0)
    manager.reset()
    with pytest.raises(AssertionError, match="host read"), NoHostReads():
        run_step(manager, layers, cfg, 1)
