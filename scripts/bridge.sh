# Sourced by scripts/test.sh and scripts/ab.sh (after env.sh and megatron.sh): Megatron-Bridge
# 0.6.2, pinned, for its integration tests and `te-paged ab --engine bridge`, in a folder of the
# virtual environment of its own, imported by path:
#
#   $VENV/megatron-bridge/0.6.2   Bridge and its dependencies (scripts/bridge-requirements.txt)
#
# As megatron-core's releases are (megatron.sh): the wheel declares Python >= 3.12 and runs on
# 3.11, so it is installed without pip's interpreter check, with --no-deps so that nothing
# replaces the pinned CPU torch, and without Transformer Engine or CUDA. Its own folder, not
# site-packages: Bridge brings transformers and nvidia-modelopt, which megatron-core's
# `megatron.training` imports wherever they are installed (5 s of CPU a process), so only the
# processes that run Bridge put the folder on their path: ab.sh exports it on PYTHONPATH for
# `--engine bridge`, the tests find it through TE_PAGED_TEST_BRIDGE_ROOT.
# nvidia-resiliency-ext is left out: on Python 3.11 and glibc < 2.39 pip resolves 0.4.1, whose
# import breaks megatron-core 0.19.2's; te_paged's CPU shims stand in for the one name Bridge
# imports of it.
# The install runs in the background (its own folder: nothing else writes there); call
# bridge_wait before anything imports Bridge.
BRIDGE_PATH="$PWD/$VENV/megatron-bridge/0.6.2"
case "$VENV" in /*) BRIDGE_PATH="$VENV/megatron-bridge/0.6.2" ;; esac
bridge_pid=
if [ ! -f "$BRIDGE_PATH/megatron/bridge/package_info.py" ]; then
  rm -rf "$BRIDGE_PATH"
  "${pip_install[@]}" --no-deps --ignore-requires-python \
    --only-binary=:all: --target "$BRIDGE_PATH" megatron-bridge==0.6.2 \
    -r scripts/bridge-requirements.txt &
  bridge_pid=$!
fi
bridge_wait() {
  [ -z "$bridge_pid" ] || wait "$bridge_pid" || {
    echo "bridge.sh: installing megatron-bridge 0.6.2 failed" >&2
    exit 1
  }
  bridge_pid=
}
export TE_PAGED_TEST_BRIDGE_ROOT="${BRIDGE_PATH%/*}"
