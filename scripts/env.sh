# Sourced by scripts/ab.sh and scripts/test.sh: create or reuse the virtual environment and
# install pinned CPU torch *first*, so that nothing later can resolve a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# pip compiles what it installs to bytecode on one core, most of torch's install time. torch and
# what comes with it install without that, and are compiled on every core in the background
# while the next installs run (those compile their own). `wait "$torch_bytecode"` before
# starting a process that imports torch, or it reads the sources.
"$PY" -m pip install -q --disable-pip-version-check --no-compile torch==2.13.0
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
torch_bytecode=
if ! compgen -G "$SITE/torch/__pycache__/__init__.*.pyc" >/dev/null; then  # just installed
  # What is in site-packages now: a later install may be writing elsewhere in it meanwhile.
  # A file that does not compile (pip skips those too) does not fail the set-up.
  "$PY" -m compileall -q -j 0 "$SITE"/* >/dev/null 2>&1 &
  torch_bytecode=$!
fi
