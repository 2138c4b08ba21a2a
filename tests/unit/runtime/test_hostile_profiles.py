"""``te-paged plan --profile`` with hostile or broken JSON: exit 2 with one line naming
``--profile`` and the field, never a traceback and never a factor computed from nonsense."""

from __future__ import annotations

import json
import re

import pytest

from te_paged import cli

GOOD = {"num_experts": 4, "ep_size": 2, "top_k": 2, "tokens_per_rank": 8,
        "tokens": [[[4, 4, 4, 4], [8, 0, 8, 0]]]}  # fmt: skip


def _plan(tmp_path, capsys, profile) -> tuple[int, str]:
    path = tmp_path / "p.json"
    path.write_text(profile if isinstance(profile, str) else json.dumps(profile))
    code = cli.main(["plan", "--profile", str(path)])
    return code, capsys.readouterr().err


def test_a_good_profile_plans(tmp_path, capsys) -> None:
    code, err = _plan(tmp_path, capsys, GOOD)
    assert code == 0, err


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ({**GOOD, "top_k": -2}, "top_k must be an integer >= 1, got -2"),
        ({**GOOD, "top_k": 9}, "top_k=9 is more than num_experts=4"),
        ({**GOOD, "tokens_per_rank": 0}, "tokens_per_rank must be an integer >= 1, got 0"),
        ('{"num_experts": 4, "ep_size": 2, "top_k": 2, "tokens_per_rank": 1e400, "tokens": []}',
         "tokens_per_rank must be an integer >= 1, got inf"),
        ({**GOOD, "tokens": [[[4, -4, 4, 4]]]}, r"tokens\[0\]\[0\]\[1\] must be in \[0, 2\*\*53\)"),
        ({**GOOD, "tokens": [[["4", 4, 4, 4]]]},
         r"tokens\[0\]\[0\]\[0\] must be an integer token count, got '4'"),
        ({**GOOD, "tokens": [[[4, 4, 4, 1e300]]]}, r"tokens\[0\]\[0\]\[3\] must be an integer"),
        ({**GOOD, "tokens": [[]]}, r"tokens\[0\] must be a non-empty list of layers"),
        ({**GOOD, "tokens": [[[4, 4, 4, 4]], [[4, 4, 4, 4], [4, 4, 4, 4]]]},
         "the steps have different numbers of layers"),
        ({**GOOD, "tokens": [[[[4]]]]}, r"tokens\[0\]\[0\]\[0\] must be an integer"),
        ({**GOOD, "tokenz": []}, r"unknown field\(s\) \['tokenz'\]"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"num_experts": NaN}', "NaN is not a token count"),
    ],
    ids=["deep", "negative-top-k", "top-k-past-experts", "zero-tokens", "1e400", "negative",
         "string", "float", "no-layers", "ragged", "too-deep", "unknown", "list", "nan"],
)  # fmt: skip
def test_hostile_profiles_exit_2_naming_the_field(tmp_path, capsys, profile, message) -> None:
    code, err = _plan(tmp_path, capsys, profile)
    assert code == 2, err
    assert "--profile" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
