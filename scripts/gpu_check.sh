#!/usr/bin/env bash
# The one prepared command for a machine with a CUDA GPU (torch + triton installed there);
# bounded to 8 minutes on one H200 (the checks' --budget-s 450 and the timeout below: not yet
# timed there end to end since check 10 grew):
#   bash scripts/gpu_check.sh [REPORT.md] [options, e.g. --only 6 7; see --help]
# runs `python -m benchmarks.gpu_check` (benchmarks/gpu_check/: one module per check) and
# writes REPORT.md (default benchmarks/results/gpu-<date>.md): the machine, the command, and
# per check its target, PASS / MISS / FAIL / N/A and figures, then the full tables. Checks:
# Triton kernels vs the reference (every element type, FP8 and the MXFP8 scale pool included),
# ON vs OFF bitwise, sync-debug "error" and CUDA-graph replay of the captured step
# (TEGroupedMLP bf16 and MXFP8, and MoELayer; overlap on and off; each case in its own process),
# stash+pop bandwidth vs a device copy (>= 0.85 from 268 MB, >= 0.70 at 134 MB), step time
# ON/OFF with and without stream overlap (<= 1.02 with it; ON - OFF attributed per kernel), peak
# memory vs the capacity model, `te-paged ab --device cuda`, Megatron-core 0.19.2's stash
# kernels vs te_paged's at every width a DeepSeek-V3 layer stashes, bf16 and MXFP8 (time ratio
# <= 1.0 at every width and size; registers and occupancy of both beside it), te_paged's experts
# behind Megatron's HybridEP dispatcher where deep_ep imports (N/A otherwise), Transformer
# Engine 2.19's GroupedLinear cases (ported to CPU in tests/unit/grouped) on CUDA bf16, and the
# default ab model compiled (Inductor and reduce-overhead: ON vs OFF bitwise, the stash kernels
# in the compiled step's profile, step time ON/OFF compiled beside eager).
# Without a GPU: --cpu-dry-run (toy sizes; --smoke: each check's smallest case, as the test
# suite runs it). Exit status 0 only if every check met its target.
set -uo pipefail
cd "$(dirname "$0")/.."
command="bash scripts/gpu_check.sh $*"
out="benchmarks/results/gpu-$(date +%F).md"
if [[ $# -gt 0 && "$1" != --* ]]; then
  out="$1"
  shift
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
# The script stops starting checks after --budget-s (450 s) and kills one still running then;
# the outer timeout is a backstop. The report is rewritten after every check.
exec timeout -k 15 "${GPU_CHECK_TIMEOUT_S:-480}" "${PYTHON:-python3}" -m benchmarks.gpu_check \
  --out "$out" --command "$command" "$@"
