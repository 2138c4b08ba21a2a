"""te_paged's ``TEGroupedMLP`` against Megatron-core's, module against module, in fp32 and bf16.

``experts_worker.py`` (one process) builds both with identical weights for every activation
Megatron's experts take — SiLU, GELU, QuickGELU, ReLU, squared ReLU, each gated (GLU) and not —
and for GPT-OSS's clamped QuickGeGLU with a linear offset, probabilities applied on the input,
bf16 probabilities, ``moe_act`` recompute, and te_paged's static buffer with paged stash on;
then compares output, input and probability gradients and every parameter gradient.

* ``bias_activation_fusion=False`` (Megatron's default): **bitwise**, fp32 and bf16 — te_paged
  computes Megatron's unfused op order, rounding where it rounds (after ``act(gate)·up`` and
  again after the probability multiply), compiling QuickGELU as Megatron does.
* ``bias_activation_fusion=True`` (SwiGLU, QuickGeGLU): Megatron's fused kernels compute in fp32
  and round once; so do te_paged's. In bf16 output, input gradient and every weight gradient
  are bitwise; the probability gradient is a sum over the FFN width whose order torch.compile
  picks, and fp32 results differ from a compiled kernel in the last bits: those are compared at
  ``assert_close``'s tolerances.
* One FC2 weight element moved by 2⁻⁷ must fail the comparison, or it could not fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from functional_tests.launch import torchrun
from functional_tests.megatron import experts_worker as worker
from functional_tests.prelaunch import alone

LAUNCH_TIMEOUT_S = 240
CASES = {case.id: case for case in worker.CASES}


def _launch(out: Path) -> dict:
    results = out / "results.json"
    torchrun(
        ["-m", "functional_tests.megatron.experts_worker", "--out", str(results),
         "--timeout-s", str(LAUNCH_TIMEOUT_S - 30)],
        nproc=1,
        timeout_s=LAUNCH_TIMEOUT_S,
        env={"PYTHONWARNINGS": "ignore"},  # Megatron warns at import that TE and Apex are absent
    )  # fmt: skip
    return json.loads(results.read_text())


LAUNCH = alone("megatron experts", _launch)
LAUNCHES = [LAUNCH]


@pytest.fixture(scope="module")
def results(launches) -> dict:
    return launches.result(LAUNCH)


def _failures(comparison: dict, key: str) -> list[str]:
    return [
        f"{n} (max |diff| {c['max_abs_diff']:.3g})" for n, c in comparison.items() if not c[key]
    ]


def test_every_case_ran_and_compared_every_parameter(results) -> None:
    assert set(results) == set(CASES)
    for case_id, result in results.items():
        names = set(result["vs_megatron"])
        assert {"output", "input_grad", "probs_grad"} <= names, case_id
        # 4 experts, FC1 and FC2, weight and bias each (weights only without a bias)
        params = 8 if CASES[case_id].extra == "fused_squared_relu" else 16
        assert sum(n.startswith("grad:linear_fc") for n in names) == params, (case_id, names)


@pytest.mark.parametrize("case_id", [c for c, case in CASES.items() if not case.fusion])
def test_unfused_experts_are_bitwise_megatrons(results, case_id) -> None:
    failures = _failures(results[case_id]["vs_megatron"], "equal")
    assert not failures, f"{case_id}: not bitwise: {failures}"


@pytest.mark.parametrize("case_id", [c for c, case in CASES.items() if case.fusion])
def test_fused_activations_round_as_megatrons_fused_kernels(results, case_id) -> None:
    comparison = results[case_id]["vs_megatron"]
    assert not _failures(comparison, "close"), case_id
    if CASES[case_id].dtype == "bf16":
        failures = _failures({n: c for n, c in comparison.items() if n != "probs_grad"}, "equal")
        assert not failures, f"{case_id}: not bitwise: {failures}"


@pytest.mark.parametrize("case_id", list(CASES))
def test_a_perturbed_weight_fails_the_comparison(results, case_id) -> None:
    failures = _failures(results[case_id]["perturbed_vs_megatron"], "equal")
    assert "output (" in " ".join(failures), f"{case_id}: a moved weight went unnoticed"
