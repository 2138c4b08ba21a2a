"""Checks that need a CUDA GPU; run through ``scripts/gpu_check.sh`` (under 8 minutes on one H200).

Writes a Markdown report (``benchmarks/results/gpu-<date>.md``): the command, the machine, one
row per check (target, result, figures, seconds), then each check's full tables.

1. the Triton kernels vs the torch reference, compiled (``TRITON_INTERPRET=0``): the kernel unit
   tests, and one stash and pop per element type at model sizes (bf16, fp16, fp32, FP8 e4m3 and
   e5m2, the MXFP8 scale pool) on fresh, 1F1B and alternating free lists and a host-tier spill;
2. paged stash ON vs OFF (and op-fuser vs unfused) on CUDA, bf16 and MXFP8, ``TEGroupedMLP``
   and ``MoELayer`` (1 rank), bitwise;
3. ``torch.cuda.set_sync_debug_mode("error")`` around the captured step of ``TEGroupedMLP``
   and ``MoELayer`` (1 rank);
4. CUDA-graph capture and replay of ``TEGroupedMLP``'s captured step, bitwise against eager;
5. the same for ``MoELayer`` (1 rank);
6. stash+pop bandwidth vs a device-to-device copy of the same bytes (``stash_report``):
   >= 0.85 of a plain copy from 268 MB moved, >= 0.70 at 134 MB, every free list;
7. step time ON/OFF with and without stream overlap, DeepSeek-like expert layers (<= 1.02 with
   overlap), with a per-kernel profile that attributes ON − OFF to te_paged's stash and pop
   kernels, the other kernels and the device's idle time;
8. peak allocated memory ON/OFF (the CUDA allocator's statistics) vs the capacity model;
9. ``te-paged ab --device cuda`` with one rank, default and op-fuser + recompute paths.
10. Megatron-core 0.19.2's stash copy and pop kernels vs te_paged's Triton kernels: the time
    ratio, <= 1.0 at every size and free list (N/A without megatron-core 0.19.2).
11. te_paged's experts behind Megatron's HybridEP dispatcher with the real ``deep_ep`` (N/A
    where HybridEP or megatron-core does not import).
12. Transformer Engine 2.19's ``GroupedLinear`` cases ported to CPU in tests/unit/grouped, run
    on CUDA bf16 (host ``m_splits`` with a CUDA input, layouts, ``save_original_input``,
    prequantized MXFP8).

Each check runs in its own process (a CUDA error cannot poison the next one; ``--in-process``
for debugging) and reports PASS (its target met), MISS (it ran; a figure missed its target),
FAIL (an error) or N/A (it cannot run here, or a feature it measures is not there yet). Every
check runs whatever the others did; once ``--budget-s`` is spent the rest are N/A, and the
report is rewritten after each check, so a run cut short still leaves its figures.
``--cpu-dry-run`` runs everything that can at toy sizes on the CPU (torch backend; check 1's
Triton side interpreted) to test this script without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS: list[tuple[str, str, Callable[[], str | None]]] = []  # (name, target, function)
SECTIONS: list[str] = []  # Markdown the running check adds to the report: its full tables

DEV, BACKEND, DRY = torch.device("cuda"), "triton", False
#: Tokens per step of the DeepSeek-like layers (checks 7, 8): x top-8 = 16k expert rows.
STEP_TOKENS = 2048
NO_OVERLAP = "stream_overlap not available (PagedStashManager takes no stream_overlap keyword)"


class TargetMissed(Exception):
    """The check ran and a figure missed its target; the message gives the figures."""


class Unavailable(Exception):
    """The check cannot run here (CUDA-only in a dry run, a feature not there yet)."""


def check(name: str, target: str):
    def register(fn):
        CHECKS.append((name, target, fn))
        return fn

    return register


def _cuda() -> bool:
    return DEV.type == "cuda"


def _need_cuda(what: str) -> None:
    if not _cuda():
        raise Unavailable(f"{what} needs CUDA (dry run on {DEV})")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _all_same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
    return len(xs) == len(ys) and all(_same(x, y) for x, y in zip(xs, ys))


def _section(markdown: str, title: str | None = None) -> None:
    """Add ``markdown`` to the report under the running check: a level-3 ``title``, or its own
    headings two levels down."""
    body = [("##" + line if line.startswith("#") else line) for line in markdown.splitlines()]
    head = [f"### {title}", ""] if title else []
    SECTIONS.append("\n".join([*head, *body]).rstrip() + "\n")


# ----------------------------------------------------------------------------------- models


def _cfg(**kw):
    from te_paged.config import MoEConfig

    base = {
        "hidden_size": 256,
        "moe_ffn_hidden_size": 512,
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_expert_rank_capacity_factor": 2.0,
        "params_dtype": torch.bfloat16,
        "moe_paged_stash_kernel_backend": BACKEND,
    }
    if kw.get("recompute_modules"):
        base["recompute_granularity"] = "selective"
    return MoEConfig(**{**base, **kw})


def _has_overlap() -> bool:
    from te_paged.stash import PagedStashManager

    return "stream_overlap" in inspect.signature(PagedStashManager).parameters


def _overlaps() -> list[bool | None]:
    """The stream-overlap settings to test: both when the manager has the switch (off only on
    CPU, which has no streams), else its default only (None)."""
    if not _has_overlap():
        return [None]
    return [False, True] if _cuda() else [False]


def _no_overlap() -> str:
    """Why the overlap-on variant is not measured."""
    return NO_OVERLAP if not _has_overlap() else f"stream overlap needs CUDA (dry run on {DEV})"


def _overlap_label(overlap: bool | None) -> str:
    return {None: "manager default", False: "overlap off", True: "overlap on"}[overlap]


def _manager(cfg, overlap: bool | None = None):
    """``cfg``'s manager on DEV; ``overlap`` True/False is passed as ``stream_overlap``."""
    from te_paged.stash import PagedStashManager

    kw = {} if overlap is None else {"stream_overlap": overlap}
    try:
        return PagedStashManager(
            page_size=cfg.moe_paged_stash_page_size,
            buffer_size_factor_cuda=cfg.moe_paged_stash_buffer_size_factor_cuda,
            buffer_size_factor_cpu=cfg.moe_paged_stash_buffer_size_factor_cpu,
            device=DEV,
            kernel_backend=cfg.moe_paged_stash_kernel_backend,
            **kw,
        )
    except TypeError as e:
        if "stream_overlap" in str(e):
            raise Unavailable(NO_OVERLAP) from e
        raise


ROWS, TOKENS = 2048, 512  # TEGroupedMLP's static rows; MoELayer's tokens (x top-2 x cf 2)
ROUTING = [[300, 0, 120, 90, 200, 40, 160, 110], [10, 250, 130, 70, 180, 100, 90, 170]]


class _Stack:
    """``layers`` chained ``TEGroupedMLP``s (``kind="experts"``, fed permuted rows) or
    ``MoELayer``s (``kind="layer"``, one rank), sharing one manager (None: paged stash OFF).
    The same ``seed`` gives the same weights ON and OFF."""

    def __init__(self, kind: str, cfg, layers: int = 2, seed: int = 0, overlap=None) -> None:
        from te_paged.moe import MoELayer, TEGroupedMLP

        self.kind = kind
        self.manager = _manager(cfg, overlap) if cfg.moe_paged_stash else None
        torch.manual_seed(seed)
        if kind == "experts":
            self.layers = [TEGroupedMLP(8, cfg, manager=self.manager, device=DEV)
                           for _ in range(layers)]  # fmt: skip
        else:
            self.layers = [MoELayer(cfg, None, self.manager, device=DEV, seed=seed * 100 + i)
                           for i in range(layers)]  # fmt: skip

    def parameters(self) -> list[torch.Tensor]:
        return [q for layer in self.layers for q in layer.parameters()]

    def forward(self, inputs) -> torch.Tensor:
        h = inputs[0]
        for layer in self.layers:
            h, _ = layer(h, *inputs[1:])
        return h


