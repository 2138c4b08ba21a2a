"""Checks that need a CUDA GPU; run through ``scripts/gpu_check.sh``. Prints a Markdown report.

1. the Triton kernels vs the torch reference, compiled (``TRITON_INTERPRET=0``);
2. paged stash ON vs OFF and op-fuser vs unfused, bitwise, on CUDA in bf16;
3. ``torch.cuda.set_sync_debug_mode("error")`` around a captured ON step (Triton backend);
4. CUDA-graph capture and replay of a captured ON step, bitwise against eager OFF;
5. stash/pop bandwidth as a fraction of a device-to-device copy;
6. ``te-paged ab --device cuda`` with the allocator's peak statistics, on the default and the
   op-fuser + recompute paths: bitwise ON/OFF and a saving of at least 80 % of
   ``(cf − bf − cf/L) × S``.

Each check reports PASS or FAIL with its error and the next one runs regardless.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS: list[tuple[str, object]] = []


def check(name: str):
    def register(fn):
        CHECKS.append((name, fn))
        return fn

    return register


def run_checks(only: set[int] | None) -> list[tuple[str, str, str]]:
    results = []
    for i, (name, fn) in enumerate(CHECKS, start=1):
        if only and i not in only:
            continue
        t0 = time.perf_counter()
        try:
            detail = fn() or ""
            results.append((name, "PASS", f"{detail} ({time.perf_counter() - t0:.1f} s)"))
        except Exception as e:  # report and go on: one failure must not hide the others
            tb = traceback.format_exc(limit=4).strip().splitlines()[-6:]
            results.append((name, "FAIL", f"{type(e).__name__}: {e} / {' / '.join(tb)}"))
        print(f"[gpu_check] {name}: {results[-1][1]}", file=sys.stderr, flush=True)
    return results


def _cfg(**kw):
    from te_paged.config import MoEConfig

    base = {
        "hidden_size": 256,
        "moe_ffn_hidden_size": 512,
        "num_moe_experts": 8,
        "moe_expert_rank_capacity_factor": 2.0,
        "params_dtype": torch.bfloat16,
        "moe_paged_stash_kernel_backend": BACKEND,
    }
    if kw.get("recompute_modules"):
        base["recompute_granularity"] = "selective"
    return MoEConfig(**{**base, **kw})


ROWS, DEV, BACKEND = 2048, torch.device("cuda"), "triton"
ROUTING = [[300, 0, 120, 90, 200, 40, 160, 110], [10, 250, 130, 70, 180, 100, 90, 170]]


def _build(cfg, layers=2, seed=0):
    from te_paged.moe import TEGroupedMLP
    from te_paged.stash import PagedStashManager

    torch.manual_seed(seed)
    manager = PagedStashManager.from_config(cfg, DEV) if cfg.moe_paged_stash else None
    return manager, [TEGroupedMLP(8, cfg, manager=manager, device=DEV) for _ in range(layers)]


def _inputs(step):
    g = torch.Generator(device="cpu").manual_seed(step)
    x = torch.randn(ROWS, 256, generator=g).to(DEV, torch.bfloat16).requires_grad_()
    p = torch.rand(ROWS, generator=g).to(DEV).requires_grad_()
    return x, torch.tensor(ROUTING[step % 2], device=DEV), p


def _step(manager, layers, step, inputs=None):
    if manager is not None:
        manager.reset()
    x, tpe, p = inputs or _inputs(step)
    h = x
    for layer in layers:
        h, _ = layer(h, tpe, p)
    h.float().square().sum().backward()
    grads = [h.detach(), x.grad, p.grad]
    for layer in layers:
        grads += [q.grad.clone() for q in layer.parameters()]
        layer.zero_grad(set_to_none=True)
    return grads


@check("1. Triton kernels vs reference (compiled)")
def kernels():
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": ROOT}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "tests/unit/kernels",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-300:]
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-1000:])
    return last


@check("2. ON vs OFF and fused vs unfused, bitwise, CUDA bf16")
def parity():
    cases = list(itertools.product([False, True], [None, "mxfp8"], [[], ["moe_act"]]))
    for fuser, fp8, rc in cases:
        kw = {"use_transformer_engine_op_fuser": fuser, "fp8": fp8, "recompute_modules": rc}
        on_m, on = _build(_cfg(moe_paged_stash=True, **kw))
        _, off = _build(_cfg(**kw))
        _, other = _build(_cfg(**{**kw, "use_transformer_engine_op_fuser": not fuser}))
        for step in range(2):
            a, b, c = _step(on_m, on, step), _step(None, off, step), _step(None, other, step)
            if not all(torch.equal(u, v) for u, v in zip(a, b)):
                raise AssertionError(f"ON != OFF: fuser={fuser} fp8={fp8} rc={rc} step={step}")
            if not all(torch.equal(u, v) for u, v in zip(b, c)):
                raise AssertionError(f"fused != unfused: fp8={fp8} rc={rc} step={step}")
            s = on_m.stats()
            if s.overflow or not s.stashes == s.pops > 0:
                raise AssertionError(f"stash not used cleanly: {s}")
    return f"{len(cases)} configurations x 2 steps, every output and gradient bitwise equal"


@check("3. no host sync in a captured ON step (set_sync_debug_mode='error')")
def sync_free():
    manager, layers = _build(_cfg(moe_paged_stash=True, fp8="mxfp8"))
    _step(manager, layers, 0)
    manager.reset()  # allocates the pools, outside the checked step
    inputs = _inputs(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(manager, layers, 1, inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    s = manager.stats()
    assert s.stashes == s.pops > 0 and not s.overflow, s
    return f"{s.stashes} stashes, {s.pops} pops, no synchronising call"


@check("4. CUDA graph capture and replay of a captured ON step")
def graph():
    manager, layers = _build(_cfg(moe_paged_stash=True), layers=2)
    _, ref = _build(_cfg(), layers=2)
    x, tpe, p = _inputs(0)
    static = [t.detach().clone() for t in (x, p)]
    static_x, static_p = (t.requires_grad_() for t in static)
    static_tpe = tpe.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture step, then one captured step, eagerly
        for step in range(2):
            _step(manager, layers, step, (static_x, static_tpe, static_p))
            static_x.grad = static_p.grad = None
    torch.cuda.current_stream().wait_stream(stream)
    manager.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = static_x
        for layer in layers:
            h, _ = layer(h, static_tpe, static_p)
        h.float().square().sum().backward()
    for step in (1, 0, 1):  # new data each replay, copied into the static inputs
        xs, tpes, ps = _inputs(step)
        static_x.data.copy_(xs.detach())
        static_p.data.copy_(ps.detach())
        static_tpe.copy_(tpes)
        manager.reset()
        graph.replay()
        torch.cuda.synchronize()
        got = [h.detach(), static_x.grad, static_p.grad] + [
            q.grad for layer in layers for q in layer.parameters()
        ]
        want = _step(None, ref, step)
        if not all(torch.equal(u, v) for u, v in zip(got, want)):
            raise AssertionError(f"replay with step {step}'s data differs from eager OFF")
        assert not manager.stats().overflow
    return "3 replays with new data and routing, bitwise equal to eager OFF"


@check("5. stash+pop bandwidth vs a device-to-device copy")
def bandwidth():
    from te_paged.tools.bench import stash_report

    sizes = ([2048, 7168], [16384, 65536]) if DEV.type == "cuda" else ([256], [1024])
    report = stash_report(
        *sizes,
        repeats=20,
        device=DEV.type,
        backend=BACKEND,
        command="scripts/gpu_check.sh",
    )
    print(report)
    throughput = report.split("## Cost of zeroing")[0]  # the first table: no padding rows
    rows = [line for line in throughput.splitlines() if line.startswith("| ") and line[2].isdigit()]
    ratios = [
        f"{r.split('|')[1].strip()}x{r.split('|')[2].strip()}: {r.split('|')[-2].strip()}"
        for r in rows
    ]
    return "copy/stash (hidden x tokens): " + ", ".join(ratios)


@check("6. te-paged ab --device cuda (allocator peaks), default and op-fuser + recompute paths")
def ab():
    """Bitwise ON/OFF (the exit status) and a real saving on two expert-MLP paths: a path that
    pins what it stashed measures a negative saving (the CPU suite caught two such leaks)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"}
    tokens = "4096" if DEV.type == "cuda" else "256"
    details = []
    for extra in ([], ["--op-fuser", "--recompute"]):
        with tempfile.TemporaryDirectory() as tmp:
            js = os.path.join(tmp, "ab.json")
            cmd = [sys.executable, "-m", "te_paged", "ab", "--device", DEV.type, "--nproc", "1"]
            cmd += ["--tokens", tokens, "--json", js, *extra]
            out = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
            )
            print(out.stdout)
            if out.returncode != 0:
                raise RuntimeError(out.stdout[-1500:] + out.stderr[-1500:])
            with open(js) as f:
                m = json.load(f)["memory"]
        ratio = m["measured_over_reload_adjusted"]
        label = " ".join(extra) or "default"
        details.append(
            f"{label}: saving {m['saving_bytes'] / 2**20:.2f} MiB = {100 * ratio:.1f} % of "
            f"(cf - bf - cf/L) x S, {100 * m['measured_over_predicted']:.1f} % of (cf - bf) x S"
        )
        if not ratio >= 0.8:
            raise RuntimeError(f"{label}: saving {ratio:.2f} of the reload-adjusted model")
    return "; ".join(details)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", help="also write the report here")
    p.add_argument("--only", type=int, nargs="+", help="run only these check numbers")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run on CPU with the torch backend (to test this script without a GPU)",
    )
    args = p.parse_args()
    if args.cpu_dry_run:
        global DEV, BACKEND
        DEV, BACKEND = torch.device("cpu"), "torch"
    results = run_checks(set(args.only) if args.only else None)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (dry run)"
    head = [
        f"# GPU check ({time.strftime('%Y-%m-%d')})",
        "",
        f"{name}, torch {torch.__version__}, "
        f"triton {__import__('triton').__version__}, Python {sys.version.split()[0]}",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
    ]
    body = [f"| {n} | {r} | {d.replace('|', '/')} |" for n, r, d in results]
    report = "\n".join(head + body) + "\n"
    print(report)
    if args.out:
        with contextlib.suppress(OSError), open(args.out, "w") as f:
            f.write(report)
    return 0 if all(r == "PASS" for _, r, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
