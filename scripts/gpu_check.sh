#!/usr/bin/env bash
# One prepared command for a machine with a CUDA GPU (and torch + triton installed there):
#   bash scripts/gpu_check.sh [REPORT.md]
# Triton kernels vs the reference, sync-debug mode, CUDA-graph replay, ON/OFF parity on CUDA,
# stash bandwidth vs a device copy, `te-paged ab --device cuda`. See scripts/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
exec python3 scripts/gpu_check.py --out "${1:-benchmarks/results/gpu_check-$(date +%F).md}"
