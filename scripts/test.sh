#!/usr/bin/env bash
# The whole test suite: lint, unit, distributed and functional tests (CPU).
# Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
# Megatron-core 0.19.2 and 0.16.1 for the integration tests, pinned; --no-deps keeps them from
# touching torch. Installed first: the compile warm-up below runs a Megatron test worker.
source scripts/megatron.sh  # env.sh cd-ed to the repository root
# Inductor compiles into an empty cache (CI always starts with one). The Megatron experts
# test compiles Megatron's and te_paged's activations, about 30 graphs, after inductor's CPU
# probes and precompiled header: 72 s cold in one process, 19 s warm, and its launch is on the
# suite's longest path. Run its worker now, beside pip's installs (which use one core); the
# test then finds every graph in the cache. The tests wait for it: left to finish beside them
# it slowed the first launch's four ranks by 20 to 30 s (two runs). Its package imports pytest.
# Skipped where inductor's cache (torch's default folder) has compiled anything before.
"$PY" -m pip install -q --disable-pip-version-check "pytest>=8"
[ -z "$torch_bytecode" ] || wait "$torch_bytecode" || true  # env.sh
warm_compile= warm_dir=
inductor_cache=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)}
if [ ! -d "$inductor_cache/fxgraph" ]; then
  warm_dir=$(mktemp -d)
  OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node=1 -m functional_tests.megatron.experts_worker \
    --out "$warm_dir/results.json" --timeout-s 300 >"$warm_dir/log" 2>&1 &
  warm_compile=$!
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
source scripts/torchtitan.sh  # torchtitan 0.3.0, for its integration tests
if [ -n "$warm_compile" ]; then  # a failed warm-up costs only its time (the test compiles)
  wait "$warm_compile" || true
  rm -rf "$warm_dir"
fi
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# The tests run launched ranks beside the test process on few cores. With more threads than
# cores, torch's OpenMP threads spin while they wait: measured on 2 cores, about 30 % of the suite's
# CPU time (pytest 590 s with torch's default, 427 s with one thread a process). One thread a
# process, unless the caller sets it.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest -q "$@"
