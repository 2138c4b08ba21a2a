"""Check 14: Megatron-Bridge's ``pretrain()`` on a GPU with Transformer Engine's layers and
te_paged's MoE layers, eager and under the full-iteration CUDA graphs Bridge's perf recipes
turn on with paged stash: what the CPU tests of functional_tests/megatron_bridge cannot run."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from .common import ROOT, TargetMissed, Unavailable, need_cuda, section

NAME = "Megatron-Bridge pretrain(), TE layers + te_paged's MoE, eager and full-iteration graphs"
TARGET = "ON equals OFF bitwise (loss, grad norm, every parameter, every step), both variants"


def run() -> str:
    """On one GPU (bf16, 4 layers, 8 experts, 1024 tokens a sequence): ``bridge_run`` trains
    OFF then ON in one process, eager, then with ``cuda_graph_impl="full_iteration"``. N/A
    without CUDA, Bridge or Transformer Engine."""
    need_cuda("Megatron-Bridge with Transformer Engine")
    for module in ("megatron.bridge", "transformer_engine"):
        if importlib.util.find_spec(module) is None:
            raise Unavailable(f"{module} is not importable")
    details, missed = [], False
    for variant in ("eager", "full_iteration"):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "runs.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=1", "-m", "benchmarks.gpu_check.bridge_run",
                   "--variant", variant, "--out", out]  # fmt: skip
            proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                                  capture_output=True, text=True, timeout=420)  # fmt: skip
            section(f"`{' '.join(cmd[2:])}`\n\n```\n{proc.stdout[-3000:]}\n```", variant)
            if proc.returncode != 0:
                raise RuntimeError(f"{variant}: " + (proc.stdout + proc.stderr)[-2000:])
            with open(out) as f:
                runs = json.load(f)
        on, off = runs["on"], runs["off"]
        equal = all(on[k] == off[k] for k in ("loss", "grad_norm", "params"))
        missed |= not equal
        details.append(f"{variant}: {'bitwise equal' if equal else 'DIFFER'} over "
                       f"{len(on['loss'])} steps, ON attempts {on['attempts']}")  # fmt: skip
    if missed:
        raise TargetMissed("; ".join(details))
    return "; ".join(details)
