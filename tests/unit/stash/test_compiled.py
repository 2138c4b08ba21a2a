"""The paged stash under torch.compile (te_paged.kernels.compiled): compiled ON equals compiled
OFF bitwise, and pages what eager pages, with the same copies, pops and pools.

Compile is slow on two cores: shapes are the harness's tiny ones, every compiled run is two
steps (the capture step and a paged one) and each test compiles what it compares once. The
broad matrix runs on ``aot_eager``; ``inductor`` runs the two expert paths.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from te_paged.moe import TEGroupedMLP
from te_paged.stash import PagedStashManager, StashMode

from ..moe.harness import EXPERTS, config, step_inputs

STEPS = 2  # the capture step, then a paged step (later steps: test_compiled_runtime.py)


def _config(paged: bool, **kw):
    kw.setdefault("params_dtype", torch.bfloat16)  # torch._grouped_mm's fake kernel: bf16
    return config(moe_paged_stash=paged, moe_use_grouped_tensor=True, **kw)


@contextlib.contextmanager
def _device_path():
    """Eager on the device path (what CUDA runs; compiled code never reads offsets on the
    host): the packed bias then saves its two token-major operands, as compiled code does."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr("te_paged.grouped.grouped_mm._host_reads_are_free", lambda t: False)
        yield


def run(cfg_kw, *, paged, backend=None, fullgraph=True, layers=2, steps=STEPS, skip=False):
    """``steps`` steps of a ``layers``-deep expert stack, compiled with ``backend`` (None:
    eager); returns every step's output and gradients, the stats and the compile counter."""
    cfg = _config(paged, moe_paged_stash_skip_immediate_backward=skip, **cfg_kw)
    torch.manual_seed(0)
    manager = PagedStashManager.from_config(cfg) if paged else None
    mlps = [TEGroupedMLP(EXPERTS, cfg, manager=manager) for _ in range(layers)]

    def forward(h, tokens_per_expert, probs):
        for mlp in mlps:
            h, _ = mlp(h, tokens_per_expert, probs)
        return h

    counter = None
    if backend is not None:
        torch._dynamo.reset()  # closures of one code object: no cache entries across runs
        counter = CompileCounterWithBackend(backend)
        forward = torch.compile(forward, backend=counter, fullgraph=fullgraph)
    results, stats = [], []
    for step in range(steps):
        if manager is not None:
            manager.reset()
        x, tokens, probs = step_inputs(cfg, step)
        x = x.detach().to(cfg.params_dtype).requires_grad_()
        out = forward(x, tokens, probs)
        out.float().square().sum().backward()
        results.append(
            [out.detach(), x.grad, probs.grad] + [p.grad for m in mlps for p in m.parameters()]
        )
        for m in mlps:
            m.zero_grad(set_to_none=True)
        if manager is not None:
            stats.append(manager.stats())
    return results, stats, counter


def _paging(stats):
    """What the stash did in each step: mode, copies, pops, kept tensors, pool pages, and the
    capture step's peaks (what the pools are sized from)."""
    return [
        (s.mode, s.stashes, s.pops, s.stashes_skipped, s.pool_pages, s.pages_high_water,
         s.capture_peak_balanced_pages, s.capture_peak_static_pages)
        for s in stats
    ]  # fmt: skip


def assert_bitwise(a, b) -> None:
    for step, (xs, ys) in enumerate(zip(a, b, strict=True)):
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            assert torch.equal(x, y), f"step {step}, tensor {i}: compiled ON differs from OFF"


_RUNS: dict = {}


def cached_run(cfg_kw, **kw):
    """:func:`run`, once per module for each distinct set of arguments (compile is slow)."""
    key = (tuple(sorted((k, repr(v)) for k, v in cfg_kw.items())), tuple(sorted(kw.items())))
    if key not in _RUNS:
        device_path = kw.pop("device_path", False)
        with _device_path() if device_path else contextlib.nullcontext():
            _RUNS[key] = run(cfg_kw, **kw)
    return _RUNS[key]


def check(cfg_kw=None, *, backend="aot_eager", fullgraph=True, skip=False, device_path=False):
    """Compiled ON == compiled OFF bitwise; compiled ON pages as eager ON does (on the device
    path where the configuration differs there: compiled code never reads on the host)."""
    cfg_kw = cfg_kw or {}
    on, on_stats, counter = run(cfg_kw, paged=True, backend=backend, fullgraph=fullgraph,
                                skip=skip)  # fmt: skip
    off, _, _ = cached_run(cfg_kw, paged=False, backend=backend)  # no stash: no graph break
    assert_bitwise(on, off)
    _, eager_stats, _ = cached_run(cfg_kw, paged=True, skip=skip, device_path=device_path)
    assert _paging(on_stats) == _paging(eager_stats)
    assert [s.mode for s in on_stats] == [StashMode.CAPTURE, StashMode.CAPTURED]
    assert on_stats[-1].stashes > 0 and on_stats[-1].pool_bytes > 0
    return on_stats, counter


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
@pytest.mark.parametrize("fuser", [False, True], ids=["unfused", "op-fuser"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_on_equals_off_and_pages_as_eager(backend, fuser, fullgraph) -> None:
    _, counter = check({"use_transformer_engine_op_fuser": fuser}, backend=backend,
                       fullgraph=fullgraph)  # fmt: skip
    # One graph for the capture step and every paged step: the manager's mode is read when
    # the ops run, not while tracing, so moving out of the capture step recompiles nothing.
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "cfg_kw",
    [
        # Each a combination, to keep the compiles few: every FP8 storage (the linears' inputs
        # and the activation's), both fused activations and the unfused order, the squared
        # ReLU kernel, the packed bias and the probabilities applied on the input.
        {"fp8": "tensorwise", "activation_func_fp8_input_store": True, "add_bias_linear": True,
         "moe_apply_probs_on_input": True, "use_transformer_engine_op_fuser": True},
        {"fp8": "mxfp8", "activation": "quick_geglu", "activation_func_fp8_input_store": True},
        {"fp8": "nvfp4", "activation_func_fp8_input_store": True,
         "use_transformer_engine_op_fuser": True},
        {"bias_activation_fusion": False, "add_bias_linear": True},
        {"activation": "squared_relu", "gated_linear_unit": False,
         "use_fused_weighted_squared_relu": True, "bias_activation_fusion": False},
    ],
    ids=["tensorwise-bias-fuser", "mxfp8-quick-geglu", "nvfp4-fuser", "unfused-act-bias",
         "squared-relu"],
)  # fmt: skip
def test_every_layer_variant_compiles_and_pages_as_eager(cfg_kw) -> None:
    check(cfg_kw, device_path="add_bias_linear" in cfg_kw)


def test_moe_act_recompute_compiles_on_the_op_fuser_path() -> None:
    check({"use_transformer_engine_op_fuser": True, "recompute_modules": ["moe_act"]})


def test_skip_immediate_backward_keeps_the_last_layer_as_eager_does() -> None:
    stats, _ = check(skip=True)
    assert stats[1].stashes_skipped > 0 and stats[1].stashes > 0


def test_check_without_output_refuses_to_compile_naming_itself() -> None:
    cfg_kw = {"recompute_modules": ["moe_act"]}
    with pytest.raises(Exception, match="CheckpointWithoutOutput does not compile"):
        run(cfg_kw, paged=True, backend="aot_eager", steps=1)
