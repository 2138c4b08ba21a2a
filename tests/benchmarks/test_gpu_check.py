"""The GPU check's CPU dry run at smoke scale (``python -m benchmarks.gpu_check --cpu-dry-run
--smoke --in-process``), in this process: every check module imports, and every check runs its
CPU part at its smallest case and passes, or is N/A for the reason its module documents for a
machine without CUDA. A check that fails here (a NameError, a wrong import, a figure that cannot
be read) fails the test, with the check's own detail in the message."""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses

import pytest
import torch

from benchmarks.gpu_check import runner
from benchmarks.gpu_check.common import RUN, Run, Scale

#: The checks a CPU cannot run, and the reason each gives (its module's docstring says why).
NOT_ON_CPU = {
    3: "set_sync_debug_mode needs CUDA (dry run on cpu)",
    4: "CUDA graphs needs CUDA (dry run on cpu)",
    5: "CUDA graphs needs CUDA (dry run on cpu)",
    # The step times are measured (the detail carries them); the target needs overlap's streams.
    7: "stream overlap needs CUDA (dry run on cpu): the target is not evaluated; OFF ",
    11: "deep_ep's HybridEP or megatron-core is not importable",
    14: "Megatron-Bridge with Transformer Engine needs CUDA (dry run on cpu)",
}
#: Checks that spend much of their time waiting on processes of their own (the compile of the
#: stash kernels for their registers; te-paged ab's ranks) run on a second thread, beside the
#: others: the test then takes its share of the suite's time. What may not overlap: checks 1
#: and 10 both interpret Triton kernels (the interpreter patches triton.language while a kernel
#: runs), and check 10 imports megatron-core, which imports Dynamo's modules (not while check 13
#: traces). So check 1 runs first, check 13 once check 10 is done.
BESIDE = (10, 9)
FIRST, AFTER_10 = 1, 13


@pytest.fixture
def smoke():
    saved = dataclasses.replace(RUN)
    runner.configure(Run(device=torch.device("cpu"), backend="torch", scale=Scale.SMOKE,
                         in_process=True))  # fmt: skip
    yield
    runner.configure(saved)


def test_every_check_passes_its_cpu_part_at_smoke_scale(smoke) -> None:
    checks = range(1, len(runner.CHECKS) + 1)
    results = {FIRST: runner.run_check(FIRST)}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = {i: pool.submit(runner.run_check, i) for i in BESIDE}
        for i in checks:
            if i not in (FIRST, AFTER_10, *BESIDE):
                results[i] = runner.run_check(i)
        results[10] = beside[10].result()
        results[AFTER_10] = runner.run_check(AFTER_10)
        results[9] = beside[9].result()
    for i in checks:
        r = results[i]
        if i in NOT_ON_CPU:
            assert r["status"] == "N/A" and r["detail"].startswith(NOT_ON_CPU[i]), r
        else:
            assert r["status"] == "PASS", f"check {i}: {r['status']} {r['detail']}"
    # Check 10 read both sides' registers from the cubins compiled for sm_90.
    detail = results[10]["detail"]
    assert "bf16x2048" in detail and "MXFP8x2048" in detail, detail
    assert detail.count("(registers stash/pop te_paged ") == 2, detail
    (kernels,) = [s for s in results[10]["sections"] if "| te_paged | _stash_kernel |" in s]
    assert "| Megatron | paged_stash_copy_kernel | scales |" in kernels, kernels
    # The report: one row per check, in order.
    args = argparse.Namespace(command="test", budget_s=450.0)
    head = runner.report([results[i] for i in checks], args, 1.0).split("\n## ")[0]
    rows = [line for line in head.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(row.split("|")[1]) for row in rows] == list(checks)
