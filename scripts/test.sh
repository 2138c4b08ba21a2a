#!/usr/bin/env bash
# The whole test suite: lint, unit, distributed and functional tests (CPU).
# Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
# Megatron-core 0.19.2 and 0.16.1 for the integration tests, pinned; --no-deps keeps them from
# touching torch.
source scripts/megatron.sh  # env.sh cd-ed to the repository root
source scripts/torchtitan.sh  # torchtitan 0.3.0, for its integration tests
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
exec "$PY" -m pytest -q "$@"