def _inputs(kind: str, step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(step)
    if kind == "experts":
        x = torch.randn(ROWS, 256, generator=g).to(DEV, torch.bfloat16).requires_grad_()
        p = torch.rand(ROWS, generator=g).to(DEV).requires_grad_()
        return x, torch.tensor(ROUTING[step % 2], device=DEV), p
    return (torch.randn(TOKENS, 256, generator=g).to(DEV, torch.bfloat16).requires_grad_(),)


def _grads(stack: _Stack) -> list[torch.Tensor]:
    return [q.grad for q in stack.parameters() if q.grad is not None]


def _step(stack: _Stack, step: int, inputs=None) -> list[torch.Tensor]:
    """One step (``manager.reset()``, forward, backward): the output and every gradient."""
    if stack.manager is not None:
        stack.manager.reset()
    inputs = inputs or _inputs(stack.kind, step)
    h = stack.forward(inputs)
    h.float().square().sum().backward()
    leaves = [t for t in inputs if t.requires_grad]
    out = [h.detach()] + [t.grad for t in leaves] + [g.clone() for g in _grads(stack)]
    for t in leaves:
        t.grad = None
    for layer in stack.layers:
        layer.zero_grad(set_to_none=True)
    return out


def _clean_stash(stack: _Stack, what: str) -> None:
    s = stack.manager.stats()
    if s.overflow or s.invalid or not s.stashes == s.pops > 0:
        raise AssertionError(f"{what}: stash not used cleanly: {s}")


#: The check being run (``run_check``), and the one case of it a case process runs (its label,
#: from the environment: ``_case_in_child``).
RUNNING: dict[str, object] = {"index": 0}
CASE_ENV = "TE_PAGED_GPU_CHECK_CASE"


def _run_cases(cases: dict[str, Callable[[], str]], isolate: bool = False) -> str:
    """Run every case; one failing does not stop the next. Raises with all outcomes if any
    failed (Unavailable only if every case was). ``isolate``: each case in a process of its
    own on CUDA, for cases whose failure can leave the process broken (a failed graph capture
    leaves the CUDA generator mid-capture: every later case then fails in ``normal_``)."""
    only = os.environ.get(CASE_ENV)
    if only is not None:  # this is a case process
        return cases[only]()
    done, failed, unavailable = [], [], []
    for label, fn in cases.items():
        try:
            if isolate and _cuda() and not RUNNING.get("in_process"):
                done.append(f"{label}: {_case_in_child(label)}")
            else:
                done.append(f"{label}: {fn()}")
        except Unavailable as e:
            unavailable.append(f"{label}: {e}")
        except Exception as e:
            failed.append(f"{label}: {type(e).__name__}: {e}")
            traceback.print_exc()
    if failed:
        raise AssertionError("; ".join(failed + done + unavailable))
    if unavailable and not done:
        raise Unavailable("; ".join(unavailable))
    return "; ".join(done + unavailable)


# ----------------------------------------------------------------------------------- checks


@check(
    "Triton kernels vs the torch reference, compiled, every element type",
    "every byte equal: outputs, pools, free lists, records, flags",
)
def kernels() -> str:
    """The kernel unit tests compiled, then one stash and two pops per element type at model
    sizes, both backends from the same state, compared byte for byte after every call."""
    parts, errors = [], []
    for label, fn in (("unit tests", _kernel_unit_tests), ("model sizes", _kernel_model_sizes)):
        try:
            parts.append(f"{label}: {fn()}")
        except Exception as e:
            errors.append(f"{label}: {type(e).__name__}: {e}")
            traceback.print_exc()
    if errors:
        raise AssertionError("; ".join(errors + parts))
    return "; ".join(parts)


def _kernel_unit_tests() -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "tests/unit/kernels"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-1000:])
    return last


#: (label, element type, row width at model size, tokens per row) of check 1.
_KERNEL_TYPES = [
    ("bf16", torch.bfloat16, 7168, 1),
    ("fp16", torch.float16, 4096, 1),
    ("fp32", torch.float32, 2048, 1),
    ("fp32 probs", torch.float32, 1, 1),
    ("FP8 e4m3", torch.float8_e4m3fn, 7168, 1),
    ("FP8 e5m2", torch.float8_e5m2, 7168, 1),
    ("MXFP8 scales (e8m0, 1 row per 32 tokens)", torch.float8_e8m0fnu, 7168, 32),
]


