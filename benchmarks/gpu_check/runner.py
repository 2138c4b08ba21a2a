"""Run the checks (each in a process of its own unless ``--in-process``), within a time budget,
and write the report: the machine, one row per check, then each check's tables."""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

import torch

from .common import ROOT, RUN, Run, Scale, TargetMissed, Unavailable, child_command, running

#: The checks, numbered from 1 in this order: one module each (common's docstring says what a
#: check module holds).
CHECKS = tuple(
    importlib.import_module(f"{__package__}.{name}")
    for name in (
        "check_01_kernels",
        "check_02_parity",
        "check_03_sync_free",
        "check_04_graph_experts",
        "check_05_graph_layer",
        "check_06_bandwidth",
        "check_07_step_time",
        "check_08_memory",
        "check_09_ab",
        "check_10_megatron",
        "check_11_hybrid_ep",
        "check_12_te_ports",
        "check_13_compiled",
        "check_14_bridge",
    )
)


def run_check(index: int) -> dict:
    """Run check ``index`` (1-based) here; its result as a dict."""
    check = CHECKS[index - 1]
    t0 = time.perf_counter()
    with running(index) as now:
        try:
            status, detail = "PASS", check.run() or ""
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
    return {"index": index, "name": check.NAME, "status": status, "detail": detail,
            "seconds": seconds, "sections": list(now.sections)}  # fmt: skip


def _in_child(index: int, timeout: float) -> dict:
    """Run check ``index`` in a fresh process (a CUDA error there cannot reach the next)."""
    name = CHECKS[index - 1].NAME
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(child_command(index, path), cwd=ROOT, timeout=timeout)
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
        target = CHECKS[r["index"] - 1].TARGET
        detail = " ".join(r["detail"].replace("|", "/").split())
        head.append(f"| {r['index']} | {r['name']} | {target} | {r['status']} | {detail} "
                    f"| {r['seconds']:.0f} |")  # fmt: skip
    body = []
    for r in results:
        if r["sections"]:
            body += ["", f"## {r['index']}. {r['name']}", "", *r["sections"]]
    return "\n".join(head + body) + "\n"


def configure(settings: Run) -> None:
    """Run the checks in this process as ``settings`` says (:data:`~.common.RUN`)."""
    for field in ("device", "backend", "scale", "step_tokens", "in_process"):
        setattr(RUN, field, getattr(settings, field))
    if settings.dry:
        # Check 1 compares the reference with the Triton kernels; on CPU only interpreted.
        # Read when te_paged's Triton kernels are first imported, i.e. after this.
        os.environ["TRITON_INTERPRET"] = "1"


def settings(args: argparse.Namespace) -> Run:
    """The :class:`~.common.Run` the command line asks for."""
    if args.smoke and not args.cpu_dry_run:
        raise SystemExit("gpu_check: --smoke is a scale of the CPU dry run: add --cpu-dry-run")
    if not args.cpu_dry_run:
        return Run(step_tokens=args.step_tokens, in_process=args.in_process)
    return Run(device=torch.device("cpu"), backend="torch", step_tokens=args.step_tokens,
               scale=Scale.SMOKE if args.smoke else Scale.DRY,
               in_process=args.in_process)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    from . import __doc__ as doc

    p = argparse.ArgumentParser(prog=f"python -m {__package__}", description=doc.split("\n\n")[0])
    p.add_argument("--out", help="write the report here (rewritten after each check)")
    p.add_argument("--only", type=int, nargs="+", help="run only these check numbers")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="checks not started by then are N/A (default 450)")  # fmt: skip
    tokens = Run.step_tokens
    p.add_argument("--step-tokens", type=int, default=tokens,
                   help=f"tokens per step of checks 7 and 8 (default {tokens})")  # fmt: skip
    p.add_argument("--command", help="the command line the report names")
    p.add_argument("--in-process", action="store_true", help="run every check in this process")
    p.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="run on CPU at toy sizes with the torch backend (to test this script without a GPU)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="with --cpu-dry-run: each check's smallest case only (the test suite's scale)",
    )
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    configure(settings(args))
    if args.child:
        result = run_check(args.child)
        with open(args.result, "w") as f:
            json.dump(result, f)
        return 0
    args.command = args.command or " ".join(["python -m", __package__, *argv])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    start = time.monotonic()
    results = []
    for index, check in enumerate(CHECKS, start=1):
        if args.only and index not in args.only:
            continue
        name = check.NAME
        left = args.budget_s - (time.monotonic() - start)
        print(f"[gpu_check] {index}. {name} ...", file=sys.stderr, flush=True)
        if left < 15:
            result = {"index": index, "name": name, "status": "N/A", "seconds": 0.0,
                      "sections": [], "detail": f"not run: the {args.budget_s:.0f} s budget "
                                                "was spent"}  # fmt: skip
        elif args.in_process:
            result = run_check(index)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            result = _in_child(index, left)
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
