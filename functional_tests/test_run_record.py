"""The run record of ``te-paged ab --json``: strict JSON, valid against the schema kept in the
repo for both engines, every field documented in docs/run-record.md; the memory table labels
capture and fallback steps and measures the saving on the last step that ran with the stash."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonschema import Draft202012Validator

import te_paged
from te_paged.runtime.runner import StepRecord
from te_paged.tools.ab import ABResult, StepResult, format_table, rank_result
from te_paged.tools.model import ModelConfig
from te_paged.tools.run_record import SCHEMA_VERSION, build_record, dumps, load_schema

from .launch import REPO_ROOT

SCHEMA = load_schema()
VALIDATOR = Draft202012Validator(SCHEMA)

# Small shapes, as in test_cli.py; 2 layers make the reload-adjusted model (cf − bf − cf/L) × S
# negative, so its ratio is undefined: a null in every record of these runs.
SMALL = ["--nproc", "2", "--layers", "2", "--experts", "4", "--hidden", "32", "--ffn", "64",
         "--tokens", "64", "--page-size", "8"]  # fmt: skip


def _refuse(constant: str) -> None:
    raise ValueError(f"not strict JSON: {constant}")


def strict_loads(text: str) -> Any:
    """``json.loads`` that rejects NaN, Infinity and -Infinity, as ``JSON.parse`` does."""
    return json.loads(text, parse_constant=_refuse)


def schema_errors(record: Any) -> list[str]:
    errors = sorted(VALIDATOR.iter_errors(record), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def check_record(path: Path) -> dict:
    """The record at ``path``, parsed strictly and validated against the schema."""
    record = strict_loads(path.read_text())
    errors = schema_errors(record)
    assert not errors, "\n".join(errors[:10])
    return record


def ab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "te_paged", "ab", *args],
        capture_output=True, text=True, timeout=240, cwd=REPO_ROOT, check=False,
    )  # fmt: skip


def _attempts(record: dict) -> list[int]:
    return [s["attempt"] for s in record["ranks"][0]["on"]]


# --------------------------------------------------------------------------------- real runs


def test_default_engine_record_with_a_last_step_that_fell_back(tmp_path) -> None:
    # A pool kept at factor 1.06 fits steps 1 and 2 of this seed, not step 3: the record and the
    # table must measure the saving on step 2 (before: on step 3, with "pool 0.00 MiB", S 0,
    # "nan %" and NaN in the JSON). Every layer paged, as the seed and factor were chosen.
    js, profile = tmp_path / "ab.json", tmp_path / "routing.json"
    args = [*SMALL, "--steps", "4", "--buffer-factor-cuda", "1.06", "--seed", "0",
            "--no-grow-pool", "--no-skip-immediate-backward", "--json", str(js),
            "--record-profile", str(profile)]  # fmt: skip
    proc = ab(*args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = check_record(js)
    assert _attempts(record) == [1, 1, 1, 2], (
        "the model's routing changed: pick a --buffer-factor-cuda or --seed whose last step, "
        f"and only that one, falls back; attempts {_attempts(record)}"
    )
    assert record["schema_version"] == SCHEMA_VERSION == 1 and record["engine"] == "default"
    assert record["te_paged_version"] == te_paged.__version__
    assert record["torch_version"] == torch.__version__
    assert record["command"][1:] == ["ab", *args] and record["equal"] is True
    memory = record["memory"]
    assert memory["step"] == 2
    on = [rank["on"] for rank in record["ranks"]]
    assert memory["pool_bytes"] == max(steps[2]["pool_bytes"] for steps in on) > 0
    assert memory["S_bytes"] == max(steps[2]["s_bytes"] for steps in on) > 0
    assert all(steps[3]["pool_bytes"] == 0 and not steps[3]["enabled"] for steps in on)
    assert [s["capture"] for s in on[0]] == [True, False, False, False]
    assert all(rank["memory_step"] == 2 for rank in record["ranks"])
    assert memory["measured_over_predicted"] > 0
    assert memory["measured_over_reload_adjusted"] is None  # (2 − 1.06 − 2/2) × S < 0
    assert record["ranks"][0]["routing"]["ep_size"] == 2
    out = proc.stdout
    for row in ("| 0 (capture) |", "| 1 (paged) |", "| 2 (paged) |", "| 3 (fallback) |"):
        assert row in out, out
    assert "Memory of step 2 (the last that ran with the stash)" in out
    assert "| n/a (model ≤ 0) |" in out and "nan" not in out and "0.00 MiB |" not in out


def test_default_engine_record_when_every_step_fell_back_has_null_memory(tmp_path) -> None:
    js = tmp_path / "ab.json"
    proc = ab(*SMALL, "--steps", "3", "--buffer-factor-cuda", "1.0", "--no-grow-pool",
              "--json", str(js))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    record = check_record(js)
    assert _attempts(record) == [1, 2, 2], _attempts(record)
    assert record["memory"] is None
    assert all(rank["memory_step"] is None for rank in record["ranks"])
    assert "every step after the capture step was rerun" in proc.stdout
    assert "| 1 (fallback) |" in proc.stdout and "| 2 (fallback) |" in proc.stdout


# The megatron engine's record (with its memory) is validated by test_cli.py's run of the
# default Megatron model, and a fallback's by its forced-rerun run: a third launch here cost
# 12 s of the suite for checks those two make.


# ---------------------------------------------------------------------- records built here


def _step(i: int, *, paged: bool, attempt: int = 1, pool: int = 0, s: int = 0) -> StepResult:
    enabled = paged and attempt == 1
    record = StepRecord(
        step=i, attempt=attempt, enabled=enabled, stash_overflow_ranks=int(attempt == 2),
        overbudget_ranks=0, host_spill_ranks=0, will_retry=attempt == 2,
        pool_high_water_pages={"float32x32": 3} if paged and i else {},
        pool_pages={"float32x32": 4} if paged and i else {},
        peak_tokens=130, budget_tokens=256, balanced_tokens=128,
    )  # fmt: skip
    peak = 1000 if paged else 1500
    return StepResult(
        2.0 - i / 10, 0.5, attempt, enabled, int(attempt == 2), 0, 0, peak,
        dataclasses.asdict(record), capture=paged and i == 0, pool_bytes=pool, s_bytes=s,
        stashes=8 if paged else 0, pops=8 if paged else 0,
    )  # fmt: skip


def _result(on_kinds: list[str], layers: int = 8) -> ABResult:
    """One rank; ON steps ``capture``, ``paged`` (pool 100, S 200) or ``fallback``."""
    on = [
        _step(i, paged=True, attempt=2 if kind == "fallback" else 1,
              pool=100 if kind == "paged" else 0, s=200 if kind == "paged" else 0)
        for i, kind in enumerate(on_kinds)
    ]  # fmt: skip
    off = [_step(i, paged=False) for i in range(len(on_kinds))]
    rank = rank_result(0, on, off, [True] * len(on), 0, "a tracker", [])
    cfg = dataclasses.asdict(ModelConfig(layers=layers, steps=len(on_kinds)))
    return ABResult(cfg, 1, [rank])


def test_the_table_labels_steps_and_measures_the_last_step_with_the_stash() -> None:
    table = format_table(_result(["capture", "paged", "fallback"]))
    assert "| 0 (capture) |" in table and "| 1 (paged) |" in table
    assert "| 2 (fallback) |" in table
    # Step 1: ON 1000 + pool 100 against OFF 1500. The model's bf is the pool the step held
    # over S (100 / 200 = 0.5, not the configured 1.1: a grown pool counts as it is), so
    # predicted (2.0 − 0.5) × 200 = 300.
    assert "Memory of step 1 (the last that ran with the stash)" in table
    assert "(cf 2.0, bf 0.50, S " in table
    m = _result(["capture", "paged", "fallback"]).memory()
    assert (m["step"], m["pool_bytes"], m["S_bytes"], m["saving_bytes"]) == (1, 100, 200, 400)
    assert m["buffer_factor"] == 0.5
    assert m["measured_over_predicted"] == pytest.approx(400 / 300)
    last = _result(["capture", "paged", "paged"]).memory()
    assert last["step"] == 2
    assert _result(["capture", "fallback", "fallback"]).memory() is None


def test_stream_overlap_reloads_count_in_the_reload_adjusted_model() -> None:
    # With look-ahead 1 two layers of reloads are live at the peak: (2.0 − 0.5 − 2·2.0/8) × 200
    # (bf: the pool over S, 100 / 200).
    result = _result(["capture", "paged"])
    assert "(L 8)" in format_table(result)
    result.ranks[0].reload_layers = 2
    m = result.memory()
    assert m["reload_adjusted_saving_bytes"] == pytest.approx((2.0 - 0.5 - 2 * 2.0 / 8) * 200)
    assert "(L 8, R 2)" in format_table(result)


def test_a_built_record_validates_and_undefined_values_are_null() -> None:
    result = _result(["capture", "paged"], layers=2)  # reload-adjusted model < 0:
    result.ranks[0].pool_bytes = 220  # bf 220 / 200 = 1.1, (2.0 − 1.1 − 2.0/2) × S < 0
    result.ranks[0].on[0] = dataclasses.replace(result.ranks[0].on[0], loss=math.nan)
    record = build_record(result, "default", ["te-paged", "ab", "--layers", "2"])
    assert schema_errors(record) == []
    assert record["ranks"][0]["on"][0]["loss"] is None
    assert record["memory"]["measured_over_reload_adjusted"] is None
    assert strict_loads(dumps(record)) == record


BROKEN = {
    "missing": (lambda r: r.pop("torch_version"), "'torch_version' is a required property"),
    "version": (lambda r: r.update(schema_version=2), "1 was expected"),
    "unknown": (lambda r: r.update(extra=1), "Additional properties are not allowed"),
    "memory": (lambda r: r["memory"].pop("step"), "'step' is a required property"),
    "string-nan": (lambda r: r["memory"].update(measured_over_predicted="nan"), "is not of type"),
    "attempt": (lambda r: r["ranks"][0]["on"][0].update(attempt=3), "3 is not one of [1, 2]"),
    "record": (lambda r: r["ranks"][0]["on"][0]["record"].pop("will_retry"), "'will_retry' is"),
    "config": (lambda r: r["config"].update(heads=4), "Additional properties are not allowed"),
    "engine": (lambda r: r.update(engine="megatron"), "'heads' is a required property"),
}


@pytest.mark.parametrize(("mutate", "expected"), BROKEN.values(), ids=BROKEN.keys())
def test_the_schema_rejects_a_broken_record(mutate, expected) -> None:
    record = build_record(_result(["capture", "paged"]), "default", ["te-paged", "ab"])
    assert schema_errors(record) == []
    mutate(record)
    errors = schema_errors(record)
    assert any(expected in e for e in errors), errors


def test_nan_is_never_written_and_a_strict_parser_rejects_it() -> None:
    record = build_record(_result(["capture", "paged"]), "default", ["te-paged", "ab"])
    record["memory"]["measured_over_predicted"] = math.nan  # as the record was before
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        dumps(record)
    with pytest.raises(ValueError, match="not strict JSON: NaN"):
        strict_loads(json.dumps(record))


# ----------------------------------------------------------------------------- schema, docs


def _schema_fields(node: Any) -> set[str]:
    fields: set[str] = set()
    if isinstance(node, dict):
        fields |= set(node.get("properties", {}))
        for value in node.values():
            fields |= _schema_fields(value)
    elif isinstance(node, list):
        for value in node:
            fields |= _schema_fields(value)
    return fields


def test_every_schema_field_is_documented_and_every_documented_field_exists() -> None:
    Draft202012Validator.check_schema(SCHEMA)
    doc = (REPO_ROOT / "docs" / "run-record.md").read_text()
    documented = set(re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", doc, flags=re.MULTILINE))
    fields = _schema_fields(SCHEMA)
    assert fields - documented == set(), "fields missing from docs/run-record.md"
    assert documented - fields == set(), "documented fields the schema does not have"
    assert f"`schema_version` is {SCHEMA_VERSION}" in doc
