# Sourced by scripts/ab.sh and scripts/test.sh: create or reuse the virtual environment and
# install pinned CPU torch *first*, so that nothing later can resolve a multi-GB CUDA build.
#
# TORCH_RELEASE picks the torch lane: 2.13.0 (the default, a CPU build on this machine's disk)
# in .venv, any other release in .venv-torch<release> of its own (the registry's CUDA build,
# about 3.5 GB, which runs on CPU). Such a lane pins torch for each of its pip calls with a
# constraint file of its own, which also stands in for any cap a machine's pip configuration
# sets (PIP_CONSTRAINT replaces it for those calls only).
set -euo pipefail
# A set-up step that fails names itself: under `set -e` bash would stop without a word.
trap 'echo "${BASH_SOURCE[0]:-bash}:$LINENO: exit $? from: $BASH_COMMAND" >&2' ERR
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TORCH_RELEASE=${TORCH_RELEASE:-2.13.0}
if [ "$TORCH_RELEASE" = 2.13.0 ]; then
  VENV=${VENV:-.venv}
else
  VENV=${VENV:-.venv-torch$TORCH_RELEASE}
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if [ "$TORCH_RELEASE" != 2.13.0 ]; then
  echo "torch==$TORCH_RELEASE" >"$VENV/torch-constraint.txt"
  export PIP_CONSTRAINT="$(cd "$VENV" && pwd)/torch-constraint.txt"
fi
# Bytecode: each module is compiled when a process first imports it, and written for the next
# one (pip installs with --no-compile). Where PYTHONDONTWRITEBYTECODE is set (it is on this
# project's machines) every process the tests start would compile its imports again; compiling
# all that is installed up front compiled about 60 % that nothing imports (most of pandas,
# sympy and scipy). pip_install: the one install line of the torch environments' scripts
# (jax_env.sh, another interpreter, passes the same flags).
unset PYTHONDONTWRITEBYTECODE
pip_install=("$PY" -m pip install -q --disable-pip-version-check --no-compile)
# A lane's torch comes from the registry (about 3.5 GB): the lanes download it one at a time (a
# lock on this file, which nothing writes), and a failed install is tried again, twice.
torch_lock=()
[ "$TORCH_RELEASE" = 2.13.0 ] || torch_lock=(flock scripts/env.sh)
for try in 1 2 3; do
  "${torch_lock[@]}" "${pip_install[@]}" "torch==$TORCH_RELEASE" && break
  [ "$try" -lt 3 ] || { echo "env.sh: installing torch $TORCH_RELEASE failed 3 times" >&2; exit 1; }
  echo "env.sh: installing torch $TORCH_RELEASE failed (try $try of 3); trying again" >&2
  sleep 10
done
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# JAX's compilation cache for the tests (tests/unit/jax/conftest.py), outside the repository as
# inductor's is: the torch lanes run the JAX tests the main command ran, on the same jax.
export TE_PAGED_TEST_XLA_CACHE=${TE_PAGED_TEST_XLA_CACHE-${TMPDIR:-/tmp}/te_paged_xla_$(id -un)}
# te_paged itself, editable, with its test extra. pip writes te_paged.egg-info into the
# repository: the lanes that .ci/run runs at once take turns (a lock on pyproject.toml, which
# nothing writes).
install_repo() {
  flock pyproject.toml "${pip_install[@]}" -e ".[test]"
}
