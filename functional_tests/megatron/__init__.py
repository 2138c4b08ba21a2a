"""Megatron-core integration: a functional test launched with torchrun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def run_workers(worker: str, out: Path, *, world_size: int, timeout_s: int) -> list[dict]:
    """Launch ``functional_tests.megatron.<worker>`` on ``world_size`` CPU ranks with torchrun
    (fails the test when Megatron-core is missing or a rank fails); each rank's JSON result."""
    from functional_tests.launch import torchrun
    from te_paged.integrations.megatron import cpu_shims

    try:
        cpu_shims.megatron_version()
    except RuntimeError as e:
        pytest.fail(str(e))
    torchrun(
        ["-m", f"functional_tests.megatron.{worker}", "--out", str(out),
         "--timeout-s", str(timeout_s - 30)],
        nproc=world_size,
        timeout_s=timeout_s,
        env={"PYTHONWARNINGS": "ignore"},  # Megatron warns at import that TE and Apex are absent
    )  # fmt: skip
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]
    assert all(r["world_size"] == world_size for r in results)
    return results
