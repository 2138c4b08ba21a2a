"""The planner's pool per pipeline stage: hand-worked figures, PP 1 against the model's sizes,
and a real paged-stash manager driven through each stage's schedule, whose pools must be
exactly the planner's."""

from __future__ import annotations

import math

import pytest

from te_paged.moe import TEGroupedMLP
from te_paged.runtime.planner import (
    NAMED_CONFIGS,
    SavedTensor,
    expert_mlp_saved_tensors,
    named_sizes,
    pipeline_pool_plan,
    stashed_bytes_per_token,
)
from te_paged.runtime.schedules import PipelineConfig, pass_order
from te_paged.stash import PagedStashManager

from ..moe.harness import EXPERTS, config, step_inputs


def test_expert_mlp_saved_tensors_are_the_bytes_per_token() -> None:
    for hidden, ffn, gated, itemsize in [(256, 512, True, 4), (7168, 2048, True, 2),
                                         (64, 96, False, 1)]:  # fmt: skip
        saved = expert_mlp_saved_tensors(hidden, ffn, gated=gated, itemsize=itemsize)
        assert sum(t.row_bytes for t in saved) == stashed_bytes_per_token(
            hidden, ffn, gated=gated, itemsize=itemsize
        )
    # the keys TEGroupedMLP's manager names (tests/unit/moe/test_parity.py)
    keys = [t.key for t in expert_mlp_saved_tensors(32, 64, itemsize=4)]
    assert keys == ["float32x32", "float32x128", "float32x1", "float32x64"]
    with pytest.raises(ValueError, match="itemsize must be one of"):
        expert_mlp_saved_tensors(8, 8, itemsize=3)


