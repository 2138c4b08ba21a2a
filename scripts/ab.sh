#!/usr/bin/env bash
# The main job: `te-paged ab` (paged stash ON vs OFF, default model, 4 CPU ranks).
# Extra arguments go to `te-paged ab` (see `te-paged ab --help`).
source "$(dirname "$0")/env.sh"
"$PY" -m pip install -q --disable-pip-version-check -e ".[plot]"
exec "$VENV/bin/te-paged" ab "$@"
