"""Paged stash ON vs OFF and op-fuser vs unfused: bitwise equal, and the stash really used."""

from __future__ import annotations

import itertools

import pytest
import torch

from te_paged.config import Activation

from .harness import build, config, run_step

MATRIX = list(
    itertools.product(
        [False, True],  # op fuser
        ["swiglu", "quick_geglu"],
        [None, "tensorwise", "mxfp8", "nvfp4"],
        [[], ["moe_act"]],
        [False, True],  # bias
    )
)


def _ids(case) -> str:
    fuser, act, fp8, rc, bias = case
    return (
        f"{'fused' if fuser else 'unfused'}-{act}-{fp8}-{'rc' if rc else 'norc'}-{bias and 'bias'}"
    )


@pytest.mark.parametrize("case", MATRIX, ids=[_ids(c) for c in MATRIX])
def test_stash_on_off_bitwise_equal(case) -> None:
    fuser, act, fp8, rc, bias = case
    kw = {
        "activation": act,
        "fp8": fp8,
        "recompute_modules": rc,
        "add_bias_linear": bias,
        "use_transformer_engine_op_fuser": fuser,
    }
    on_cfg, off_cfg = config(moe_paged_stash=True, **kw), config(**kw)
    manager, on_layers = build(on_cfg)
    _, off_layers = build(off_cfg)
    _, ref_layers = build(config(**{**kw, "use_transformer_engine_op_fuser": not fuser}))
    for step in range(2):  # capture step, then captured step
        on = run_step(manager, on_layers, on_cfg, step)
        off = run_step(None, off_layers, off_cfg, step)
        other_path = run_step(None, ref_layers, off_cfg, step)
        assert all(torch.equal(a, b) for a, b in zip(on, off)), f"ON != OFF at step {step}"
        assert all(torch.equal(a, b) for a, b in zip(off, other_path)), "fused != unfused"
        stats = manager.stats()
        assert stats.stashes == stats.pops > 0, stats
        assert not stats.overflow
        if step == 1:
            assert sum(stats.pages_high_water.values()) > 0
        fc2_input_key = f"{torch.float32}x{on_cfg.moe_ffn_hidden_size}".removeprefix("torch.")
        if fp8 is None:
            # FC2 saves the activation output: paged, unless recompute owns it.
            assert (fc2_input_key in stats.capture_peak_rows) is (not rc)


@pytest.mark.parametrize("fuser", [False, True])
@pytest.mark.parametrize("rc", [[], ["moe_act"]])
def test_probs_on_input_and_fp8_activation_store(fuser, rc) -> None:
    kw = {
        "moe_apply_probs_on_input": True,
        "fp8": "tensorwise",
        "recompute_modules": rc,
        "activation_func_fp8_input_store": True,
        "use_transformer_engine_op_fuser": fuser,
    }
    manager, on_layers = build(config(moe_paged_stash=True, **kw))
    _, off_layers = build(config(**kw))
    for step in range(2):
        on = run_step(manager, on_layers, config(moe_paged_stash=True, **kw), step)
        off = run_step(None, off_layers, config(**kw), step)
        assert all(torch.equal(a, b) for a, b in zip(on, off))
        assert not manager.stats().overflow


def test_recompute_marks_operands_from_the_config_not_from_attributes() -> None:
    # With moe_act recompute the activation sees detached operands; the packed-bias and the
    # activation inputs must still be paged (the review finding on the prior art).
    cfg = config(moe_paged_stash=True, recompute_modules=["moe_act"], add_bias_linear=True)
    manager, layers = build(cfg)
    run_step(manager, layers, cfg, 0)
    keys = set(manager.stats().capture_peak_rows)
    assert {"float32x128", "float32x1", "float32x32"} <= keys  # act input, probs, bias rows


@pytest.mark.parametrize("rc", [[], ["moe_act"]], ids=["norc", "rc"])
@pytest.mark.parametrize("activation", [a.value for a in Activation])
def test_every_activation_stash_on_off_bitwise_and_as_paged_as_swiglu(activation, rc) -> None:
    """The unfused order (``bias_activation_fusion=False``) for every activation, gated or not:
    ON == OFF bitwise, and exactly as many tensors paged as the fused SwiGLU pages."""
    gated = Activation(activation).is_gated
    kw = {
        "activation": activation,
        "gated_linear_unit": gated,
        "bias_activation_fusion": False,
        "recompute_modules": rc,
        "add_bias_linear": True,
    }
    on_cfg, off_cfg = config(moe_paged_stash=True, **kw), config(**kw)
    manager, on_layers = build(on_cfg)
    _, off_layers = build(off_cfg)
    ref_cfg = config(moe_paged_stash=True, recompute_modules=rc, add_bias_linear=True)
    ref_manager, ref_layers = build(ref_cfg)  # fused SwiGLU
    for step in range(2):
        on = run_step(manager, on_layers, on_cfg, step)
        off = run_step(None, off_layers, off_cfg, step)
        assert all(torch.equal(a, b) for a, b in zip(on, off)), f"ON != OFF at step {step}"
        run_step(ref_manager, ref_layers, ref_cfg, step)
        stats, ref_stats = manager.stats(), ref_manager.stats()
        assert stats.stashes == stats.pops == ref_stats.stashes > 0, (stats, ref_stats)
        assert not stats.overflow
