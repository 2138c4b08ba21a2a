#!/usr/bin/env bash
# The whole test suite: lint, unit, distributed and functional tests (CPU).
# Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
# Megatron-core for the integration tests, pinned; --no-deps keeps it from touching torch.
"$PY" -m pip install -q --disable-pip-version-check --no-deps megatron-core==0.16.1 numpy packaging psutil
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
exec "$PY" -m pytest -q "$@"
