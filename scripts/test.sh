#!/usr/bin/env bash
# The whole test suite: lint, unit, distributed and functional tests (CPU).
# Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
# Inductor's first compile into an empty cache (CI starts with none) first builds its CPU
# probes, a few small C++ programs: measured 16 s before the first kernel, 5 s once they are
# built. Build them now, on the core that pip's installs leave idle.
"$PY" -c 'import torch; torch.compile(torch.sigmoid)(torch.ones(8))' >/dev/null 2>&1 &
warm_compile=$!
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
# Megatron-core 0.19.2 and 0.16.1 for the integration tests, pinned; --no-deps keeps them from
# touching torch.
source scripts/megatron.sh  # env.sh cd-ed to the repository root
source scripts/torchtitan.sh  # torchtitan 0.3.0, for its integration tests
wait "$warm_compile" || true  # a failed warm-up costs only its time
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# The tests run launched ranks beside the test process on few cores. With more threads than
# cores, torch's OpenMP threads spin while they wait: measured on 2 cores, about 30 % of the suite's
# CPU time (pytest 590 s with torch's default, 427 s with one thread a process). One thread a
# process, unless the caller sets it.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest -q "$@"
