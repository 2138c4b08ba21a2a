"""``te-paged ab --engine jax``: the torch engines' table and run record (validated against the
schema), bitwise ON/OFF with a measured saving; its flags checked before anything runs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("jax")
jsonschema = pytest.importorskip("jsonschema")

from te_paged import cli  # noqa: E402
from te_paged.tools.run_record import load_schema  # noqa: E402

SMALL = ["--engine", "jax", "--layers", "4", "--hidden", "32", "--ffn", "32", "--tokens", "64",
         "--page-size", "8", "--buffer-factor-cuda", "1.25"]  # fmt: skip


def _strict(constant: str) -> None:
    raise ValueError(f"not strict JSON: {constant}")


def test_ab_engine_jax_prints_the_table_and_a_valid_record(tmp_path, capsys) -> None:
    js = tmp_path / "ab.json"
    assert cli.main(["ab", *SMALL, "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "| step | loss ON | loss OFF |" in out and "ON and OFF bitwise equal." in out
    assert "XLA compiled memory analysis" in out and "| 2 (paged) |" in out
    record = json.loads(js.read_text(), parse_constant=_strict)
    jsonschema.Draft202012Validator(load_schema()).validate(record)
    assert record["engine"] == "jax" and record["jax_version"] and record["equal"]
    assert record["config"]["capacity_factor"] == record["config"]["ep"] == 4
    mem = record["memory"]
    assert mem["peak_on_bytes"] < mem["peak_off_bytes"]
    assert abs(mem["measured_over_predicted"] - 1) < 0.05  # the capacity model, (cf − bf) × S
    (rank,) = record["ranks"]
    assert all(rank["grads_equal"]) and [s["attempt"] for s in rank["on"]] == [1, 1, 1]
    # The same record minus the jax fields is not valid: the schema ties them to the engine.
    record["engine"] = "default"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, load_schema())


def test_ab_engine_jax_forced_skew_reruns_and_stays_bitwise(capsys) -> None:
    assert cli.main(["ab", *SMALL, "--skew", "1", "--steps", "2", "--no-grow-pool"]) == 0
    out = capsys.readouterr().out
    assert "| 0 (fallback) |" in out and "| 1 (fallback) |" in out
    assert "ON and OFF bitwise equal." in out and "every step after the capture step" in out


def test_ab_engine_jax_grows_the_pool_after_an_overflow(tmp_path, capsys) -> None:
    js = tmp_path / "ab.json"
    assert cli.main(["ab", *SMALL, "--skew", "1", "--steps", "2", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "| 0 (fallback) |" in out and "| 1 (paged) |" in out and "bitwise equal." in out
    (rank,) = json.loads(js.read_text())["ranks"]
    first, second = (s["record"] for s in rank["on"])
    ((key, growth),) = first["pool_growth"].items()
    assert growth["why"] == "overflow" and growth["to"] > growth["from"]
    assert second["pool_pages"] == {key: growth["to"]} and second["attempt"] == 1
    # the memory table is of the last step, with the pool it held
    assert rank["pool_bytes"] == growth["to"] * 8 * 32 * 4  # pages x rows x hidden x fp32


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity-factor", "2"], "a capacity factor of --ep"),
        (["--fp8", "mxfp8", "--recompute"], "--fp8, --recompute: not available with --engine jax"),
        (["--dropout", "0.1"], "--dropout: not available with --engine jax"),
        (["--buffer-factor-cpu", "0.5"], "--buffer-factor-cpu: not available"),
        (["--no-grow-capacity"], "--no-grow-capacity: not available with --engine jax"),
        (["--ep", "3"], "experts=8 do not split over ep=3"),
        (["--device", "cuda"], "the jax engine runs on CPU"),
        # Known before anything starts (before: started, then exited 3 mid-run).
        (
            ["--tokens", "300000", "--ep", "64", "--experts", "64", "--topk", "8"],
            "a differentiable pool counts in float32, exact only below 2**24 rows",
        ),
        (["--skip-immediate-backward"], "the JAX port pages every layer"),
    ],
)
def test_ab_engine_jax_bad_arguments_exit_2(args, message, capsys) -> None:
    assert cli.main(["ab", "--engine", "jax", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_ab_help_names_the_jax_engine(capsys) -> None:
    with pytest.raises(SystemExit):
        cli.main(["ab", "--help"])
    # argparse wraps at the terminal's width, hyphenated words included: compared unwrapped.
    out = "".join(capsys.readouterr().out.split())
    assert "{default,megatron,bridge,jax,torchtitan}" in out
    assert "jax:te_paged.jax'sring-of-experts" in out
    assert "jax:thering'ssizeandthecapacityfactor,default4" in out
