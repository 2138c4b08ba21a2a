"""``te-paged``'s help holds the same options with the same words wherever the parser builds
them (the engines' argument groups): every option of every command, as recorded in
``data/cli_help.json``. After a change that means to alter the help, rewrite the record with
``python tests/unit/tools/test_cli_help.py`` and read its diff."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from te_paged import cli

RECORD = Path(__file__).with_name("data") / "cli_help.json"


def _type_name(kind) -> str | None:
    return None if kind is None else getattr(kind, "__qualname__", type(kind).__qualname__)


PROBES = ("0", "1", "-1", "0.5", "1e9", "abc", "256,1024", "64+32")


def _parses(kind) -> dict[str, str] | None:
    """What a typed option makes of a few values (an error's type where it refuses one)."""
    if kind is None:
        return None
    out = {}
    for probe in PROBES:
        try:
            out[probe] = repr(kind(probe))
        except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
            out[probe] = type(e).__name__
    return out


def _options(parser: argparse.ArgumentParser) -> dict[str, dict]:
    """Every option of ``parser`` by its first name: what its help shows, and how it parses."""
    options = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or not action.option_strings:
            continue
        options[action.option_strings[0]] = {
            "names": action.option_strings,
            "dest": action.dest,
            "help": action.help,
            "metavar": action.metavar,
            "choices": None if action.choices is None else list(action.choices),
            "default": repr(action.default),
            "const": repr(action.const),
            "nargs": action.nargs,
            "required": action.required,
            "type": _type_name(action.type),
            "parses": _parses(action.type),
            "action": type(action).__name__,
        }
    return options


def describe() -> dict[str, dict]:
    """The top-level parser's and each command's description and options."""
    top = cli._parser()
    out = {"te-paged": {"description": top.description, "options": _options(top)}}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = {"description": sub.description, "options": _options(sub)}
    return out


def test_every_option_keeps_its_names_words_and_parsing() -> None:
    recorded = json.loads(RECORD.read_text())
    now = describe()
    assert now.keys() == recorded.keys()
    for command, want in recorded.items():
        got = now[command]
        assert got["description"] == want["description"], command
        assert got["options"].keys() == want["options"].keys(), (
            command,
            sorted(got["options"].keys() ^ want["options"].keys()),
        )
        for flag, spec in want["options"].items():
            assert got["options"][flag] == spec, (command, flag)


if __name__ == "__main__":
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps(describe(), indent=1, sort_keys=True) + "\n")
    sys.exit(0)
