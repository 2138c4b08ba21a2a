"""Check 9: ``te-paged ab`` end to end on one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from .check_08_memory import TARGET_RATIO as MEMORY_TARGET
from .common import ROOT, RUN, TargetMissed, section

NAME = "te-paged ab --device cuda, one rank (default, and op-fuser + recompute)"
TARGET = f"ON/OFF bitwise (exit status 0); saving >= {MEMORY_TARGET} of the reload-adjusted model"


def _runs() -> tuple[list[str], list[list[str]]]:
    """The model's options, and the variants' extra options."""
    if RUN.smoke:  # the default path only, on a toy model
        return ["--tokens", "64", "--layers", "2", "--hidden", "64", "--ffn", "128"], [[]]
    tokens = "4096" if RUN.cuda else "256"
    return ["--tokens", tokens], [[], ["--op-fuser", "--recompute"]]


def run() -> str:
    """The CLI end to end on one rank; a path that pins what it stashed shows as a negative
    saving (the CPU suite caught two such leaks)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"}
    model, variants = _runs()
    details, missed = [], False
    for extra in variants:
        label = " ".join(extra) or "default"
        with tempfile.TemporaryDirectory() as tmp:
            js = os.path.join(tmp, "ab.json")
            cmd = [sys.executable, "-m", "te_paged", "ab", "--device", RUN.device.type,
                   "--nproc", "1", *model, "--json", js, *extra]  # fmt: skip
            out = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
            )
            print(out.stdout)
            shown = " ".join(["te-paged", *cmd[3:]]).replace(js, "ab.json")
            section(f"`{shown}`\n\n{out.stdout}", f"te-paged ab, {label}")
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