@pytest.mark.parametrize(
    ("fp8", "activation_input"),
    [(None, False), ("tensorwise", False), ("tensorwise", True), ("mxfp8", False),
     ("mxfp8", True), ("nvfp4", False), ("nvfp4", True)],
)  # fmt: skip
def test_the_planners_tensors_are_what_the_manager_pages(fp8, activation_input) -> None:
    """The keys, rows and bytes per token the planner prices (NVFP4: 4.5 bits an element) are
    the pools a real MoE layer's capture step fills, for every storage recipe."""
    import torch

    from te_paged.moe import MoELayer

    cfg = config(
        moe_paged_stash=True,
        params_dtype=torch.bfloat16,
        fp8=fp8,
        activation_func_fp8_input_store=activation_input,
    )
    manager = PagedStashManager.from_config(cfg, "cpu")
    layer = MoELayer(cfg, None, manager, seed=0)
    tokens = 64
    manager.reset()
    x = torch.randn(tokens, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    out = layer(x)
    (out[0] if isinstance(out, tuple) else out).float().sum().backward()
    rows = {str(k): n for k, n in manager.stats().capture_peak_rows.items()}
    routed = tokens * cfg.moe_router_topk
    saved = expert_mlp_saved_tensors(
        cfg.hidden_size, cfg.moe_ffn_hidden_size, itemsize=2, fp8=fp8,
        fp8_activation_input=activation_input,
    )  # fmt: skip
    # One pool per key, in the order the manager met them; every routed row stashed once.
    assert list(rows) == list(dict.fromkeys(t.key for t in saved)), (rows, saved)
    assert rows == {t.key: math.ceil(routed / t.tokens_per_row) for t in saved}
    widths = {str(k): k.row_bytes for k in manager.keys}
    assert widths == {t.key: t.row_bytes for t in saved}
    per_token = stashed_bytes_per_token(
        cfg.hidden_size, cfg.moe_ffn_hidden_size, fp8=fp8, fp8_activation_input=activation_input
    )
    h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size
    elements = {None: 2, "tensorwise": 1, "mxfp8": 1 + 1 / 32, "nvfp4": 4.5 / 8}[fp8]
    act = 2 * f * (elements if activation_input else 2)
    assert per_token == pytest.approx((h + f) * elements + act + 4)


def test_hand_worked_1f1b_stage_pools() -> None:
    # P 2, M 4, 4 layers (2 per stage), 100 balanced rows, pages of 64 rows: each tensor takes
    # ceil(100 / 64) = 2 pages. Stage 0 holds 2 microbatches = 4 layers: 8 pages per key, pool
    # ceil(1.1 x 8) = 9; stage 1 holds 1 = 2 layers: 4 pages, pool ceil(4.4) = 5.
    saved = expert_mlp_saved_tensors(8, 16, itemsize=4)  # rows of 32, 128, 4 and 64 bytes
    stages = pipeline_pool_plan(
        pipeline_parallel=2, microbatches=4, num_layers=4, balanced_rows=100, saved=saved,
        page_size=64, buffer_factor=1.1, capacity_factor=2.0, skip_immediate_backward=False,
    )  # fmt: skip
    s0, s1 = stages
    assert (s0.in_flight.peak, s0.live_layers, s1.in_flight.peak, s1.live_layers) == (2, 4, 1, 2)
    assert s0.peak_balanced_pages == dict.fromkeys(["float32x8", "float32x32", "float32x1",
                                                    "float32x16"], 8)  # fmt: skip
    assert set(s0.pool_pages.values()) == {9} and set(s1.pool_pages.values()) == {5}
    assert s0.pool_bytes["float32x32"] == 9 * 64 * 128
    assert s0.total_pool_bytes == 9 * 64 * (32 + 128 + 4 + 64)
    assert s0.s_bytes == 4 * 100 * 228 and s1.s_bytes == 2 * 100 * 228
    assert s0.static_bytes == 2.0 * s0.s_bytes
    assert s0.saving_bytes == pytest.approx(0.9 * s0.s_bytes)
    assert s0.peak_saving_bytes == pytest.approx((2.0 - 1.1 - 2.0 / 4) * s0.s_bytes)
    d = s0.to_dict()
    assert (d["in_flight"], d["chunk_peaks"], d["total_pool_bytes"]) == (2, [2], 9 * 64 * 228)
    # skip_immediate_backward: stage 1, the last, runs F(m) B(m), so each microbatch's last
    # layer is popped first and stays out of the pool: 1 layer, 2 pages, pool ceil(2.2) = 3.
    # Stage 0's forwards are followed by another microbatch's backward: nothing kept.
    k0, k1 = pipeline_pool_plan(
        pipeline_parallel=2, microbatches=4, num_layers=4, balanced_rows=100, saved=saved,
        page_size=64, buffer_factor=1.1, capacity_factor=2.0, skip_immediate_backward=True,
    )  # fmt: skip
    assert (k0.pooled_layers, k1.pooled_layers, k1.live_layers) == (4, 1, 2)
    assert k0.pool_pages == s0.pool_pages and set(k1.pool_pages.values()) == {3}
    assert k1.s_bytes == s1.s_bytes  # S counts the kept layer: the model prices every layer
    assert k1.peak_saving_bytes == pytest.approx((2.0 - 1.1 / 2 - 2.0 / 2) * k1.s_bytes)


def test_interleaved_stage_pools_and_shared_keys() -> None:
    # P 2, V 2, M 4, 8 layers: chunks of 2. Stage 0 holds 5 microbatch-chunks = 10 layers.
    # H == 2F: the FC1 input and the activation input share one pool (2 tensors per layer).
    saved = expert_mlp_saved_tensors(64, 32, itemsize=2)
    assert [t.key for t in saved] == ["bfloat16x64", "bfloat16x64", "float32x1", "bfloat16x32"]
    stages = pipeline_pool_plan(
        pipeline_parallel=2, microbatches=4, virtual_stages=2, num_layers=8, balanced_rows=64,
        saved=saved, page_size=64, buffer_factor=1.0,
    )  # fmt: skip
    assert [(s.in_flight.peak, s.in_flight.chunk_peaks, s.live_layers) for s in stages] == [
        (5, (4, 2), 10), (3, (3, 1), 6)
    ]  # fmt: skip
    assert stages[0].peak_balanced_pages == {"bfloat16x64": 20, "float32x1": 10, "bfloat16x32": 10}
    assert stages[0].pool_pages == stages[0].peak_balanced_pages  # factor 1: the peak itself


def test_page_rounding_and_the_managers_float_ceiling() -> None:
    # 1 balanced row per tensor still takes a whole page; 1.1 x 50 is 55.000000000000007 in
    # floating point, and the manager's ceil makes 56 of it: the plan must agree.
    one_key = [SavedTensor("float32x4", 16)]
    (stage,) = pipeline_pool_plan(
        pipeline_parallel=1, microbatches=3, num_layers=50, balanced_rows=1, saved=one_key,
        page_size=64, buffer_factor=1.1, skip_immediate_backward=False,
    )  # fmt: skip
    assert stage.peak_balanced_pages == {"float32x4": 50}
    assert stage.pool_pages == {"float32x4": math.ceil(1.1 * 50)} == {"float32x4": 56}
    # An MXFP8 scale-inverse: one row per 32 tokens, so 100 tokens are 4 rows, one page.
    scales = [SavedTensor("float8_e8m0fnux2", 2, tokens_per_row=32)]
    (stage,) = pipeline_pool_plan(
        pipeline_parallel=1, microbatches=1, num_layers=3, balanced_rows=100, saved=scales,
        page_size=4, buffer_factor=1.0, skip_immediate_backward=False,
    )  # fmt: skip
    assert stage.peak_balanced_pages == {"float8_e8m0fnux2": 3}


def test_pipeline_of_one_is_the_models_sizes() -> None:
    cfg = NAMED_CONFIGS["deepseek-v3"]
    sizes = named_sizes(cfg, seq=4096, batch=1, ep=64, capacity_factor=1.5, buffer_factor=1.1)
    (stage,) = pipeline_pool_plan(
        pipeline_parallel=1, microbatches=8, num_layers=cfg.moe_layers,
        balanced_rows=sizes["balanced_rows"], saved=expert_mlp_saved_tensors(cfg.hidden, cfg.ffn),
        buffer_factor=1.1, capacity_factor=1.5,
    )  # fmt: skip
    assert (stage.in_flight.peak, stage.live_layers) == (1, cfg.moe_layers)
    assert stage.s_bytes == sizes["S_bytes"]
    assert stage.saving_bytes == pytest.approx(sizes["predicted_saving_bytes"])
    assert stage.peak_saving_bytes == pytest.approx(sizes["peak_saving_bytes"])
    # Pages of 64 rows hold 32,768 balanced rows exactly: the pool is 1.1 x S within a page.
    page_bytes = 64 * stashed_bytes_per_token(cfg.hidden, cfg.ffn)
    assert abs(stage.total_pool_bytes - sizes["mlp_saved_bytes_pool"]) <= page_bytes


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_layers": 6}, r"multiple of pipeline_parallel × model chunks = 2 × 2 = 4"),
        ({"balanced_rows": 0}, "balanced_rows must be an int >= 1"),
        ({"page_size": 0}, "page_size must be an int >= 1"),
        ({"buffer_factor": float("nan")}, "buffer_factor must be a finite number > 0"),
        ({"capacity_factor": 0}, "capacity_factor must be a finite number > 0"),
        ({"saved": []}, "saved is empty"),
        ({"saved": [SavedTensor("a", 2), SavedTensor("a", 4)]}, "one key with two row sizes"),
        ({"microbatches": 3}, "remainder is 1"),
    ],
)
def test_pipeline_pool_plan_refuses(kw, message) -> None:
    args = {
        "pipeline_parallel": 2, "microbatches": 4, "virtual_stages": 2, "num_layers": 8,
        "balanced_rows": 32, "saved": expert_mlp_saved_tensors(8, 8), **kw,
    }  # fmt: skip
    with pytest.raises(ValueError, match=message):
        pipeline_pool_plan(**args)


