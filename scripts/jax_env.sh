# Sourced by scripts/test.sh (in the background, from the repository root): create or reuse the
# second environment, Python 3.12 without torch, and install te_paged there with the jax extra
# only, as a JAX user would: if torch were still a dependency, pip would fetch it here. Pins:
# scripts/jax-constraints.txt. pip writes te_paged.egg-info into the repository: it takes turns
# with the other installs (env.sh's install_repo).
JAX_VENV=${JAX_VENV:-.venv-jax}
if [ ! -x "$JAX_VENV/bin/python" ]; then
  py312=$(PYENV_VERSION=3.12.1 command -v python3.12 || true)
  [ -n "$py312" ] || py312="$(pyenv root 2>/dev/null)/versions/3.12.1/bin/python3.12"
  if ! PYENV_VERSION=3.12.1 "$py312" -c 'import sys; assert sys.version_info[:2] == (3, 12)'; then
    echo "scripts/jax_env.sh: the environment without torch needs Python 3.12 (pyenv 3.12.1)" >&2
    exit 1
  fi
  PYENV_VERSION=3.12.1 "$py312" -m venv "$JAX_VENV"
fi
unset PYTHONDONTWRITEBYTECODE  # as env.sh: bytecode written at first import, not installed
flock pyproject.toml "$JAX_VENV/bin/python" -m pip install -q --disable-pip-version-check \
  --no-compile -c scripts/jax-constraints.txt -e ".[jax]" pytest pytest-timeout hypothesis numpy \
  jsonschema
