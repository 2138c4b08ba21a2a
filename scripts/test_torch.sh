#!/usr/bin/env bash
# A torch lane beside the main one (scripts/test.sh, torch 2.13.0): te_paged's tests on another
# torch release, in a virtual environment of its own (.venv-torch<RELEASE>, scripts/env.sh):
#
#   bash scripts/test_torch.sh 2.15.0   the newest release: tests/, the functional cases that
#                                       run compiled code, and the main job
#   bash scripts/test_torch.sh 2.10.0   the floor (pyproject's torch>=): tests/unit, the main job
#                                       and the Megatron and torchtitan integrations, eager
#
# Extra arguments go to pytest in place of the lane's selection. megatron-core, Megatron-Bridge
# and torchtitan install as in the main lane; the JAX tests' torch-free pass runs only there.
export TORCH_RELEASE=${1:?usage: scripts/test_torch.sh RELEASE [pytest arguments]}
shift
source "$(dirname "$0")/env.sh"
case "$TORCH_RELEASE" in  # torch 2.10's Triton (3.6) interprets kernels with NumPy < 2.4 only
  2.10.*) echo "numpy<2.4" >>"$PIP_CONSTRAINT" ;;
esac
source scripts/megatron.sh
source scripts/bridge.sh
install_repo  # env.sh
source scripts/torchtitan.sh
bridge_wait
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The main job: `te-paged ab` on the default model, several ranks.
main_job=functional_tests/test_cli.py::test_ab_spawns_ranks_and_writes_json_plot_and_profile
if [ $# -eq 0 ]; then
  case "$TORCH_RELEASE" in
    2.10.*)  # eager: compiling is refused below 2.13, torchtitan 0.3.0 needs 2.12
      set -- tests/unit "$main_job" functional_tests/megatron/test_megatron_docs.py \
        --ignore=tests/unit/torchtitan --ignore=tests/unit/stash/test_compiled.py \
        --ignore=tests/unit/stash/test_compiled_runtime.py \
        --ignore=tests/unit/moe/test_compiled_layer.py \
        --deselect "tests/unit/tools/test_cli_parsers.py::test_cpu_ranks_fork_from_a_server_that_imported_the_framework[torchtitan-torchtitan-imported1]" ;;
    *)
      set -- tests "$main_job" functional_tests/test_cli.py::test_ab_compiled_is_bitwise_pages_and_saves_memory \
        functional_tests/megatron/test_megatron_experts.py \
        functional_tests/torchtitan/test_torchtitan_train.py ;;
  esac
  set -- -m "not torch_blocked" "$@"
fi
exec "$PY" -m pytest -q "$@"