LAYERS_PER_CHUNK = 2


def _run_stage(pipeline: PipelineConfig, rank: int, cfg) -> tuple[dict, dict, dict]:
    """One stage's capture step and one captured step, its passes in the schedule's order; the
    inputs of a chunk are fresh leaves, as a stage receives them from its neighbour. Returns
    the capture peak, the pools sized from it and the captured step's high-water marks."""
    manager = PagedStashManager.from_config(cfg, device="cpu")
    chunks = [
        [TEGroupedMLP(EXPERTS, cfg, manager=manager) for _ in range(LAYERS_PER_CHUNK)]
        for _ in range(pipeline.chunks)
    ]
    peaks = None
    for _ in range(2):
        manager.reset()
        live = {}
        for p in pass_order(pipeline, rank):
            if p.forward:
                h, tokens_per_expert, probs = step_inputs(cfg, p.microbatch)
                for layer in chunks[p.chunk]:
                    h, _ = layer(h, tokens_per_expert, probs)
                live[p.microbatch, p.chunk] = h
            else:
                live.pop((p.microbatch, p.chunk)).square().sum().backward()
        stats = manager.stats()
        assert not live and stats.stashes == stats.pops and not stats.overflow
        if peaks is None:
            peaks = stats.capture_peak_balanced_pages
    return peaks, stats.pool_pages, stats.pages_high_water


