#!/usr/bin/env bash
# The whole test suite: lint, unit, distributed and functional tests (CPU).
# Extra arguments go to pytest.
source "$(dirname "$0")/env.sh"
# Megatron-core 0.19.2 and 0.16.1 for the integration tests, pinned; --no-deps keeps them from
# touching torch. Installed first: the compile warm-up below runs a Megatron test worker.
source scripts/megatron.sh  # env.sh cd-ed to the repository root
# Inductor compiles into an empty cache (CI always starts with one). Two parts of the suite
# compile about 45 graphs between them, after inductor's CPU probes and precompiled header:
#   - the Megatron experts test's worker (Megatron's and te_paged's activations, 29 graphs):
#     72 s cold in one process, 19 s warm, and its launch is on the suite's longest path;
#   - tests/unit/grouped/test_weighted_activation.py (te_paged's compiled activations in
#     fp64, fp32 and bf16, 16 graphs): 59 s cold, 14 s warm, on the test process's own path.
# Both run now, beside pip's installs (one core), with the tests' settings (one OpenMP thread,
# the conftest's TRITON_INTERPRET), so that the tests find every graph in the cache; niced, so
# that pip keeps its core (three processes on two cores). The second warm-up costs the set-up
# about 35 s (237 s without, 271 s with, one after the other) and saves the test process 45 s
# of compiling alone, more beside the lane. The tests wait for them: left to finish beside the
# tests, the first warm-up slowed the first launch's four ranks by 20 to 30 s (two runs). Both
# need only torch, megatron-core and pytest. Skipped where inductor's cache (torch's default
# folder) has compiled anything before.
"$PY" -m pip install -q --disable-pip-version-check "pytest>=8"
[ -z "$torch_bytecode" ] || wait "$torch_bytecode" || true  # env.sh
warm_compile=() warm_dir=
inductor_cache=${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor_$(id -un)}
if [ ! -d "$inductor_cache/fxgraph" ]; then
  warm_dir=$(mktemp -d)
  OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore nice -n 10 "$PY" -m torch.distributed.run --standalone \
    --nproc_per_node=1 -m functional_tests.megatron.experts_worker \
    --out "$warm_dir/results.json" --timeout-s 300 >"$warm_dir/experts.log" 2>&1 &
  warm_compile+=($!)
  OMP_NUM_THREADS=1 nice -n 10 "$PY" -m pytest -q -p no:cacheprovider \
    tests/unit/grouped/test_weighted_activation.py >"$warm_dir/activations.log" 2>&1 &
  warm_compile+=($!)
fi
"$PY" -m pip install -q --disable-pip-version-check -e ".[test]"
source scripts/torchtitan.sh  # torchtitan 0.3.0, for its integration tests
for pid in "${warm_compile[@]}"; do  # a failed warm-up costs only its time (the test compiles)
  wait "$pid" || true
done
[ -z "$warm_dir" ] || rm -rf "$warm_dir"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# The tests run launched ranks beside the test process on few cores. With more threads than
# cores, torch's OpenMP threads spin while they wait: measured on 2 cores, about 30 % of the suite's
# CPU time (pytest 590 s with torch's default, 427 s with one thread a process). One thread a
# process, unless the caller sets it.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m pytest -q "$@"