def _random_bits(rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Random bytes over the whole range of ``dtype``'s width (NaN payloads, infinities,
    subnormals and -0 included), as ``dtype``."""
    from te_paged.stash import storage_dtype

    bits = storage_dtype(dtype)
    width = torch.empty((), dtype=bits).element_size()
    raw = torch.randint(0, 256, (rows, hidden * width), dtype=torch.uint8, device=DEV)
    return raw.view(bits).view(dtype)


def _kernel_model_sizes() -> str:
    from te_paged.tools.free_lists import FreeList

    tokens, page = (16384, 64) if _cuda() else (1024, 8)
    torch.manual_seed(0)
    kinds = [*FreeList, "host tier"]
    failed = []
    for (label, dtype, hidden, per_row), kind in itertools.product(_KERNEL_TYPES, kinds):
        hidden = hidden if _cuda() else min(hidden, 24)
        try:  # every case, whatever an earlier one did
            _kernel_case(label, dtype, hidden, per_row, kind, tokens, page)
        except AssertionError as e:
            failed.append(str(e))
    if failed:
        cases = len(_KERNEL_TYPES) * len(kinds)
        raise AssertionError(f"{len(failed)} of {cases} cases differ: " + "; ".join(failed))
    return (
        f"{len(_KERNEL_TYPES) * len(kinds)} cases ({len(_KERNEL_TYPES)} element types x fresh, "
        f"1F1B, alternating free lists and a host-tier spill; {tokens} tokens, 3/4 of them "
        f"real, page {page}), every byte equal after each stash and pop"
    )


def _kernel_case(label, dtype, hidden, per_row, kind, tokens, page) -> None:
    """Stash ``tokens * 3/4 + 5`` real tokens of ``tokens`` rows' worth of random bits from
    the ``kind`` free list, pop (padding zeroed), stash and pop again (padding left), with the
    reference and with Triton from the same state; compare everything after every call."""
    from te_paged.kernels import (
        FLAGS_LEN,
        META_LEN,
        STATE_LEN,
        Flag,
        Meta,
        State,
        Tier,
        stash_copy,
        stash_pop,
    )
    from te_paged.stash import storage_dtype
    from te_paged.tools.free_lists import FreeList, prepare_free_list

    rows = tokens // per_row
    n = tokens * 3 // 4 + 5  # not a whole page: the last page is partly padding
    used = -(-n // per_row)
    need = -(-used // page)
    host = kind == "host tier"
    if host:  # one device page short: the whole tensor goes to the host tier
        prepared = prepare_free_list(FreeList.FRESH, (need - 1) * page, page)
    else:
        prepared = prepare_free_list(kind, used, page)
    case = f"{label} x{hidden}, {kind if host else kind.value}"
    bits = storage_dtype(dtype)
    host_pages = need + 1 if host else 0
    state = torch.zeros(STATE_LEN, dtype=torch.int64, device=DEV)
    state[State.HEAD], state[State.TAIL] = prepared.head, prepared.tail
    state[State.HOST_TAIL] = host_pages
    start = {
        "dev_pool": torch.zeros(prepared.num_pages * page, hidden, dtype=bits, device=DEV),
        "dev_free": torch.tensor(prepared.free_P, dtype=torch.int32, device=DEV),
        "host_pool": torch.zeros(host_pages * page, hidden, dtype=bits, pin_memory=_cuda()),
        "host_free": torch.arange(host_pages, dtype=torch.int32, device=DEV),
        "state": state,
        "flags": torch.zeros(FLAGS_LEN, dtype=torch.int64, device=DEV),
        "rec_pages": torch.full((-(-rows // page),), -7, dtype=torch.int32, device=DEV),
        "rec_meta": torch.full((META_LEN,), 5, dtype=torch.int64, device=DEV),
    }
    src = _random_bits(rows, hidden, dtype).view(bits)
    garbage = _random_bits(rows, hidden, dtype).view(bits)
    num = torch.tensor([n], device=DEV)

    def run(backend: str) -> list[dict[str, torch.Tensor]]:
        t = {k: v.clone().pin_memory() if v.is_pinned() else v.clone() for k, v in start.items()}
        pool = [t[k] for k in ("dev_pool", "dev_free", "host_pool", "host_free", "state")]
        rec = [t["flags"], t["rec_pages"], t["rec_meta"]]
        snaps = []

        def snap() -> dict[str, torch.Tensor]:
            # The kernels write the pinned host pool through unified addressing: a host-side
            # clone must wait for them (the GPU run of 2026-12-04 compared a half-written one).
            if _cuda():
                torch.cuda.synchronize()
            return {k: v.clone() for k, v in t.items()}

        for zero in (True, False):  # the second round reuses the pages the first returned
            stash_copy(backend, src, num, per_row, page, *pool, *rec)
            snaps.append(snap())
            dst = garbage.clone()
            stash_pop(backend, dst, page, *pool, *rec, zero)
            snaps.append({"dst": dst, **snap()})
        return snaps

    ref, got = run("torch"), run("triton")
    tier = int(ref[0]["rec_meta"][Meta.TIER])
    flags = ref[0]["flags"].tolist()
    if tier != (Tier.HOST if host else Tier.DEVICE) or flags[Flag.OVERFLOW] or flags[Flag.INVALID]:
        raise AssertionError(f"{case}: the reference stashed to tier {tier}, flags {flags}")
    if not _same(ref[1]["dst"][:used], src[:used]):
        raise AssertionError(f"{case}: the reference lost rows")
    calls = ["stash", "pop (padding zeroed)", "stash again", "pop (padding left)"]
    for call, a, b in zip(calls, ref, got):
        bad = [k for k in a if not _same(a[k], b[k])]
        if bad:
            raise AssertionError(f"{case}, after {call}: Triton differs in {', '.join(bad)}")


@check(
    "ON vs OFF and fused vs unfused, bitwise, CUDA bf16 and MXFP8",
    "every output and gradient bitwise equal; stashes = pops > 0, no overflow",
)
def parity() -> str:
    """TEGroupedMLP over op-fuser x MXFP8 x recompute, and MoELayer (1 rank) in bf16 and MXFP8:
    paged stash ON (each stream-overlap setting) vs OFF, and fused vs unfused, two steps."""
    cases: dict[str, Callable[[], str]] = {}
    for fuser, fp8, rc in itertools.product([False, True], [None, "mxfp8"], [[], ["moe_act"]]):
        kw = {"use_transformer_engine_op_fuser": fuser, "fp8": fp8, "recompute_modules": rc}
        cases[f"experts fuser={fuser} fp8={fp8} rc={rc}"] = functools.partial(
            _parity, "experts", kw, None, other=True
        )
    for fp8, overlap in itertools.product([None, "mxfp8"], _overlaps()):
        label = f"layer fp8={fp8}, {_overlap_label(overlap)}"
        cases[label] = functools.partial(_parity, "layer", {"fp8": fp8}, overlap)
    if _has_overlap():
        cases["experts default, overlap off"] = functools.partial(_parity, "experts", {}, False)
    detail = _run_cases(cases)
    return f"{len(cases)} configurations x 2 steps, bitwise equal ({detail})"


def _parity(kind: str, kw: dict, overlap, other: bool = False) -> str:
    on = _Stack(kind, _cfg(moe_paged_stash=True, **kw), overlap=overlap)
    off = _Stack(kind, _cfg(**kw))
    alt = None
    if other:
        flip = not kw.get("use_transformer_engine_op_fuser", False)
        alt = _Stack(kind, _cfg(**{**kw, "use_transformer_engine_op_fuser": flip}))
    for step in range(2):
        a, b = _step(on, step), _step(off, step)
        if not _all_same(a, b):
            raise AssertionError(f"ON != OFF at step {step}")
        if alt is not None and not _all_same(b, _step(alt, step)):
            raise AssertionError(f"fused != unfused at step {step}")
        _clean_stash(on, f"step {step}")
    return "ok"


@check(
    "no host sync in the captured step (set_sync_debug_mode='error')",
    "0 synchronising calls in forward + backward",
)
def sync_free() -> str:
    """The captured step (pools allocated, kernels reading counts on the device) of two chained
    TEGroupedMLPs and of two MoELayers (1 rank: router, dispatcher, experts, combine), bf16 and
    MXFP8, each stream-overlap setting, under ``torch.cuda.set_sync_debug_mode("error")``."""
    _need_cuda("set_sync_debug_mode")
    cases = {}
    for kind, fp8, overlap in itertools.product(["experts", "layer"], [None, "mxfp8"], _overlaps()):
        label = f"{kind} fp8={fp8}, {_overlap_label(overlap)}"
        cases[label] = functools.partial(_sync_free, kind, fp8, overlap)
    return _run_cases(cases)


def _sync_free(kind: str, fp8: str | None, overlap) -> str:
    stack = _Stack(kind, _cfg(moe_paged_stash=True, fp8=fp8), overlap=overlap)
    _step(stack, 0)  # the capture step reads counts on the host, by design
    stack.manager.reset()  # allocates the pools, outside the checked step
    inputs = _inputs(kind, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(stack, 1, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _clean_stash(stack, "checked step")
    s = stack.manager.stats()
    return f"{s.stashes} stashes, {s.pops} pops, no sync"


def _replay(kind: str, fp8: str | None, overlap) -> str:
    """Capture one captured ON step (forward + backward) in a CUDA graph; replay it with new
    data (and, for MoELayer, new routing) and compare with eager OFF, bitwise."""
    on = _Stack(kind, _cfg(moe_paged_stash=True, fp8=fp8), overlap=overlap)
    off = _Stack(kind, _cfg(fp8=fp8))
    static = [t.detach().clone().requires_grad_(t.requires_grad) for t in _inputs(kind, 0)]

    def load(step: int) -> None:
        with torch.no_grad():
            for s, t in zip(static, _inputs(kind, step)):
                s.copy_(t)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the capture step, then one captured step, eagerly
        for step in range(2):
            load(step)
            _step(on, step, static)
    torch.cuda.current_stream().wait_stream(side)
    on.manager.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = on.forward(static)
        h.float().square().sum().backward()
    replays = (1, 0, 1, 2)
    for step in replays:
        load(step)
        on.manager.reset()
        graph.replay()
        torch.cuda.synchronize()
        got = [h.detach()] + [t.grad for t in static if t.requires_grad] + _grads(on)
        if not _all_same(got, _step(off, step)):
            raise AssertionError(f"replay with step {step}'s data differs from eager OFF")
        s = on.manager.stats()
        if s.overflow or s.invalid:
            raise AssertionError(f"replay with step {step}'s data: {s}")
    return f"{len(replays)} replays bitwise equal to eager OFF"


@check(
    "CUDA graph capture and replay of TEGroupedMLP's captured step",
    "every replay bitwise equal to eager",
)
def graph_experts() -> str:
    """Two chained TEGroupedMLPs, bf16 and MXFP8, each stream-overlap setting."""
    _need_cuda("CUDA graphs")
    return _run_cases({
        f"fp8={fp8}, {_overlap_label(overlap)}": functools.partial(
            _replay, "experts", fp8, overlap
        )
        for fp8, overlap in itertools.product([None, "mxfp8"], _overlaps())
    }, isolate=True)  # fmt: skip


@check(
    "CUDA graph capture and replay of MoELayer's captured step (1 rank)",
    "every replay bitwise equal to eager",
)
def graph_layer() -> str:
    """Two chained MoELayers (router, dispatcher, experts, combine), bf16, each overlap
    setting; each replay routes new data."""
    _need_cuda("CUDA graphs")
    return _run_cases({
        _overlap_label(overlap): functools.partial(_replay, "layer", None, overlap)
        for overlap in _overlaps()
    }, isolate=True)  # fmt: skip


#: Check 6's targets, by the bytes a stash+pop moves: the worst ratio of medians (copy /
#: stash+pop) over every free list from 268 MB up, and below (134 MB: 2048 x 16384), where the
#: launches' fixed cost weighs most.
BANDWIDTH_TARGETS = {"from 268 MB": 0.85, "below 268 MB": 0.70}
BANDWIDTH_SPLIT_MB = 268


@check(
    "stash+pop bandwidth vs a device-to-device copy (bf16, hidden 2048-7168, 16k-64k tokens)",
    "worst copy/stash ratio of medians at hidden >= 2048, every free list: >= 0.85 from "
    "268 MB moved, >= 0.70 below (134 MB)",
)
def bandwidth() -> str:
    """``te_paged.tools.bench.stash_report``: the stash's backend moving the real rows into the
    pool and back vs two plain copies of the same bytes, from each free list; the worst ratio
    per size class over the grid (and per free list, for the reader)."""
    from te_paged.tools.bench import stash_report

    if _cuda():
        hidden, tokens, min_hidden = [2048, 4096, 7168], [16384, 32768, 65536], 2048
    else:
        hidden, tokens, min_hidden = [256, 512], [1024], 256
    report = stash_report(hidden, tokens, repeats=5 if DRY else 20, device=DEV.type,
                          backend=BACKEND, command="scripts/gpu_check.sh")  # fmt: skip
    print(report)
    _section(report)
    throughput = report.split("## Cost of zeroing")[0]  # the throughput tables: no padding rows
    rows = [line for line in throughput.splitlines() if line.startswith("| ")]
    split = BANDWIDTH_SPLIT_MB if _cuda() else 0  # a dry run's sizes are all "large"
    worst: dict[str, tuple[float, float, str]] = {}
    for row in rows:  # hidden | tokens | MB | free list | runs | ... | ratio of medians | of mins
        cells = [c.strip() for c in row.split("|")[1:-1]]
        if not cells[0].isdigit() or int(cells[0]) < min_hidden:  # headers, the summary table
            continue
        med, fast = float(cells[-2]), float(cells[-1])
        size = "from 268 MB" if float(cells[2]) >= split else "below 268 MB"
        at = f"{cells[0]}x{cells[1]} {cells[3]}"
        if size not in worst or med < worst[size][0]:
            worst[size] = (med, fast, at)
    if "from 268 MB" not in worst:
        raise AssertionError("no throughput rows from 268 MB in the report")
    parts, missed = [], False
    for size, target in BANDWIDTH_TARGETS.items():
        if size not in worst:
            continue
        med, fast, at = worst[size]
        ok = med >= target
        missed |= not ok
        parts.append(f"{size}: worst {med:.2f} (of mins {fast:.2f}) at {at}, target >= "
                     f"{target:.2f} {'met' if ok else 'MISSED'}")  # fmt: skip
    detail = (f"{BACKEND} backend, copy/stash ratio of medians, hidden >= {min_hidden}: "
              + "; ".join(parts))  # fmt: skip
    if missed and _cuda():
        raise TargetMissed(detail)
    return detail if _cuda() else f"{detail} (a dry run: toy sizes, not measured against it)"


# ------------------------------------------------------------------- DeepSeek-like layers


def _ds_sizes() -> dict[str, int]:
    """Checks 7 and 8: hidden 7168, ffn 2048, 8 local experts, top-8, bf16 (toy in a dry run)."""
    if DRY:
        return {"hidden": 256, "ffn": 512, "experts": 8, "topk": 8, "tokens": 128, "layers": 4}
    return {"hidden": 7168, "ffn": 2048, "experts": 8, "topk": 8, "tokens": STEP_TOKENS,
            "layers": 8}  # fmt: skip


DS_CAPACITY, DS_BUFFER = 2.0, 1.10


class _Residual(torch.nn.Module):
    """``h ← h + MoELayer(h)`` per layer (1 rank), loss ``mean(h²)``: the model of checks 7, 8."""

    def __init__(self, cfg, layers: int, manager) -> None:
        from te_paged.moe import MoELayer

        super().__init__()
        self.manager = manager
        self.layers = torch.nn.ModuleList(
            MoELayer(cfg, None, manager, device=DEV, layer_number=i + 1) for i in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            y, _ = layer(h)
            h = h + y
        return h.float().square().mean()


def _ds_variants() -> dict[str, bool | None]:
    """Label → stream overlap of the models compared (OFF first; None: the manager default)."""
    return {"OFF": None, **{f"ON, {_overlap_label(o)}": o for o in _overlaps()}}


def _ds_models() -> dict[str, _Residual]:
    """One model per variant, all with the OFF model's weights."""
    from te_paged.config import MoEConfig

    sizes = _ds_sizes()
    models: dict[str, _Residual] = {}
    for label, overlap in _ds_variants().items():
        paged = label != "OFF"
        cfg = MoEConfig(
            hidden_size=sizes["hidden"],
            moe_ffn_hidden_size=sizes["ffn"],
            num_moe_experts=sizes["experts"],
            moe_router_topk=sizes["topk"],
            moe_expert_rank_capacity_factor=DS_CAPACITY,
            moe_paged_stash=paged,
            moe_paged_stash_buffer_size_factor_cuda=DS_BUFFER,
            params_dtype=torch.bfloat16,
            moe_paged_stash_kernel_backend=BACKEND,
        )
        torch.manual_seed(0)
        model = _Residual(cfg, sizes["layers"], _manager(cfg, overlap) if paged else None)
        if models:
            model.load_state_dict(models["OFF"].state_dict())
        models[label] = model
    return models


