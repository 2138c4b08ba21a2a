"""The ``ab`` engine registry: the command line's groups come from it, each engine's own flags are
refused by every other engine, and the run record names the same engines."""

from __future__ import annotations

import argparse
import json
from importlib import resources

import pytest

from te_paged import cli
from te_paged.tools import ab_command
from te_paged.tools.ab_engines import AB_ENGINES, AbEngine, register

# A value each engine-owned flag takes (None: a switch).
VALUES = {"--dropout": "0.0", "--microbatches": "2", "--pipeline-parallel": "2",
          "--virtual-stages": "2", "--model": "hybrid", "--runner": "megatron",
          "--activation-checkpoint": "full", "--overlap-grad-reduce": None,
          "--record-profile": "/tmp/te-paged-profile.json"}  # fmt: skip


def _own_flags(engine: AbEngine) -> list[str]:
    parser = argparse.ArgumentParser()
    engine.arguments(parser.add_argument_group(engine.title))
    return [a.option_strings[0] for a in parser._actions if a.option_strings[0] != "-h"]


OWNED = [(name, flag) for name, e in AB_ENGINES.items() if e.arguments for flag in _own_flags(e)]


def test_the_help_has_each_engines_group_with_its_flags() -> None:
    text = cli._parser()._subparsers._group_actions[0].choices["ab"].format_help()
    for name, engine in AB_ENGINES.items():
        if engine.arguments is not None:
            section = text.split(f"\n{engine.title}:\n")[1].split("\n\n")[0]
            assert all(flag in section for flag in _own_flags(engine)), (name, section)
    assert set(VALUES) == {flag for _, flag in OWNED}


@pytest.mark.parametrize(("owner", "flag"), OWNED)
def test_an_engines_own_flag_is_refused_by_every_other_engine(owner, flag, monkeypatch) -> None:
    """...but an engine that takes the owner's group (the bridge engine, the megatron
    engine's) takes them, except those its own checks refuse by name."""
    monkeypatch.setattr(ab_command, "_megatron_missing", lambda cfg: None)
    monkeypatch.setattr(ab_command, "_bridge_missing", lambda: None)
    for other in AB_ENGINES:
        if other == owner:
            continue
        value = [] if VALUES[flag] is None else [VALUES[flag]]
        args = cli._parser().parse_args(["ab", "--engine", other, flag, *value])
        problem = ab_command.check_ab_args(args)
        if AB_ENGINES[other].takes == owner and flag not in ("--model", "--runner"):
            refused = problem is not None and "with --engine" in problem  # not a value check
            assert not refused, (owner, other, flag, problem)
        else:
            assert problem is not None and flag in problem, (owner, other, flag, problem)


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered already"):
        register(AbEngine("megatron", "again", AB_ENGINES["megatron"].config))


def test_the_run_records_engines_are_the_registrys() -> None:
    schema = json.loads(resources.files("te_paged.tools").joinpath("run_record.schema.json")
                        .read_text())  # fmt: skip
    assert schema["properties"]["engine"]["enum"] == list(AB_ENGINES)


@pytest.mark.parametrize(("flag", "value"), [("--ep", "2"), ("--seq-length", "64"),
                                             ("--micro-batch-size", "2")])  # fmt: skip
def test_the_default_engine_names_every_engine_that_takes_a_shared_flag(flag, value, monkeypatch):
    monkeypatch.setattr(ab_command, "_megatron_missing", lambda cfg: None)
    problem = ab_command.check_ab_args(cli._parser().parse_args(["ab", flag, value]))
    assert problem is not None and problem.startswith(f"{flag}: only with --engine "), problem
    named = problem.removeprefix(f"{flag}: only with --engine ").replace(" or ", ", ").split(", ")
    assert len(named) > 1, problem
    for engine in named:
        args = cli._parser().parse_args(["ab", "--engine", engine, flag, value])
        refused = ab_command.check_ab_args(args)
        assert refused is None or flag not in refused, (engine, refused)
