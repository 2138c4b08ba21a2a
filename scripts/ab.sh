#!/usr/bin/env bash
# The main job: `te-paged ab` (paged stash ON vs OFF, default model, 4 CPU ranks).
# Extra arguments go to `te-paged ab` (see `te-paged ab --help`).
source "$(dirname "$0")/env.sh"
extras=torch,plot  # torch: the pinned build env.sh installed satisfies it
case " $* " in *" --engine jax "* | *" --engine=jax "*) extras=torch,plot,jax ;; esac
"${pip_install[@]}" -e ".[$extras]"
case " $* " in  # megatron-core 0.19.2 (and 0.16.1), pinned, next to the pinned torch
  *" --engine megatron "* | *" --engine=megatron "*) source scripts/megatron.sh ;;
  *" --engine bridge "* | *" --engine=bridge "*)  # Megatron-Bridge 0.6.2 on megatron-core 0.19.2
    source scripts/megatron.sh
    source scripts/bridge.sh
    bridge_wait
    export PYTHONPATH="$BRIDGE_PATH${PYTHONPATH:+:$PYTHONPATH}" ;;
esac
case " $* " in  # torchtitan 0.3.0, next to the pinned torch
  *" --engine torchtitan "* | *" --engine=torchtitan "*) source scripts/torchtitan.sh ;;
esac
exec "$VENV/bin/te-paged" ab "$@"