def _ds_batch(step: int) -> torch.Tensor:
    sizes = _ds_sizes()
    g = torch.Generator(device="cpu").manual_seed(step)
    return torch.randn(sizes["tokens"], sizes["hidden"], generator=g).to(DEV, torch.bfloat16)


def _ds_step(model: _Residual, x: torch.Tensor) -> torch.Tensor:
    """One training step without optimizer; gradients stay allocated (not part of a peak)."""
    if model.manager is not None:
        model.manager.reset()
    model.zero_grad(set_to_none=False)
    loss = model(x)
    loss.backward()
    return loss.detach()


def _ds_describe() -> str:
    s = _ds_sizes()
    return (f"{s['layers']} residual MoELayers (1 rank), hidden {s['hidden']}, ffn {s['ffn']}, "
            f"{s['experts']} local experts, top-{s['topk']}, bf16, {s['tokens']} tokens "
            f"({s['tokens'] * s['topk']} expert rows) a step, capacity factor {DS_CAPACITY}, "
            f"pool factor {DS_BUFFER}, {BACKEND} stash kernels")  # fmt: skip


def _timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Seconds of one call: (CUDA events on the current stream, wall clock between device
    synchronisations); on CPU both are the wall clock."""
    if not _cuda():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0,) * 2
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()  # every stream: side-stream work left over counts in the wall
    return start.elapsed_time(end) / 1e3, time.perf_counter() - t0


STEP_TIME_TARGET = 1.02


@check(
    "step time ON/OFF with and without stream overlap, DeepSeek-like expert layers",
    f"ON/OFF median <= {STEP_TIME_TARGET} with stream overlap",
)
def step_time() -> str:
    """Median step time (forward + backward + the manager's reset) of each variant, the rounds
    interleaved; the capture step and warm-up steps (the pool allocation among them) are not
    timed. CUDA events on the compute stream, and the wall clock between device syncs."""
    warmup, repeats = (1, 3) if DRY else (3, 15)
    models = _ds_models()
    x = _ds_batch(0)
    fns = {label: functools.partial(_ds_step, m, x) for label, m in models.items()}
    for _ in range(1 + warmup):  # the capture step, then warm-up (the first reset allocates)
        for fn in fns.values():
            fn()
    times: dict[str, list[tuple[float, float]]] = {label: [] for label in fns}
    for _ in range(repeats):  # interleaved: drift in clocks or load hits every variant alike
        for label, fn in fns.items():
            times[label].append(_timed(fn))
    losses = {label: fn() for label, fn in fns.items()}
    for label, model in models.items():
        if model.manager is not None:
            s = model.manager.stats()
            if s.overflow or s.invalid or not s.stashes == s.pops > 0:
                raise AssertionError(f"{label}: stash not used cleanly: {s}")
    equal = all(_same(loss, losses["OFF"]) for loss in losses.values())
    med = {k: statistics.median(e for e, _ in v) for k, v in times.items()}
    fast = {k: min(e for e, _ in v) for k, v in times.items()}
    wall = {k: statistics.median(w for _, w in v) for k, v in times.items()}
    table = [
        f"{_ds_describe()}; {repeats} timed steps per variant after {warmup} warm-up steps and "
        "the capture step, interleaved.",
        "",
        "| variant | events ms median | min | wall ms median | ON/OFF (events median) "
        "| ON/OFF (min) | ON/OFF (wall) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for k in times:
        table.append(
            f"| {k} | {1e3 * med[k]:.2f} | {1e3 * fast[k]:.2f} | {1e3 * wall[k]:.2f} "
            f"| {med[k] / med['OFF']:.3f} | {fast[k] / fast['OFF']:.3f} "
            f"| {wall[k] / wall['OFF']:.3f} |"
        )
    where = ""
    try:  # figures for the reader; the check's verdict does not depend on them
        lines, where = _step_profile(fns, med)
        table += ["", *lines]
    except Exception as e:
        traceback.print_exc()
        table += ["", f"(the profile failed: {type(e).__name__}: {e})"]
    text = "\n".join(table)
    print(text)
    _section(text)
    ratios = ", ".join(f"{k} {med[k] / med['OFF']:.3f}" for k in times if k != "OFF")
    detail = (f"OFF {1e3 * med['OFF']:.2f} ms; ON/OFF median: {ratios}; losses ON/OFF "
              f"{'bitwise equal' if equal else 'DIFFER'}{where}")  # fmt: skip
    if not equal:
        raise AssertionError(detail)
    if "ON, overlap on" not in med:
        raise Unavailable(f"{_no_overlap()}: the target is not evaluated; {detail}")
    ratio = med["ON, overlap on"] / med["OFF"]
    verdict = f"overlap on {ratio:.3f}, target <= {STEP_TIME_TARGET}"
    if ratio > STEP_TIME_TARGET:
        raise TargetMissed(f"{detail}; MISSED: {verdict}")
    return f"{detail}; met: {verdict}"


def _kernel_times(fn: Callable[[], object]) -> dict[str, float]:
    """Device milliseconds per kernel name in one call of ``fn`` (torch.profiler; on CPU the
    CPU time per op, so that a dry run takes this path too)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if _cuda() else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        if _cuda():
            torch.cuda.synchronize()
    field = "self_device_time_total" if _cuda() else "self_cpu_time_total"
    out: dict[str, float] = {}
    for e in prof.key_averages():
        ms = getattr(e, field, 0.0) / 1e3
        if ms > 0 and (not _cuda() or e.device_type.name == "CUDA"):
            out[e.key] = out.get(e.key, 0.0) + ms
    return out


#: te_paged's own kernels, as the profiler names them.
STASH_KERNELS = ("_stash_kernel", "_pop_kernel")


def _step_profile(
    fns: dict[str, Callable[[], object]], med: dict[str, float]
) -> tuple[list[str], str]:
    """Where ON's extra time goes: one profiled step per variant, the kernels whose device time
    differs most from OFF's, and busy time (the sum over kernels) against the step's time
    (busy < step: the device waited on the host; busy > step: streams overlapped). Returns the
    tables and a one-line attribution of ON − OFF for the check's figures: te_paged's stash
    and pop kernels, the other kernels' change, and the rest (the device idle, or streams
    overlapping)."""
    per = {label: _kernel_times(fn) for label, fn in fns.items()}
    lines = ["Device time per kernel, one profiled step of each variant (torch.profiler):", "",
             "| variant | kernels busy ms | step ms (events median) | busy / step |",
             "| --- | ---: | ---: | ---: |"]  # fmt: skip
    for label, kernels in per.items():
        busy = sum(kernels.values())
        lines.append(f"| {label} | {busy:.2f} | {1e3 * med[label]:.2f} "
                     f"| {busy / (1e3 * med[label]):.3f} |")  # fmt: skip
    names = set().union(*per.values())
    off = per["OFF"]
    delta = {n: max(abs(k.get(n, 0.0) - off.get(n, 0.0)) for k in per.values()) for n in names}
    top = sorted(names, key=lambda n: -delta[n])[:12]
    lines += ["", "The 12 kernels whose time differs most from OFF's (ms in the step):", "",
              "| kernel | " + " | ".join(per) + " |", "| --- |" + " ---: |" * len(per)]  # fmt: skip
    for n in top:
        short = n if len(n) <= 70 else n[:67] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | "
                     + " | ".join(f"{per[k].get(n, 0.0):.3f}" for k in per) + " |")  # fmt: skip
    lines += ["", "ON − OFF, attributed (ms in the step; the rest is the device idle, waiting "
              "on the host, or negative where side streams overlapped):", "",
              "| variant | step − OFF | te_paged stash+pop kernels | other kernels − OFF's "
              "| rest |", "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    off_busy = sum(off.values())
    parts = []
    for label, kernels in per.items():
        if label == "OFF":
            continue
        extra = 1e3 * (med[label] - med["OFF"])
        ours = sum(ms for n, ms in kernels.items() if n.startswith(STASH_KERNELS))
        others = sum(kernels.values()) - ours - off_busy
        rest = extra - ours - others
        lines.append(f"| {label} | {extra:+.2f} | {ours:.2f} | {others:+.2f} | {rest:+.2f} |")
        parts.append(f"{label}: {extra:+.2f} ms = stash+pop {ours:.2f} + other kernels "
                     f"{others:+.2f} + rest {rest:+.2f}")  # fmt: skip
    return lines, ("; " + "; ".join(parts)) if parts else ""


MEMORY_TARGET = 0.95


def _peak(fn: Callable[[], object]) -> int:
    """Peak bytes ``fn`` allocates above what was allocated before it: the CUDA caching
    allocator's ``max_memory_allocated`` after ``reset_peak_memory_stats`` (on CPU, torch's
    MemTracker through ``te_paged.runtime.memory``)."""
    if not _cuda():
        from te_paged.runtime.memory import measure_peak

        return measure_peak(fn, DEV)[1].peak_bytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@check(
    "peak allocated memory ON vs OFF (CUDA allocator) vs the capacity model",
    f"saving >= {MEMORY_TARGET} of the reload-adjusted model (cf - bf - R cf/L) x S",
)
def memory() -> str:
    """Peak memory of one step after the capture step, per variant; ON adds its pool (allocated
    at the step boundary, before the measurement). S: the balanced-case bytes of the paged
    tensors; the model less the reloads live at the peak (R layers: 1, or 1 + the look-ahead
    with stream overlap), as ``te-paged ab`` reports it."""
    from te_paged.runtime.memory import capacity_model_saving, reload_adjusted_saving
    from te_paged.tools.ab import pool_and_s_bytes

    layers = _ds_sizes()["layers"]
    models = _ds_models()
    x0, x1 = _ds_batch(0), _ds_batch(1)
    figures: dict[str, tuple[int, int, int]] = {}  # label -> (peak incl. pool, pool, S)
    reloads: dict[str, int] = {}  # label -> R
    for label, model in models.items():
        _ds_step(model, x0)  # the capture step; allocates the gradients
        managers = [] if model.manager is None else [model.manager]
        for m in managers:
            m.reset()  # allocates the pools: outside the measurement, added below
        peak = _peak(functools.partial(_ds_step, model, x1))
        for m in managers:
            s = m.stats()
            if s.overflow or s.invalid or not s.stashes == s.pops > 0:
                raise AssertionError(f"{label}: stash not used cleanly: {s}")
        pool, s_bytes = pool_and_s_bytes(managers)
        figures[label] = (peak + pool, pool, s_bytes)
        reloads[label] = max((m.reload_layers for m in managers), default=1)
    mib = 2**20
    off = figures["OFF"][0]
    table = [
        f"{_ds_describe()}; peak of the step after the capture step, "
        f"{'CUDA caching allocator max_memory_allocated' if _cuda() else 'torch MemTracker'}.",
        "",
        "| variant | peak (incl. pool) MiB | pool MiB | S MiB | saving MiB | (cf − bf) × S MiB "
        "| saving / that | (cf − bf − R·cf/L) × S MiB | saving / that |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| OFF | {off / mib:.1f} | – | – | – | – | – | – | – |",
    ]
    ratios = {}
    for label, (peak, pool, s_bytes) in figures.items():
        if label == "OFF":
            continue
        saving = off - peak
        predicted = capacity_model_saving(DS_CAPACITY, DS_BUFFER, s_bytes)
        adjusted = reload_adjusted_saving(DS_CAPACITY, DS_BUFFER, s_bytes, layers, reloads[label])
        ratios[label] = saving / adjusted if adjusted > 0 else float("nan")
        table.append(
            f"| {label} | {peak / mib:.1f} | {pool / mib:.1f} | {s_bytes / mib:.1f} "
            f"| {saving / mib:.1f} | {predicted / mib:.1f} | {saving / predicted:.3f} "
            f"| {adjusted / mib:.1f} (L {layers}, R {reloads[label]}) | {ratios[label]:.3f} |"
        )
    text = "\n".join(table)
    print(text)
    _section(text)
    target_label = list(figures)[-1]  # overlap on, else the manager's default
    parts = [f"{k}: saving {(off - figures[k][0]) / mib:.1f} MiB = {r:.3f} of the model"
             for k, r in ratios.items()]  # fmt: skip
    detail = f"OFF peak {off / mib:.1f} MiB; " + "; ".join(parts)
    ratio = ratios[target_label]
    verdict = f"{target_label} {ratio:.3f}, target >= {MEMORY_TARGET}"
    if not ratio >= MEMORY_TARGET:
        raise TargetMissed(f"{detail}; MISSED: {verdict}")
    return f"{detail}; met: {verdict}"


@check(
    "te-paged ab --device cuda, one rank (default, and op-fuser + recompute)",
    f"ON/OFF bitwise (exit status 0); saving >= {MEMORY_TARGET} of the reload-adjusted model",
)
def ab() -> str:
    """The CLI end to end on one rank; a path that pins what it stashed shows as a negative
    saving (the CPU suite caught two such leaks)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"}
    tokens = "4096" if _cuda() else "256"
    details, missed = [], False
    for extra in ([], ["--op-fuser", "--recompute"]):
        label = " ".join(extra) or "default"
        with tempfile.TemporaryDirectory() as tmp:
            js = os.path.join(tmp, "ab.json")
            cmd = [sys.executable, "-m", "te_paged", "ab", "--device", DEV.type, "--nproc", "1"]
            cmd += ["--tokens", tokens, "--json", js, *extra]
            out = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
            )
            print(out.stdout)
            shown = " ".join(["te-paged", *cmd[3:]]).replace(js, "ab.json")
            _section(f"`{shown}`\n\n{out.stdout}", f"te-paged ab, {label}")
            if out.returncode != 0:
                raise RuntimeError(f"{label}: " + out.stdout[-1500:] + out.stderr[-1500:])
            with open(js) as f:
                m = json.load(f)["memory"]
        ratio = m["measured_over_reload_adjusted"]
        ok = ratio is not None and ratio >= MEMORY_TARGET
        missed |= not ok
        share = "n/a" if ratio is None else f"{100 * ratio:.1f} %"
        details.append(
            f"{label}: bitwise equal, saving {m['saving_bytes'] / 2**20:.2f} MiB = {share} of "
            f"(cf - bf - cf/L) x S ({'met' if ok else 'MISSED'})"
        )
    if missed:
        raise TargetMissed("; ".join(details))
    return "; ".join(details)


MEGATRON_TARGET = 1.0


@check(
    "Megatron-core 0.19.2's paged-stash kernels vs te_paged's Triton kernels (bf16, hidden 7168)",
    f"te_paged / Megatron stash+pop time (medians) <= {MEGATRON_TARGET} at every size and free "
    "list; both take the same pages",
)
def megatron_kernels() -> str:
    """Megatron's ``offload_to_stash`` + ``reload_from_stash`` (its copy and pop kernels with
    the launches around them, as Megatron runs them) vs te_paged's ``stash_copy`` +
    ``stash_pop`` (Triton, through the op the manager calls), the same rows from the same free
    list, page size 64, padding left as Megatron leaves it; rounds interleaved.
    tests/unit/integrations/test_megatron_stash_kernels.py checks the bytes on CPU."""
    try:
        from megatron.core.transformer.moe import paged_stash as mc
    except ImportError as e:
        print(f"[gpu_check] megatron-core 0.19.2 is not importable: {e}", file=sys.stderr)
        raise Unavailable(f"megatron-core 0.19.2 is not importable ({e})") from e
    from te_paged.tools.free_lists import FreeList

    hidden, sizes, page = (7168, [4096, 16384], 64) if _cuda() else (24, [64], 8)
    warmup, repeats = (1, 3) if DRY else (3, 20)
    table = ["| tokens | free list | runs | Megatron ms | te_paged ms | te_paged / Megatron |",
             "| ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    ratios = []
    for tokens, kind in itertools.product(sizes, FreeList):
        fns, runs = _megatron_case(mc, tokens, kind, hidden, page)
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):  # interleaved: drift in clocks or load hits both alike
            for k, fn in fns.items():
                times[k].append(_timed(fn)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios.append((med["te"] / med["mc"], f"{tokens} {kind.value}"))
        table.append(f"| {tokens} | {kind.value} | {runs} | {1e3 * med['mc']:.3f} "
                     f"| {1e3 * med['te']:.3f} | {ratios[-1][0]:.2f} |")  # fmt: skip
    clock = "CUDA events" if _cuda() else "both interpreted on the CPU: not a measurement"
    text = "\n".join([f"bf16, hidden {hidden}, page {page}, 3/4 of the tokens real ({clock}); "
                      f"medians of {repeats} interleaved rounds after {warmup} warm-up.", "",
                      *table])  # fmt: skip
    print(text)
    _section(text)
    detail = "te_paged / Megatron stash+pop time: " + ", ".join(f"{w} {r:.2f}" for r, w in ratios)
    worst = max(ratios)
    verdict = f"worst {worst[0]:.2f} at {worst[1]}, target <= {MEGATRON_TARGET}"
    if _cuda() and worst[0] > MEGATRON_TARGET:
        raise TargetMissed(f"{detail}; MISSED: {verdict}")
    return f"{detail}; {'met: ' + verdict if _cuda() else 'not a measurement on CPU'}"


def _megatron_case(mc, tokens: int, kind, hidden: int, page: int):
    """Both stash+pops of one case, from the same ``kind`` free list, run once and checked
    (same pages, rows back); ``({"mc": fn, "te": fn}, runs of the pages)``. A stash+pop leaves
    the free list as it found it, so every round takes the same pages."""
    from te_paged.kernels import FLAGS_LEN, META_LEN, State, stash_copy, stash_pop
    from te_paged.stash import PagedStashBuffer, StashKey
    from te_paged.tools.free_lists import prepare_free_list

    n = tokens * 3 // 4 + 5  # a partial last page
    prep = prepare_free_list(kind, n, page)
    src = torch.randn(tokens, hidden, device=DEV).bfloat16()
    dst = {k: torch.empty_like(src) for k in ("mc", "te")}
    num = torch.tensor([n], device=DEV)
    flags = [torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(2)]
    mbuf = mc.PagedStashBuffer(prep.num_pages * page, hidden, page, DEV, *flags, src.dtype)
    mbuf.free_list_cuda.copy_(torch.tensor(prep.free_P))
    mbuf.free_list_head[0], mbuf.free_list_tail[0] = prep.head, prep.tail
    paged = mc.PagedTensor(src, num_tokens_tensor=num, max_num_tokens=tokens,
                           hidden_size=hidden, page_size=page)  # fmt: skip
    tbuf = PagedStashBuffer(StashKey(src.dtype, hidden), prep.num_pages, page, DEV)
    tbuf.free_P.copy_(torch.tensor(prep.free_P))
    tbuf.state[State.HEAD], tbuf.state[State.TAIL] = prep.head, prep.tail
    tflags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=DEV)
    rec = (torch.empty(-(-tokens // page), dtype=torch.int32, device=DEV),
           torch.empty(META_LEN, dtype=torch.int64, device=DEV))  # fmt: skip

    def megatron() -> None:
        paged._tensor = src  # offload_to_stash drops it; reload fills what is set here
        paged.offload_to_stash(mbuf)
        paged._tensor = dst["mc"]
        paged.reload_from_stash(mbuf)

    def te() -> None:
        stash_copy("triton", src.view(torch.int16), num, 1, page, *tbuf.kernel_args(), tflags,
                   *rec)  # fmt: skip
        stash_pop("triton", dst["te"].view(torch.int16), page, *tbuf.kernel_args(), tflags,
                  *rec, False)  # fmt: skip

    fns = {"mc": megatron, "te": te}
    for fn in fns.values():  # compiles
        fn()
    need = -(-n // page)
    pages = {"mc": paged.page_record[:need].tolist(), "te": rec[0][:need].tolist()}
    if pages["mc"] != pages["te"] or tuple(pages["te"]) != prep.pages:
        raise AssertionError(f"{tokens} {kind.value}: pages differ: {pages}")
    if not all(_same(d[:n], src[:n]) for d in dst.values()):
        raise AssertionError(f"{tokens} {kind.value}: popped rows differ from the stashed")
    return fns, prep.runs


@check(
    "te_paged's experts behind Megatron's HybridEP dispatcher (real deep_ep, one rank)",
    "te_paged keeps the dispatcher; bitwise equal to te_paged's own dispatcher; an overrun "
    "budget sets the flag the runner reads",
)
def hybrid_ep() -> str:
    """Where DeepEP's HybridEP imports (``deep_ep.HybridEPBuffer``): megatron-core 0.19.2's
    ``MoELayer`` from te_paged's spec with ``moe_flex_dispatcher_backend="hybridep"`` keeps
    Megatron's flex dispatcher (``FlexTokenDispatcher``); one step's output and input gradient
    equal those of te_paged's own dispatcher with the same weights, and a budget below the
    routing sets the over-budget counter. On CPU the same runs against a stand-in
    (functional_tests/megatron/test_megatron_flex.py, 4 ranks)."""
    try:
        from deep_ep import HybridEPBuffer  # noqa: F401
        from megatron.core.transformer.moe import fused_a2a
    except ImportError as e:
        raise Unavailable(f"deep_ep's HybridEP or megatron-core is not importable ({e})") from e
    if not fused_a2a.HAVE_HYBRIDEP:
        raise Unavailable("megatron-core did not find HybridEP (fused_a2a.HAVE_HYBRIDEP)")
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    from te_paged.integrations import megatron as tpm

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tempfile.mktemp()}", rank=0,
                                world_size=1)  # fmt: skip
    parallel_state.initialize_model_parallel(expert_model_parallel_size=1)
    try:

        def build(factor: float, backend: str):
            cfg = TransformerConfig(
                num_layers=1, hidden_size=1024, num_attention_heads=8, num_moe_experts=8,
                moe_router_topk=2, moe_ffn_hidden_size=2048, ffn_hidden_size=2048,
                gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True,
                add_bias_linear=False, moe_grouped_gemm=True, moe_token_dispatcher_type="flex",
                moe_flex_dispatcher_backend="hybridep", moe_expert_rank_capacity_factor=factor,
                moe_router_dtype="fp32", use_transformer_engine_op_fuser=True,
                moe_router_load_balancing_type="none", params_dtype=torch.bfloat16, bf16=True,
            )  # fmt: skip
            if backend != "hybridep":
                cfg = copy.copy(cfg)
                cfg.moe_flex_dispatcher_backend = backend  # te_paged's own dispatcher
            torch.manual_seed(0)
            return tpm.get_te_paged_moe_spec(cfg)(config=cfg).to(DEV)

        def step(layer):
            g = torch.Generator(device=DEV).manual_seed(1)
            x = torch.randn(512, 2, 1024, device=DEV, generator=g, dtype=torch.bfloat16)
            x.requires_grad_()
            out, _ = layer(x)
            out.float().sum().backward()
            return out.detach(), x.grad

        flex, own = build(2.0, "hybridep"), build(2.0, "ncclep")
        own.load_state_dict(flex.state_dict())
        kind = type(flex.token_dispatcher).__name__
        if kind != "FlexTokenDispatcher":
            raise AssertionError(f"te_paged's layer built {kind}, not FlexTokenDispatcher")
        (out_a, grad_a), (out_b, grad_b) = step(flex), step(own)
        equal = _same(out_a, out_b) and _same(grad_a, grad_b)
        tight = build(0.3, "hybridep")
        step(tight)
        flagged = int(tight.token_dispatcher.budget.over_budget)
        detail = f"{kind}; bitwise vs own dispatcher: {equal}; over-budget flag at 0.3: {flagged}"
        if not equal or not flagged:
            raise TargetMissed(detail)
        return detail
    finally:
        parallel_state.destroy_model_parallel()


@check(
    "Transformer Engine 2.19's GroupedLinear cases on CUDA bf16 (the CPU ports' hardware half)",
    "host m_splits refused with a CUDA input; every port bitwise, or within TE's tolerance "
    "(rtol 1e-2, atol 5e-3) where CUDA sums the bias gradient as a GEMM",
)
def te_ports() -> str:
    """The CUDA side of the ports in tests/unit/grouped (docs/dev/te-2.20-grouped-linear-
    survey.md, step 7): TGL:1701's CPU-tensor m_splits with a CUDA input, and the equivalences
    of TGL:1730 (single vs discrete weight), TGL:2138 (parameter layouts vs the host path),
    TGL:2251 (save_original_input) and TGM:676/746 (prequantized MXFP8 input and gradient)."""
    from te_paged.grouped import GroupedLinear, GroupedTensor, dequantize, quantize

    bf16, E, F_ = torch.bfloat16, 3, 256
    splits = [64, 0, 192]  # multiples of 32 (MXFP8) with an empty group; 256 rows of 320
    rows = 320

    def layer(**kw):
        torch.manual_seed(0)
        return GroupedLinear(E, F_, F_, params_dtype=bf16, device=DEV, **kw)

    def data(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        return torch.rand(rows, F_, device=DEV, generator=g, dtype=bf16) - 0.5

    def run(mod, x, m_splits, dy):
        mod.zero_grad(set_to_none=True)
        x = x.detach().clone().requires_grad_()
        if m_splits is None:  # the wire: x with its rowwise MXFP8 copy
            wire = quantize(x.detach(), "mxfp8", rowwise=True)
            y = mod(GroupedTensor.from_splits(x, torch.tensor(splits, device=DEV), fp8=wire))
        else:
            y = mod(x, m_splits)
        y.backward(dy)
        grads = []  # per expert, weights then biases, whatever the layout
        for params, grouped_dim in ((mod.weight_params(), 3), (mod.bias_params(), 2)):
            for p in params:
                grads += list(p.grad.unbind(0)) if p.grad.dim() == grouped_dim else [p.grad]
        return [y.detach(), x.grad, *grads]

    def compare(a, b, tolerant=False):
        if _all_same(a, b):
            return "bitwise"
        for u, v in zip(a, b):
            torch.testing.assert_close(u.float(), v.float(), rtol=1e-2, atol=5e-3)
        if not tolerant:
            raise TargetMissed("not bitwise")
        return "within TE's tolerance"

    dev_splits = torch.tensor(splits, device=DEV)
    x, dy = data(1), data(2)

    def host_splits() -> str:
        _need_cuda("a CPU m_splits tensor with a CUDA input")
        mod = layer(single_grouped_weight=True, use_grouped_tensor=True)
        for host in (splits, torch.tensor(splits)):
            try:
                mod(x, host)
            except ValueError as e:
                if "requires" not in str(e) or "CUDA" not in str(e):
                    raise AssertionError(f"wrong message: {e}") from e
            else:
                raise AssertionError(f"host m_splits {type(host).__name__} were accepted")
        return "ValueError for a list and a CPU tensor"

    def single_vs_discrete() -> str:
        out = []
        for recipe in (None, "tensorwise", "mxfp8", "nvfp4"):
            a, b = layer(fp8_recipe=recipe), layer(fp8_recipe=recipe, single_grouped_weight=True)
            b.load_state_dict(a.state_dict())
            out.append(f"{recipe}: {compare(run(a, x, dev_splits, dy), run(b, x, dev_splits, dy))}")
        return ", ".join(out)

    def layouts() -> str:
        out = []
        for single_w, single_b in itertools.product((False, True), repeat=2):
            for recipe in (None, "mxfp8"):
                kw = {"bias": True, "fp8_recipe": recipe}
                host = layer(**kw, use_grouped_tensor=False)
                dev = layer(**kw, single_grouped_weight=single_w, single_grouped_bias=single_b)
                dev.load_state_dict(host.state_dict())
                got = compare(run(host, x, splits, dy), run(dev, x, dev_splits, dy), True)
                out.append(f"w{int(single_w)}b{int(single_b)} {recipe}: {got}")
        return ", ".join(out)

    def save_original() -> str:
        out = []
        for recipe in (None, "tensorwise", "mxfp8", "nvfp4"):
            a = layer(fp8_recipe=recipe, single_grouped_weight=True, bias=True)
            b = layer(fp8_recipe=recipe, single_grouped_weight=True, bias=True,
                      save_original_input=True)  # fmt: skip
            b.load_state_dict(a.state_dict())
            out.append(f"{recipe}: {compare(run(a, x, dev_splits, dy), run(b, x, dev_splits, dy))}")
        return ", ".join(out)

    def prequantized() -> str:
        mod = layer(fp8_recipe="mxfp8", bias=True)
        x_wire = dequantize(quantize(x, "mxfp8", rowwise=True))
        dy_wire = dequantize(quantize(dy, "mxfp8", rowwise=True))
        ref = run(mod, x_wire, dev_splits, dy_wire)
        got = run(mod, x_wire, None, dy_wire)  # the GroupedTensor with the wire's fp8 copy
        return f"input and gradient: {compare(ref, got)}"

    cases = {"TGL:1701 CPU-tensor m_splits": host_splits, "TGL:1730": single_vs_discrete,
             "TGL:2138": layouts, "TGL:2251": save_original,
             "TGM:676/746": prequantized}  # fmt: skip
    return _run_cases(cases)


COMPILED_BACKENDS = ("inductor", "reduce-overhead")


def _compiled_model(paged: bool, mode: str | None):
    """``te-paged ab``'s default model (one rank) with every MoE block compiled, fullgraph
    (``mode``: Inductor's mode, ``None`` eager), its runner, and its batches."""
    from te_paged.runtime.runner import PagedStashRunner
    from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

    cfg = ModelConfig(tokens=4096 if _cuda() else 256, kernel_backend=BACKEND)
    model = ToyMoEModel(cfg, paged=paged, group=None, device=DEV)
    if mode is not None:
        for layer in model.layers:
            layer.compile(backend="inductor", mode=None if mode == "inductor" else mode,
                          fullgraph=True)  # fmt: skip
    runner = PagedStashRunner(model, model.manager, measure_fallback_memory=False)
    batches = [make_batch(cfg, step, 0, DEV) for step in range(2)]

    def step(i: int) -> list[torch.Tensor]:
        x, target = batches[i % 2]
        model.zero_grad(set_to_none=False)

        def fn() -> torch.Tensor:
            loss = model(x, target)
            loss.backward()
            return loss.detach()

        loss, record = runner.step(fn)
        if paged and record.attempt != 1:
            raise AssertionError(f"step {i} reran: {record}")
        return [loss, *(p.grad.clone() for p in model.parameters())]

    return model, step


@check(
    "the default ab model compiled (Inductor; reduce-overhead: CUDA graphs), one rank",
    "compiled ON vs OFF bitwise, every gradient, Inductor and reduce-overhead; te_paged's "
    "stash and pop kernels in the compiled step's profile; step time ON/OFF compiled beside "
    "eager (figures)",
)
def compiled() -> str:
    """Three modes (eager, Inductor, Inductor's ``reduce-overhead``), each ON and OFF: the
    capture step and one paged step bitwise; then, interleaved, step times after warm-up."""
    torch._dynamo.reset()
    warmup, repeats = (1, 2) if DRY else (3, 10)
    runs, steps, equal = {}, {}, {}
    for mode in (None, *COMPILED_BACKENDS):
        label = mode or "eager"
        for paged in (False, True):
            model, step = _compiled_model(paged, mode)
            runs[(label, paged)] = [step(i) for i in range(2 + warmup)]
            steps[(label, paged)] = (model, step)
        equal[label] = all(_all_same(a, b) for a, b in zip(runs[(label, True)],
                                                            runs[(label, False)]))  # fmt: skip
    times: dict[tuple[str, bool], list[float]] = {k: [] for k in steps}
    for i in range(repeats):
        for key, (_, step) in steps.items():
            times[key].append(_timed(functools.partial(step, i))[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    model, step = steps[("inductor", True)]
    kernels = _kernel_times(functools.partial(step, 0))
    ours = {n: ms for n, ms in kernels.items() if n.startswith(STASH_KERNELS) or "te_paged" in n}
    stats = model.manager.stats()
    table = [
        f"`te-paged ab`'s default model, one rank, {4096 if _cuda() else 256} tokens, every MoE "
        f"block compiled with fullgraph=True; {repeats} timed steps each after the capture step "
        f"and {warmup} warm-up steps, interleaved.",
        "",
        "| mode | ON/OFF bitwise | OFF ms (median) | ON ms (median) | ON/OFF |",
        "| --- | :---: | ---: | ---: | ---: |",
    ]
    for label in equal:
        off, on = med[(label, False)], med[(label, True)]
        table.append(f"| {label} | {'yes' if equal[label] else 'NO'} | {1e3 * off:.2f} "
                     f"| {1e3 * on:.2f} | {on / off:.3f} |")  # fmt: skip
    table += ["", "te_paged's kernels in one profiled compiled step (Inductor, ON): "
              + (", ".join(f"`{n}` {ms:.3f} ms" for n, ms in sorted(ours.items())) or "none"),
              f"; the step's stashes/pops {stats.stashes}/{stats.pops}."]  # fmt: skip
    text = "\n".join(table)
    print(text)
    _section(text)
    ratios = ", ".join(f"{k} {med[(k, True)] / med[(k, False)]:.3f}" for k in equal)
    same = ", ".join(f"{k} {v}" for k, v in equal.items())
    detail = (f"ON/OFF bitwise: {same}; step time ON/OFF: {ratios}; te_paged kernels in the "
              f"compiled profile: {len(ours)}")  # fmt: skip
    if not all(equal.values()) or not stats.stashes == stats.pops > 0:
        raise AssertionError(detail)
    if _cuda() and not any(n.startswith(STASH_KERNELS) for n in ours):
        raise TargetMissed(f"{detail}; te_paged's stash kernels are not in the profile")
    return detail


# ----------------------------------------------------------------------------------- runner


def run_check(index: int) -> dict:
    """Run check ``index`` (1-based) here; its result as a dict."""
    name, _, fn = CHECKS[index - 1]
    RUNNING["index"] = index
    SECTIONS.clear()
    t0 = time.perf_counter()
    try:
        status, detail = "PASS", fn() or ""
    except TargetMissed as e:
        status, detail = "MISS", str(e)
    except Unavailable as e:
        status, detail = "N/A", str(e)
    except Exception as e:  # report and go on: one failure must not hide the others
        traceback.print_exc()
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f" (at {os.path.relpath(frame.filename, ROOT)}:{frame.lineno})"
        status = "FAIL"
        detail = f"{type(e).__name__}: {e}{'' if isinstance(e, AssertionError) else where}"
    seconds = time.perf_counter() - t0
    return {"index": index, "name": name, "status": status, "detail": detail,
            "seconds": seconds, "sections": list(SECTIONS)}  # fmt: skip


def _case_in_child(label: str) -> str:
    """Case ``label`` of the running check in a fresh process: its figures, or its outcome
    raised here as in the case itself (its tables join this check's)."""
    index = int(RUNNING["index"])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(index), "--result", path,
               "--step-tokens", str(STEP_TOKENS), *(["--cpu-dry-run"] if DRY else [])]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, CASE_ENV: label}, timeout=240)
        if not os.path.exists(path):
            raise RuntimeError(f"its process exited with status {proc.returncode} (a crash)")
        with open(path) as f:
            result = json.load(f)
    SECTIONS.extend(result["sections"])
    kind = {"PASS": None, "MISS": TargetMissed, "N/A": Unavailable}.get(result["status"], "FAIL")
    if kind == "FAIL":
        raise RuntimeError(result["detail"])
    if kind is not None:
        raise kind(result["detail"])
    return result["detail"]


