# Sourced by scripts/test.sh, scripts/test_torch.sh and scripts/ab.sh (after env.sh): torchtitan
# 0.3.0 next to the lane's pinned torch. torchtitan declares no torch requirement; the
# constraint keeps any of its dependencies from replacing torch. Its requirements are installed
# as it declares them except wandb, a metrics backend it imports only when enabled
# (`metrics.enable_wandb`): installed, megatron-core would import it in every process (its
# timers do when it is present). triton: torchtitan's MoE import chain needs it without
# declaring it.
"${pip_install[@]}" --no-deps torchtitan==0.3.0
"${pip_install[@]}" -c <(echo "torch==$TORCH_RELEASE") \
  "torchdata>=0.8.0" "torch_checkpointing>=0.1.0" "datasets>=3.6.0,<4.8.0" "tokenizers>=0.15.0" \
  safetensors tyro tensorboard einops pillow spmd_types==0.2.3 triton
