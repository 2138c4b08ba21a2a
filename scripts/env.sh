# Sourced by scripts/ab.sh and scripts/test.sh: create or reuse the virtual environment and
# install pinned CPU torch *first*, so that nothing later can resolve a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --disable-pip-version-check torch==2.13.0