@pytest.mark.parametrize(
    ("stages", "microbatches", "virtual"),
    [(2, 3, None), (3, 4, None), (2, 4, 2), (2, 4, 1)],
    ids=["1f1b-p2m3", "1f1b-p3m4", "interleaved-p2v2m4", "interleaved-p2v1m4"],
)
@pytest.mark.parametrize("skip", [True, False], ids=["kept", "all-paged"])
def test_a_real_manager_through_each_stages_schedule_sizes_the_planned_pool(
    stages, microbatches, virtual, skip
) -> None:
    # The harness's experts: 64 static rows, capacity factor 2 (32 balanced), pages of 8 rows:
    # 4 pages per tensor; 30 and 29 actual rows also take 4. Buffer factor 1.1. With skip, the
    # manager learns from the schedule which forwards' backward comes next; the plan from
    # pass_order: both must keep the same layers out of the pool.
    cfg = config(
        moe_paged_stash=True,
        moe_paged_stash_buffer_size_factor_cuda=1.1,
        moe_paged_stash_skip_immediate_backward=skip,
    )
    pipeline = PipelineConfig(stages, microbatches, virtual)
    plan = pipeline_pool_plan(
        pipeline_parallel=stages, microbatches=microbatches, virtual_stages=virtual,
        num_layers=stages * pipeline.chunks * LAYERS_PER_CHUNK, balanced_rows=32,
        saved=expert_mlp_saved_tensors(cfg.hidden_size, cfg.moe_ffn_hidden_size, itemsize=4),
        page_size=cfg.moe_paged_stash_page_size, buffer_factor=1.1, capacity_factor=2.0,
        skip_immediate_backward=skip,
    )  # fmt: skip
    if skip and virtual is None:  # 1F1B: the last stage keeps a layer of each microbatch
        assert plan[-1].pooled_layers < plan[-1].live_layers
    for rank, stage in enumerate(plan):
        peaks, pools, high_water = _run_stage(pipeline, rank, cfg)
        assert peaks == stage.peak_balanced_pages, rank
        assert pools == stage.pool_pages, rank  # exact: the one-page tolerance is not needed
        assert high_water == stage.peak_balanced_pages, rank  # 30 rows fill 4 pages like 32
