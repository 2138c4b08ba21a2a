"""``te-paged ab --engine bridge``: paged stash ON vs OFF inside Megatron-Bridge's own training
loop, ``megatron.bridge.training.pretrain``'s ``pretrain()``.

The model is the megatron engine's (:mod:`te_paged.tools.megatron_ab`), built the way a Bridge
user builds it: a ``GPTModelProvider`` with Megatron's local layers, the paged-stash fields
Bridge's perf recipes set (``moe_expert_rank_capacity_factor``, ``moe_paged_stash``, its
buffer factor and page size, the flex dispatcher that te_paged's layer replaces on CPU) and
te_paged's MoE layers through ``with_te_paged_moe`` on the provider's spec function; Bridge's
mock GPT data and ``gpt_step.forward_step``, its DDP and distributed optimizer (Adam, gradient
clipping), no evaluation, no checkpoint. Bridge builds Megatron's own ``PagedStashRunner``
around every step, which te_paged's layers serve through their
:class:`~te_paged.integrations.megatron.MegatronLoopAdapter`. Per rank the same steps run OFF,
then ON, each a ``pretrain()`` call from the same seed and data.

Per step a Bridge callback keeps the loss, the grad norm, every parameter after the optimizer
step and the adapter's record; the peak memory is that of the step's ``forward_backward_func``
call (Megatron's runner's, the attempts and the microbatches Bridge hands it; not the optimizer
step), measured as the megatron engine measures its own runner's. ``S`` and the saving's model
are the megatron engine's. Needs megatron-bridge 0.6.2 on megatron-core 0.19.2; on CPU the
caller installs :mod:`te_paged.integrations.megatron.cpu_shims` (``training_loop=True``) before
Bridge is imported.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from te_paged.tools.ab import RankResult, StepMeter, capturing, rank_result, step_result
from te_paged.tools.engine_configs import BridgeModelConfig
from te_paged.tools.megatron_ab import TrainRun, same_steps

__all__ = ["BridgeModelConfig", "run_bridge_ab", "train"]


def _provider(cfg: BridgeModelConfig, paged: bool, ep: int, loop):
    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec

    from te_paged.integrations.megatron import with_te_paged_moe

    stash = {
        "moe_paged_stash": paged,
        "moe_paged_stash_buffer_size_factor_cuda": cfg.buffer_factor_cuda,
        "moe_paged_stash_buffer_size_factor_cpu": cfg.buffer_factor_cpu,
        "moe_paged_stash_page_size": cfg.page_size,
    }
    return GPTModelProvider(
        num_layers=cfg.layers, hidden_size=cfg.hidden, num_attention_heads=cfg.heads,
        ffn_hidden_size=cfg.ffn, moe_ffn_hidden_size=cfg.ffn, seq_length=cfg.seq_length,
        vocab_size=cfg.vocab, num_moe_experts=cfg.experts, moe_router_topk=cfg.topk,
        gated_linear_unit=True, add_bias_linear=False, hidden_dropout=cfg.dropout,
        attention_dropout=cfg.dropout, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4, expert_model_parallel_size=ep,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        virtual_pipeline_model_parallel_size=cfg.virtual_stages,
        moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=cfg.flex_backend,
        moe_expert_rank_capacity_factor=cfg.capacity_factor, transformer_impl="local",
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False, apply_rope_fusion=False, params_dtype=torch.float32,
        transformer_layer_spec=with_te_paged_moe(local_layer_spec, None, loop=loop),
        **stash,
    )  # fmt: skip


def _config(cfg: BridgeModelConfig, provider, dp: int):
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
    )

    batch = cfg.micro_batch_size * cfg.microbatches * dp
    return ConfigContainer(
        model=provider,
        train=TrainingConfig(train_iters=cfg.steps, global_batch_size=batch,
                             micro_batch_size=cfg.micro_batch_size),
        validation=ValidationConfig(eval_interval=None, eval_iters=0),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-3, clip_grad=1.0,
                                  weight_decay=0.01, use_distributed_optimizer=True,
                                  bf16=False, fp16=False),
        scheduler=SchedulerConfig(lr_decay_style="constant", start_weight_decay=0.01,
                                  end_weight_decay=0.01, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True,
                                          overlap_grad_reduce=cfg.overlap_grad_reduce),
        dataset=MockGPTDatasetConfig(seq_length=cfg.seq_length, random_seed=cfg.seed + 1,
                                     reset_attention_mask=False, reset_position_ids=False,
                                     eod_mask_loss=False, num_workers=0,
                                     dataloader_type="single", pin_memory=False),
        logger=LoggerConfig(log_interval=10**6),  # the table is ab's
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=cfg.vocab),
        checkpoint=CheckpointConfig(),
        rng=RNGConfig(seed=cfg.seed + 1),  # Bridge asks for a positive seed
        dist=DistributedInitConfig(distributed_backend="nccl" if torch.cuda.is_available()
                                   else "gloo"),
    )  # fmt: skip


@contextlib.contextmanager
def _metered_runner(meters: dict) -> Iterator[None]:
    """Megatron's ``PagedStashRunner.__call__`` (what Bridge's ``train_step`` calls as its
    ``forward_backward_func``) inside ``meters["make"]()``'s meter; the meter is kept as
    ``meters["last"]``. A measuring tool's wrapper, restored on exit: te_paged's library
    patches nothing of Megatron's or Bridge's loop."""
    from megatron.core.transformer.moe.paged_stash import PagedStashRunner

    call = PagedStashRunner.__call__

    @functools.wraps(call)
    def metered(self, *args, **kwargs):
        meter = meters["make"]()
        meters["last"] = meter
        with meter:
            return call(self, *args, **kwargs)

    PagedStashRunner.__call__ = metered
    try:
        yield
    finally:
        PagedStashRunner.__call__ = call


def train(
    cfg: BridgeModelConfig,
    paged: bool,
    ep: int,
    device: torch.device,
    progress: Callable[[str], None] | None = None,
) -> TrainRun:
    """``cfg.steps`` steps of Bridge's ``pretrain()`` from a fresh model (see the module
    docstring); returns the megatron engine's :class:`TrainRun`."""
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.gpt_step import forward_step as bridge_forward_step
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core.utils import unwrap_model

    from te_paged.integrations.megatron import MegatronLoopAdapter, paged_stash_managers
    from te_paged.tools.megatron_ab import _reset_aux_loss_tracker, destroy_groups_made_inside

    loop = MegatronLoopAdapter(
        max_consecutive_fallbacks=cfg.max_consecutive_fallbacks,
        grow_pool=cfg.grow_pool,
        grow_capacity=cfg.grow_capacity,
    )
    run = TrainRun([], [], [], [])
    kept: dict = {"stats": [], "dropless": []}
    meters: dict = {"last": None}
    step = {"index": 0, "capture": False}

    def make_meter() -> StepMeter:  # a new meter per attempt-set: one per step's runner call
        return StepMeter(device, step["index"], step["capture"], cfg.measure_memory)

    meters["make"] = make_meter

    def forward_step(state, data_iterator, model, return_schedule_plan: bool = False):
        meter = meters["last"]
        if meter is not None and meter.new_iteration is not None:
            meter.new_iteration()  # each microbatch runs the same modules again
        return bridge_forward_step(state, data_iterator, model, return_schedule_plan)

    def on_record(record) -> None:  # before the adapter resets the managers for the next step
        kept["stats"].append([m.stats() for m in run.managers])
        kept["dropless"].append(sum(int(d.dropless_bytes) for d in loop.dispatchers))

    def on_train_start(context) -> None:
        run.managers[:] = paged_stash_managers([unwrap_model(c) for c in context.model])
        loop.on_record = on_record

    def on_train_step_start(context) -> None:
        step["index"] = context.state.train_state.step
        step["capture"] = capturing(run.managers)
        meters["last"] = None

    def on_train_step_end(context) -> None:
        loss = (context.loss_dict or {}).get("lm loss")  # only the last pipeline stage has it
        meter = meters["last"]
        result = step_result(
            torch.nan if loss is None else loss, context.grad_norm, loop.records[-1],
            0 if meter is None else meter.peak_bytes, step["capture"], run.managers,
        )  # fmt: skip
        stats = kept["stats"][-1]  # the managers as the step left them
        result.stashes, result.pops = sum(s.stashes for s in stats), sum(s.pops for s in stats)
        result.stashes_skipped = sum(s.stashes_skipped for s in stats)
        result.dropless_bytes = kept["dropless"][-1]
        run.steps.append(result)
        run.aux.append({})  # Bridge's training log clears Megatron's aux-loss tracker
        run.params.append([p.detach().cpu().clone() for c in context.model
                           for p in unwrap_model(c).parameters()])  # fmt: skip
        run.memory_method = (meter.method if meter is not None else None) or run.memory_method
        run.pool_bytes.append(result.pool_bytes)
        run.s_bytes.append(result.s_bytes)
        if progress is not None:
            progress(f"bridge {'ON ' if paged else 'OFF'} step {step['index'] + 1}/{cfg.steps}")

    callbacks = CallbackManager()
    for event, fn in (("on_train_start", on_train_start), ("on_train_step_start",
                      on_train_step_start), ("on_train_step_end", on_train_step_end)):  # fmt: skip
        callbacks.register(event, fn)
    world = dist.get_world_size()
    with contextlib.ExitStack() as stack:
        stack.enter_context(destroy_groups_made_inside())
        stack.enter_context(_metered_runner(meters))
        # The table is ab's: Bridge's set-up prints (its configuration summary, its timers)
        # and its notes (experimental API, deprecations) stay out of it; errors still raise.
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        _reset_aux_loss_tracker()
        try:
            config = _config(cfg, _provider(cfg, paged, ep, loop), world // cfg.pipeline_parallel)
            pretrain(config, forward_step, callbacks=callbacks)
        finally:
            destroy_global_state()
    return run


def run_bridge_ab(
    cfg: BridgeModelConfig,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> RankResult:
    """OFF then ON on this rank of an initialised process group (Bridge's ``pretrain()`` makes
    Megatron's parallel state and leaves the group)."""
    device = torch.device(device)
    world = dist.get_world_size()
    ep = cfg.ep or world // cfg.pipeline_parallel
    off = train(cfg, False, ep, device, progress)
    on = train(cfg, True, ep, device, progress)
    equal = same_steps(on, off)
    (manager,) = on.managers
    result = rank_result(
        dist.get_rank(), on.steps, off.steps, equal, manager.stats().host_pool_bytes,
        on.memory_method, [],
    )  # fmt: skip
    stages = cfg.pipeline_parallel
    result.stage = dist.get_rank() // (world // stages) if stages > 1 else 0
    return result
