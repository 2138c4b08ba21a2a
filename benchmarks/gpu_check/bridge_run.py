"""Check 14's worker: Megatron-Bridge's ``pretrain()`` on one GPU, paged stash OFF then ON, with
Transformer Engine's layers (Bridge's default spec) and te_paged's MoE layers; ``--variant
full_iteration`` adds the full-iteration CUDA graphs Bridge's perf recipes turn on with paged
stash. Run as ``python -m torch.distributed.run --standalone --nproc_per_node=1 -m
benchmarks.gpu_check.bridge_run --variant V --out FILE``; writes per run the loss, grad norm
and a bitwise digest of every parameter after each step."""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

STEPS = 4


def _digest(model) -> list[str]:
    """Each parameter's bytes, hashed: equal digests are equal tensors (bitwise)."""
    import hashlib

    from megatron.core.utils import unwrap_model

    out = []
    for chunk in model:
        for p in unwrap_model(chunk).parameters():
            data = p.detach().float().cpu().numpy().tobytes()
            out.append(hashlib.sha256(data).hexdigest()[:16])
    return out


def _run(paged: bool, variant: str) -> dict:
    from megatron.bridge.models.gpt_provider import GPTModelProvider, default_layer_spec
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.config import (
        CheckpointConfig,
        ConfigContainer,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        LoggerConfig,
        MockGPTDatasetConfig,
        OptimizerConfig,
        RNGConfig,
        SchedulerConfig,
        TokenizerConfig,
        TrainingConfig,
        ValidationConfig,
    )  # fmt: skip
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.bridge.training.pretrain import pretrain

    from te_paged.integrations.megatron import MegatronLoopAdapter, with_te_paged_moe

    loop = MegatronLoopAdapter()
    graphs = {}
    if variant == "full_iteration":  # as Bridge's perf recipes run paged stash
        graphs = {"cuda_graph_impl": "full_iteration", "use_te_rng_tracker": True,
                  "cuda_graph_warmup_steps": 1}  # fmt: skip
    provider = GPTModelProvider(
        num_layers=4, hidden_size=1024, num_attention_heads=8, ffn_hidden_size=2048,
        seq_length=1024, vocab_size=32000, num_moe_experts=8, moe_router_topk=2,
        moe_ffn_hidden_size=1024, gated_linear_unit=True, add_bias_linear=False,
        normalization="RMSNorm", position_embedding_type="rope", bf16=True,
        params_dtype=torch.bfloat16, moe_grouped_gemm=True, moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="ncclep", moe_expert_rank_capacity_factor=1.5,
        moe_paged_stash=paged, moe_paged_stash_buffer_size_factor_cuda=1.2,
        moe_router_dtype="fp32", hidden_dropout=0.0, attention_dropout=0.0,
        transformer_layer_spec=with_te_paged_moe(default_layer_spec, None, loop=loop), **graphs,
    )  # fmt: skip
    kept: dict[str, list] = {"loss": [], "grad_norm": [], "params": []}

    def on_step_end(context) -> None:
        loss = (context.loss_dict or {}).get("lm loss")
        kept["loss"].append(None if loss is None else float(loss))
        kept["grad_norm"].append(float(context.grad_norm))
        kept["params"].append(_digest(context.model))

    callbacks = CallbackManager()
    callbacks.register("on_train_step_end", on_step_end)
    config = ConfigContainer(
        model=provider,
        train=TrainingConfig(train_iters=STEPS, global_batch_size=8, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-4, min_lr=1e-4, clip_grad=1.0,
                                  use_distributed_optimizer=True, bf16=True),
        scheduler=SchedulerConfig(lr_decay_style="constant", start_weight_decay=0.0,
                                  end_weight_decay=0.0, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        dataset=MockGPTDatasetConfig(seq_length=1024, random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False,
                                     num_workers=0, dataloader_type="single"),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=32000),
        checkpoint=CheckpointConfig(),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="nccl"),
        mixed_precision="bf16_mixed",
    )  # fmt: skip
    try:
        pretrain(config, forward_step, callbacks=callbacks)
    finally:
        destroy_global_state()
    kept["attempts"] = [r.attempt for r in loop.records]
    return kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=["eager", "full_iteration"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")  # Bridge leaves a group it did not make
    try:
        runs = {"off": _run(False, args.variant), "on": _run(True, args.variant)}
    finally:
        dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(runs, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