def _in_child(index: int, timeout: float, args: argparse.Namespace) -> dict:
    """Run check ``index`` in a fresh process (a CUDA error there cannot reach the next)."""
    name = CHECKS[index - 1][0]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(index), "--result", path,
               "--step-tokens", str(args.step_tokens)]  # fmt: skip
        if args.cpu_dry_run:
            cmd.append("--cpu-dry-run")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"index": index, "name": name, "status": "FAIL", "sections": [],
                    "seconds": time.perf_counter() - t0,
                    "detail": f"killed after {timeout:.0f} s: the time budget ran out"}  # fmt: skip
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
        return {"index": index, "name": name, "status": "FAIL", "sections": [],
                "seconds": time.perf_counter() - t0,
                "detail": f"its process exited with status {proc.returncode} before reporting "
                          "(a crash: see the log)"}  # fmt: skip


def _run(cmd: list[str]) -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return out.stdout.strip()
    return ""


@functools.cache
def machine() -> list[str]:
    """The machine, as report lines."""
    lines = []
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(
            f"- GPU: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, "
            f"compute capability {p.major}.{p.minor} ({torch.cuda.device_count()} visible)"
        )
    else:
        lines.append("- GPU: none (CPU dry run)")
    smi = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    driver = smi.splitlines()[0] if smi else "n/a (no nvidia-smi)"
    lines.append(f"- driver {driver}, CUDA runtime {torch.version.cuda or 'n/a'} (torch's)")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    from te_paged import __version__

    lines.append(
        f"- torch {torch.__version__}, triton {triton_version}, te_paged {__version__}, "
        f"Python {sys.version.split()[0]}"
    )
    lines.append(f"- host: {platform.platform()}, {os.cpu_count()} CPUs")
    commit = _run(["git", "rev-parse", "HEAD"])
    dirty = " (with uncommitted changes)" if _run(["git", "status", "--porcelain"]) else ""
    lines.append(f"- commit: {commit or 'n/a'}{dirty}")
    return lines


