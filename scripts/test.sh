#!/usr/bin/env bash
# The whole test suite: lint, unit, distributed and functional tests (CPU).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The environment without torch (.venv-jax: Python 3.12, te_paged.jax only) and, for the whole
# suite, the JAX tests' pass there, in the background from the start: neither needs .venv, and
# the set-up below leaves a core idle while pip writes files. Its output comes before the lint.
jax_log=$(mktemp)
(
  source scripts/jax_env.sh
  if [ $# -eq 0 ]; then
    # Those that block torch's import stand in for its absence; they run only here. (A newer
    # jax here, without the filelock package: an XLA cache of its own.)
    TE_PAGED_TEST_XLA_CACHE= OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$JAX_VENV/bin/python" \
      -m pytest -q -p no:cacheprovider -m torch_free tests/unit/jax
  fi
) >"$jax_log" 2>&1 &
jax_job=$!
source scripts/env.sh
# Megatron-core 0.19.2 and 0.16.1 for the integration tests, pinned; --no-deps keeps them from
# touching torch. Installed first: the compile warm-up below runs a Megatron test worker.
source scripts/megatron.sh  # env.sh cd-ed to the repository root
source scripts/bridge.sh  # Megatron-Bridge 0.6.2 in a folder of its own, in the background
# Compile warm-up: where inductor's cache is empty (always in CI), the two parts of the suite
# that compile most (the Megatron experts worker, the compiled-activation tests) fill it now,
# niced, beside pip's installs, with the tests' settings, so the tests find their graphs
# compiled. The tests wait for them: left running, they slow the first rank launches.
"${pip_install[@]}" "pytest>=8"
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
install_repo  # env.sh
source scripts/torchtitan.sh  # torchtitan 0.3.0, for its integration tests
# The installs are done: what is left of the warm-up is now what the tests wait for. Beside the
# torch lanes (.ci/run) a niced warm-up got a few seconds of CPU a minute and held the tests back
# five minutes; back at normal priority (where the user may raise it: root) it competes evenly.
tree=("${warm_compile[@]}") children=()
while [ ${#tree[@]} -gt 0 ]; do
  renice -n 0 -p "${tree[@]}" >/dev/null 2>&1 || true
  children=($(ps -o pid= --ppid "$(IFS=,; echo "${tree[*]}")" || true))
  tree=("${children[@]}")
done
for pid in "${warm_compile[@]}"; do  # a failed warm-up costs only its time (the test compiles)
  wait "$pid" || true
done
bridge_wait
jax_status=0
wait "$jax_job" || jax_status=$?
cat "$jax_log"
rm -f "$jax_log"
[ "$jax_status" -eq 0 ] || exit "$jax_status"
[ -z "$warm_dir" ] || rm -rf "$warm_dir"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# Launched ranks share few cores with the test process; idle OpenMP threads spin. One thread
# a process unless the caller sets it.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ $# -eq 0 ]; then  # the whole suite, but for the two torch_blocked JAX tests (above)
  # The other JAX tests run again here, on the test extra's JAX beside torch.
  exec "$PY" -m pytest -q -m "not torch_blocked"
fi
exec "$PY" -m pytest -q "$@"
