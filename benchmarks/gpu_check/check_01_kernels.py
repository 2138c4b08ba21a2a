"""Check 1: te_paged's Triton kernels against the torch reference, compiled (interpreted in a dry
run), every element type."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import traceback

import torch

from .common import ROOT, RUN, random_bits, same

NAME = "Triton kernels vs the torch reference, compiled, every element type"
TARGET = "every byte equal: outputs, pools, free lists, records, flags"

#: (label, element type, row width at model size, tokens per row).
TYPES = [
    ("bf16", torch.bfloat16, 7168, 1),
    ("fp16", torch.float16, 4096, 1),
    ("fp32", torch.float32, 2048, 1),
    ("fp32 probs", torch.float32, 1, 1),
    ("FP8 e4m3", torch.float8_e4m3fn, 7168, 1),
    ("FP8 e5m2", torch.float8_e5m2, 7168, 1),
    ("MXFP8 scales (e8m0, 1 row per 32 tokens)", torch.float8_e8m0fnu, 7168, 32),
]
#: A smoke run's: one row per token and the scale pool's 32.
_SMOKE_TYPES = [TYPES[0], TYPES[-1]]


def run() -> str:
    """The kernel unit tests compiled, then one stash and two pops per element type at model
    sizes, both backends from the same state, compared byte for byte after every call. A
    smoke run leaves the unit tests to the test suite, which runs them."""
    parts, errors = [], []
    steps = [("model sizes", _model_sizes)]
    if RUN.smoke:
        parts.append("unit tests: not rerun (smoke: the test suite runs tests/unit/kernels)")
    else:
        steps.insert(0, ("unit tests", _unit_tests))
    for label, fn in steps:
        try:
            parts.append(f"{label}: {fn()}")
        except Exception as e:
            errors.append(f"{label}: {type(e).__name__}: {e}")
            traceback.print_exc()
    if errors:
        raise AssertionError("; ".join(errors + parts))
    return "; ".join(parts)


def _unit_tests() -> str:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           "tests/unit/kernels"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-1000:])
    return last


def _model_sizes() -> str:
    from te_paged.tools.free_lists import FreeList

    if RUN.cuda:
        tokens, page = 16384, 64
    else:
        tokens, page = (512, 8) if RUN.smoke else (1024, 8)
    torch.manual_seed(0)
    types = _SMOKE_TYPES if RUN.smoke else TYPES
    kinds = [FreeList.FRESH, "host tier"] if RUN.smoke else [*FreeList, "host tier"]
    failed = []
    for (label, dtype, hidden, per_row), kind in itertools.product(types, kinds):
        hidden = hidden if RUN.cuda else min(hidden, 24)
        try:  # every case, whatever an earlier one did
            _case(label, dtype, hidden, per_row, kind, tokens, page)
        except AssertionError as e:
            failed.append(str(e))
    cases = len(types) * len(kinds)
    if failed:
        raise AssertionError(f"{len(failed)} of {cases} cases differ: " + "; ".join(failed))
    lists = "fresh free list" if RUN.smoke else "fresh, 1F1B, alternating free lists"
    return (
        f"{cases} cases ({len(types)} element types x {lists} and a host-tier spill; {tokens} "
        f"tokens, 3/4 of them real, page {page}), every byte equal after each stash and pop"
    )


def _case(label, dtype, hidden, per_row, kind, tokens, page) -> None:
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

    dev = RUN.device
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
    state = torch.zeros(STATE_LEN, dtype=torch.int64, device=dev)
    state[State.HEAD], state[State.TAIL] = prepared.head, prepared.tail
    state[State.HOST_TAIL] = host_pages
    start = {
        "dev_pool": torch.zeros(prepared.num_pages * page, hidden, dtype=bits, device=dev),
        "dev_free": torch.tensor(prepared.free_P, dtype=torch.int32, device=dev),
        "host_pool": torch.zeros(host_pages * page, hidden, dtype=bits, pin_memory=RUN.cuda),
        "host_free": torch.arange(host_pages, dtype=torch.int32, device=dev),
        "state": state,
        "flags": torch.zeros(FLAGS_LEN, dtype=torch.int64, device=dev),
        "rec_pages": torch.full((-(-rows // page),), -7, dtype=torch.int32, device=dev),
        "rec_meta": torch.full((META_LEN,), 5, dtype=torch.int64, device=dev),
    }
    src = random_bits(rows, hidden, dtype).view(bits)
    garbage = random_bits(rows, hidden, dtype).view(bits)
    num = torch.tensor([n], device=dev)

    def run(backend: str) -> list[dict[str, torch.Tensor]]:
        t = {k: v.clone().pin_memory() if v.is_pinned() else v.clone() for k, v in start.items()}
        pool = [t[k] for k in ("dev_pool", "dev_free", "host_pool", "host_free", "state")]
        rec = [t["flags"], t["rec_pages"], t["rec_meta"]]
        snaps = []

        def snap() -> dict[str, torch.Tensor]:
            # The kernels write the pinned host pool through unified addressing: a host-side
            # clone must wait for them (the GPU run of 2026-12-04 compared a half-written one).
            if RUN.cuda:
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
    if not same(ref[1]["dst"][:used], src[:used]):
        raise AssertionError(f"{case}: the reference lost rows")
    calls = ["stash", "pop (padding zeroed)", "stash again", "pop (padding left)"]
    for call, a, b in zip(calls, ref, got):
        bad = [k for k in a if not same(a[k], b[k])]
        if bad:
            raise AssertionError(f"{case}, after {call}: Triton differs in {', '.join(bad)}")
