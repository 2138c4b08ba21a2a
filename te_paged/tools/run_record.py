"""The run record: what ``te-paged ab --json PATH`` writes, versioned and strict JSON.

The record is :class:`~te_paged.tools.ab.ABResult` as a dict plus what a reader needs to trust
and reproduce it: ``schema_version``, the te_paged and torch versions (JAX's for the jax
engine, megatron-core's release for the megatron and bridge engines, megatron-bridge's for the
bridge engine, torchtitan's for the torchtitan engine), the engine and the command line. A
value that is undefined or not finite (a ratio against a model that is not positive, a loss
that overflowed) is written as ``null``, never as ``NaN`` or ``Infinity``, which strict
parsers (``JSON.parse``, ``json.loads`` with ``parse_constant`` raising) reject. Every field
is documented in docs/run-record.md; ``run_record.schema.json`` next to this module is the
JSON Schema (draft 2020-12) the tests validate every record against.

Bump :data:`SCHEMA_VERSION` when a field is removed, renamed or changes meaning or unit, and
update the schema and docs/run-record.md with it; adding a field also needs both.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from typing import Any

from te_paged._version import __version__
from te_paged.tools.ab_engines import AB_ENGINES
from te_paged.tools.ab_result import ABResult

__all__ = ["ENGINES", "SCHEMA_FILE", "SCHEMA_VERSION", "build_record", "dumps", "load_schema"]

SCHEMA_VERSION = 1
SCHEMA_FILE = "run_record.schema.json"
#: ``te-paged ab --engine`` values (the registry's); the record says which one ran.
ENGINES = tuple(AB_ENGINES)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±inf) replaced by None, recursively."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def build_record(result: ABResult, engine: str, command: list[str]) -> dict[str, Any]:
    """The record of one ``ab`` run. ``command`` is the command line as ``sys.argv`` holds it
    (the program first)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    record = {
        "schema_version": SCHEMA_VERSION,
        "te_paged_version": __version__,
        "torch_version": _torch_version(),
        **({"jax_version": _jax_version()} if engine == "jax" else {}),
        **(
            {"megatron_core_version": _megatron_version()}
            if engine in ("megatron", "bridge")
            else {}
        ),
        **({"megatron_bridge_version": _bridge_version()} if engine == "bridge" else {}),
        **({"torchtitan_version": _torchtitan_version()} if engine == "torchtitan" else {}),
        "command": [str(a) for a in command],
        "engine": engine,
        "equal": result.equal,
        **dataclasses.asdict(result),
        "memory": result.memory(),
        "memory_per_stage": result.memory_per_stage(),
        "wire": result.wire(),
    }
    return _finite(record)


def _torch_version() -> str | None:
    """torch's version, read from its metadata (no import); None where it is not installed
    (the jax engine with only the ``jax`` extra)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _megatron_version() -> str:
    from te_paged.integrations.megatron.releases import installed_version

    return installed_version()


def _bridge_version() -> str:
    from te_paged.integrations.megatron.releases import installed_bridge_release

    return installed_bridge_release().version


def _torchtitan_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("torchtitan")


def _jax_version() -> str:
    import jax

    return jax.__version__


def dumps(record: dict[str, Any]) -> str:
    """Strict JSON text of ``record`` (``ValueError`` if a non-finite number slipped through)."""
    return json.dumps(record, indent=1, allow_nan=False) + "\n"


def load_schema() -> dict[str, Any]:
    """The run record's JSON Schema, as shipped with the package."""
    text = importlib.resources.files("te_paged.tools").joinpath(SCHEMA_FILE).read_text()
    return json.loads(text)
