#!/usr/bin/env bash
# Create or reuse .venv, install pinned CPU torch first (so no CUDA build is ever resolved),
# install te_paged with its test extras, then lint and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
exec "$PY" -m pytest -q "$@"