def report(results: list[dict], args: argparse.Namespace, seconds: float) -> str:
    head = [
        f"# GPU check ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{args.command}`  ",
        f"Wall time: {seconds:.0f} s (budget {args.budget_s:.0f} s). Results: PASS target met, "
        "MISS ran but a figure missed its target, FAIL error, N/A not run here (says why).",
        "",
        *machine(),
        "",
        "| # | check | target | result | figures | s |",
        "| ---: | --- | --- | --- | --- | ---: |",
    ]
    for r in results:
        target = CHECKS[r["index"] - 1][1]
        detail = " ".join(r["detail"].replace("|", "/").split())
        head.append(f"| {r['index']} | {r['name']} | {target} | {r['status']} | {detail} "
                    f"| {r['seconds']:.0f} |")  # fmt: skip
    body = []
    for r in results:
        if r["sections"]:
            body += ["", f"## {r['index']}. {r['name']}", "", *r["sections"]]
    return "\n".join(head + body) + "\n"


def _configure(args: argparse.Namespace) -> None:
    global DEV, BACKEND, DRY, STEP_TOKENS
    STEP_TOKENS = args.step_tokens
    if args.cpu_dry_run:
        DEV, BACKEND, DRY = torch.device("cpu"), "torch", True
        # Check 1 compares the reference with the Triton kernels; on CPU only interpreted.
        # Read when te_paged's Triton kernels are first imported, i.e. after this.
        os.environ["TRITON_INTERPRET"] = "1"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the report here (rewritten after each check)")
    p.add_argument("--only", type=int, nargs="+", help="run only these check numbers")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="checks not started by then are N/A (default 450)")  # fmt: skip
    p.add_argument("--step-tokens", type=int, default=STEP_TOKENS,
                   help=f"tokens per step of checks 7 and 8 (default {STEP_TOKENS})")  # fmt: skip
    p.add_argument("--command", help="the command line the report names")
    p.add_argument("--in-process", action="store_true", help="run every check in this process")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run on CPU at toy sizes with the torch backend (to test this script without a GPU)",
    )
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    _configure(args)
    if args.child:
        result = run_check(args.child)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0
    args.command = args.command or " ".join(["python", *sys.argv])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    start = time.monotonic()
    results = []
    for index, (name, _, _) in enumerate(CHECKS, start=1):
        if args.only and index not in args.only:
            continue
        left = args.budget_s - (time.monotonic() - start)
        print(f"[gpu_check] {index}. {name} ...", file=sys.stderr, flush=True)
        if left < 15:
            result = {"index": index, "name": name, "status": "N/A", "seconds": 0.0,
                      "sections": [], "detail": f"not run: the {args.budget_s:.0f} s budget "
                                                "was spent"}  # fmt: skip
        elif args.in_process:
            RUNNING["in_process"] = True
            result = run_check(index)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            result = _in_child(index, left, args)
        results.append(result)
        print(f"[gpu_check] {index}. {name}: {result['status']} {result['detail']} "
              f"({result['seconds']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        if args.out:
            text = report(results, args, time.monotonic() - start)
            with contextlib.suppress(OSError), open(args.out, "w") as f:
                f.write(text)
    text = report(results, args, time.monotonic() - start)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"[gpu_check] report written to {args.out}", file=sys.stderr)
    ok = {"PASS", "N/A"} if args.cpu_dry_run else {"PASS"}
    return 0 if all(r["status"] in ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
