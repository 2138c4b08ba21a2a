"""Worker of the Bridge ``pretrain()`` functional test: Megatron-Bridge's own training loop around
te_paged's MoE layers, many runs.

Run by ``test_bridge_pretrain.py`` on 4 CPU ranks (gloo) against megatron-bridge 0.6.2 and
megatron-core 0.19.2, with :mod:`te_paged.tools.preload_bridge` imported first (the CPU shims,
``cpu_shims.install(training_loop=True)``, before Bridge). Every run is one
``megatron.bridge.training.pretrain.pretrain(config, forward_step)`` call as a Bridge user
writes it: a ``GPTModelProvider`` (Megatron's local layers, the paged-stash fields Bridge's
perf recipes set: ``moe_expert_rank_capacity_factor``, ``moe_paged_stash``, the flex
dispatcher that te_paged's layer replaces on CPU), mock data, Bridge's ``gpt_step.forward_step``,
and te_paged's MoE layers through the provider's ``transformer_layer_spec`` (each run names
one of the forms a provider holds: a function of the provider given to ``with_te_paged_moe``,
``gpt_layer_spec``, DeepSeek-V3's ``partial(get_gpt_decoder_block_spec, ...)``). So Megatron's
own ``PagedStashRunner``, which Bridge builds, drives them (training and evaluation). The
process group is made before the runs (Bridge leaves it), and Bridge's global state is
destroyed after each.

Per iteration a Bridge callback keeps the loss, the grad norm and every parameter after the
optimizer step; another the evaluation losses. Every run: dropout 0.1, Bridge's DDP with
overlapped grad reduce, the distributed optimizer, an evaluation every 2 iterations (so
iteration 3 is the step right after one), 2 layers, EP 4, :data:`STEPS` iterations:

* ``off`` / ``on``: paged stash off / on (a pool of 1.6x the balanced pages); ``on`` also runs
  inference passes between the steps (:class:`InferencePasses`: before training, after every
  step, ``forward_backward_func(forward_only=True)`` in eval mode without autograd, 200 tokens
  a microbatch against training's 128) and saves a Bridge checkpoint at iteration 2;
* ``over_budget``: capacity factor 1.0 (every step and evaluation reruns); ``overflow``: a
  0.3x pool with ``grow_pool`` off (every paged step reruns), which saves at iteration 2 too.
  ``off`` (capacity factor 2.0) never goes over budget: what both must equal;
* ``resume`` / ``overflow_resume``: ``on`` / ``overflow`` loading their iteration-2 checkpoint
  and training iteration 3;
* ``pp2_off`` / ``pp2_on``: 2 pipeline stages (1F1B), EP 2; ``vpp_off`` / ``vpp_on``: the same
  with 2 virtual stages a rank (the interleaved schedule), 4 layers; 2 iterations of 2
  microbatches a stage.

Without the CPU shim ``bridge_dataloader_generator`` the forced reruns are not bitwise to
``off`` (each DataLoader iterator, the cyclic validation loader's included, draws its seed from
the generator dropout uses): run once with it removed, every iteration differed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path

import torch

STEPS = 3
WORLD = 4
#: The paged-stash fields as Bridge's perf recipes set them (capacity, the flex backend that
#: 0.19.2's config asks for beside it), at this test's scale.
STATIC = {
    "moe_token_dispatcher_type": "flex",
    "moe_flex_dispatcher_backend": "ncclep",
    "moe_expert_rank_capacity_factor": 2.0,
    "moe_paged_stash_page_size": 8,
}
STASH = {"moe_paged_stash": True, "moe_paged_stash_buffer_size_factor_cuda": 1.6}
NEVER_OVERFLOWS = {
    "moe_expert_rank_capacity_factor": 8.0,
    "moe_paged_stash_buffer_size_factor_cuda": 8.0,
}
PP2 = {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2}
VPP = {**PP2, "virtual_pipeline_model_parallel_size": 2, "num_layers": 4}
#: The inference passes' microbatches: 5 sequences of 40 tokens (training: 2 of 64).
PASS_BATCH, PASS_SEQ, PASS_MICROBATCHES = 5, 40, 2


def _runs(folder: Path) -> dict[str, dict]:
    on_ckpt, overflow_ckpt = str(folder / "on"), str(folder / "overflow")
    overflow = {**STATIC, **STASH, "moe_paged_stash_buffer_size_factor_cuda": 0.3}
    over_budget = {**STATIC, **STASH, "moe_expert_rank_capacity_factor": 1.0}
    every_step = {"max_consecutive_fallbacks": STEPS + 1}  # each of the STEPS reruns
    pipeline = {"iters": 2, "global_batch_size": 8}  # 2 microbatches a stage, 2 iterations
    return {
        "off": {"model": STATIC, "spec": "function"},
        "on": {"model": {**STATIC, **STASH}, "spec": "function", "passes": True,
               "save": on_ckpt},
        "over_budget": {"model": over_budget, "spec": "block", "loop": every_step},
        "overflow": {"model": overflow, "spec": "gpt_layer_spec", "loop": {"grow_pool": False},
                     "save": overflow_ckpt},
        "resume": {"model": {**STATIC, **STASH}, "spec": "function", "load": on_ckpt},
        "overflow_resume": {"model": overflow, "spec": "gpt_layer_spec",
                            "loop": {"grow_pool": False}, "load": overflow_ckpt},
        "pp2_off": {"model": {**STATIC, **PP2}, "spec": "function", **pipeline},
        "pp2_on": {"model": {**STATIC, **STASH, **PP2}, "spec": "function", **pipeline},
        "vpp_off": {"model": {**STATIC, **VPP}, "spec": "block", **pipeline},
        "vpp_on": {"model": {**STATIC, **STASH, **VPP}, "spec": "block", **pipeline},
    }  # fmt: skip


# ------------------------------------------------------------------------- the user's script


def layer_spec(kind: str, loop, **overrides):
    """The provider's ``transformer_layer_spec``: Megatron's local layers with te_paged's MoE
    layers, in one of the forms a Bridge provider holds (paged stash on or off as the
    provider's ``moe_paged_stash`` says; ``overrides``: te_paged's own fields, e.g.
    ``moe_max_tokens_per_rank``)."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from te_paged.integrations.megatron import gpt_layer_spec, with_te_paged_moe

    if kind == "function":  # a function of the provider, as Bridge's default is
        return with_te_paged_moe(local_layer_spec, None, loop=loop, **overrides)
    if kind == "gpt_layer_spec":
        return functools.partial(gpt_layer_spec, loop=loop, **overrides)
    # DeepSeek-V3's form: a partial of Megatron's block spec, called with vp_stage.
    return with_te_paged_moe(
        functools.partial(get_gpt_decoder_block_spec, use_transformer_engine=False), None,
        loop=loop, **overrides,
    )  # fmt: skip


def bridge_config(run: dict, loop, folder: Path):
    """The run's ``ConfigContainer``: a tiny GPT-MoE ``GPTModelProvider`` and Bridge's configs."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider
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

    model = {"num_layers": 2, "expert_model_parallel_size": WORLD, **run["model"]}
    provider = GPTModelProvider(
        hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=64,
        vocab_size=256, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
        gated_linear_unit=True, add_bias_linear=False, hidden_dropout=0.1, attention_dropout=0.1,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-4,
        transformer_impl="local", gradient_accumulation_fusion=False, persist_layer_norm=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False, apply_rope_fusion=False, params_dtype=torch.float32,
        transformer_layer_spec=layer_spec(run["spec"], loop, **run.get("overrides", {})),
        **model,
    )  # fmt: skip
    checkpoint = CheckpointConfig(ckpt_format="torch_dist", async_save=False)
    if "save" in run:
        checkpoint.save, checkpoint.save_interval = run["save"], 2
    if "load" in run:
        checkpoint.load, checkpoint.ckpt_step = run["load"], 2
    return ConfigContainer(
        model=provider,
        train=TrainingConfig(train_iters=run.get("iters", STEPS), micro_batch_size=2,
                             global_batch_size=run.get("global_batch_size", 16)),
        validation=ValidationConfig(eval_interval=2, eval_iters=1),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, clip_grad=1.0,
                                  use_distributed_optimizer=True, bf16=False, fp16=False),
        scheduler=SchedulerConfig(lr_decay_style="constant", start_weight_decay=0.01,
                                  end_weight_decay=0.01, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True,
                                          overlap_grad_reduce=True),
        dataset=MockGPTDatasetConfig(seq_length=64, random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False,
                                     num_workers=0, dataloader_type="single", pin_memory=False),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=256),
        checkpoint=checkpoint,
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(distributed_backend="gloo"),
    )  # fmt: skip


# ------------------------------------------------------------------------------ callbacks


def _stats(managers) -> list[list[int]]:
    return [[s.stashes, s.pops, s.stashes_skipped] for s in (m.stats() for m in managers)]


class Spies:
    """A Bridge callback: per iteration the loss, grad norm, parameters after the optimizer
    step; the evaluation losses; te_paged's adapters and, per record, its stash counts."""

    def __init__(self) -> None:
        self.loss: list[float] = []
        self.grad_norm: list[float] = []
        self.params: list[list[torch.Tensor]] = []
        self.eval_loss: list[float] = []
        self.loops: list = []
        self.managers: list = []
        self.stashes: list[list[list[int]]] = []
        self.expert_params: dict[str, int] = {}

    def on_train_start(self, context) -> None:
        from megatron.core.utils import unwrap_model

        from te_paged.integrations.megatron import PagedStashMoELayer, paged_stash_managers

        chunks = [unwrap_model(c) for c in context.model]
        layers = [m for c in chunks for m in c.modules() if isinstance(m, PagedStashMoELayer)]
        self.loops = list({id(m.loop): m.loop for m in layers}.values())
        self.managers = paged_stash_managers(chunks)
        # Where Megatron's DDP reduces te_paged's expert gradients: its expert buffers (over
        # the ranks holding the same experts), never the dense ones (over every data-parallel
        # rank: each local expert averaged with other ranks' different experts).
        experts = {id(p) for m in layers for p in m.experts.parameters()}
        for kind in ("buffers", "expert_parallel_buffers"):
            params = {id(p) for c in context.model for b in getattr(c, kind, ())
                      for p in b.param_index_map}  # fmt: skip
            self.expert_params[kind] = len(experts & params)
        for adapter in self.loops:
            adapter.on_record = lambda record: self.stashes.append(_stats(self.managers))

    def on_train_step_end(self, context) -> None:
        loss = (context.loss_dict or {}).get("lm loss")
        self.loss.append(float("nan") if loss is None else float(loss))
        self.grad_norm.append(float(context.grad_norm))
        self.params.append([p.detach().clone() for c in context.model for p in c.parameters()])

    def on_eval_end(self, context) -> None:
        loss = (context.total_loss_dict or {}).get("lm loss")
        self.eval_loss.append(float("nan") if loss is None else float(loss))


class InferencePasses:
    """A Bridge callback: an RL framework's logprob pass between training steps — before the
    first step (before the capture step) and after every step, ``forward_backward_func(
    forward_only=True)`` over microbatches unlike training's, in eval mode without autograd.
    Keeps each pass's summed logits and whether te_paged's stash counters, pools and managers'
    modes moved, and what te_paged logged meanwhile."""

    def __init__(self, spies: Spies) -> None:
        self.spies = spies
        self.sums: list[float] = []
        self.moved: list[str] = []
        self.said: list[str] = []

    def on_train_start(self, context) -> None:
        self._pass(context)

    def on_train_step_end(self, context) -> None:
        self._pass(context)

    def _pass(self, context) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        step = context.state.train_state.step
        generator = torch.Generator().manual_seed(100 + step)
        batches = [torch.randint(0, 256, (PASS_BATCH, PASS_SEQ), generator=generator)
                   for _ in range(PASS_MICROBATCHES)]  # fmt: skip
        positions = torch.arange(PASS_SEQ).expand(PASS_BATCH, PASS_SEQ)
        sums: list[torch.Tensor] = []

        def forward_step(data_iterator, model):
            logits = model(next(data_iterator), positions, None)

            def reduce(output):
                sums.append(output.float().sum())
                return output.float().sum() * 0, {}

            return logits, reduce

        managers = self.spies.managers
        before = self._state(managers)
        said: list[str] = []
        handler = _Keep(said)
        te_logger = logging.getLogger("te_paged")
        te_logger.addHandler(handler)
        try:
            for chunk in context.model:
                chunk.eval()
            with torch.no_grad():
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(batches),
                    model=context.model, num_microbatches=PASS_MICROBATCHES,
                    seq_length=PASS_SEQ, micro_batch_size=PASS_BATCH, forward_only=True,
                )  # fmt: skip
        finally:
            for chunk in context.model:
                chunk.train()
            te_logger.removeHandler(handler)
        after = self._state(managers)
        self.moved.append("" if before == after else f"{before} -> {after}")
        self.said.extend(said)
        if sums:  # the last pipeline stage's
            self.sums.append(float(torch.stack(sums).sum()))

    @staticmethod
    def _state(managers) -> list:
        return [
            (m.mode.name, _stats([m]), sorted((str(k), b.pool_bytes) for k, b in m.buffers.items()),
             int(m.flags.sum()))
            for m in managers
        ]  # fmt: skip


class _Keep(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


# ------------------------------------------------------------------------------ one run


def fresh_megatron_stash_manager() -> None:
    """A new process-global manager of Megatron's own paged stash for the run, as a process
    that runs one ``pretrain()`` has: its schedules size its per-chunk counters once, by the
    first run's virtual pipeline size (a run with 2 virtual stages after one without indexes
    past their end). te_paged keeps it empty; the CPU shim makes it without a CUDA stream."""
    from megatron.core.transformer.moe import paged_stash

    from te_paged.integrations.megatron import cpu_shims

    paged_stash.PagedStashManager.STASH_MGR = None
    cpu_shims.SHIMS["builtin_stash_manager"](None)


def pretrain_once(name: str, run: dict, folder: Path, log: list[str]) -> dict:
    """One Bridge ``pretrain()`` call (see the module docstring)."""
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.bridge.training.pretrain import pretrain

    from te_paged.integrations.megatron import MegatronLoopAdapter
    from te_paged.tools.megatron_ab import _reset_aux_loss_tracker, destroy_groups_made_inside

    start = time.perf_counter()
    loop = MegatronLoopAdapter(**run.get("loop", {}))
    spies = Spies()
    passes = InferencePasses(spies) if run.get("passes") else None
    callbacks = CallbackManager()
    for callback in (spies, passes):
        if callback is not None:
            for event in ("on_train_start", "on_train_step_end", "on_eval_end"):
                if hasattr(callback, event):
                    callbacks.register(event, getattr(callback, event))
    with contextlib.ExitStack() as stack:
        stack.enter_context(destroy_groups_made_inside())
        _reset_aux_loss_tracker()  # sized by the first model's layers: a 4-layer run follows
        fresh_megatron_stash_manager()
        try:
            pretrain(bridge_config(run, loop, folder), forward_step, callbacks=callbacks)
        finally:
            destroy_global_state()
    records = [r for adapter in spies.loops for r in adapter.records]
    out = {
        "loss": spies.loss,
        "grad_norm": spies.grad_norm,
        "params": spies.params,
        "eval_loss": spies.eval_loss,
        "attempt": [r.attempt for r in records],
        "enabled": [r.enabled for r in records],
        # Per record: ranks whose stash overflowed, ranks that went over budget.
        "flags": [[r.stash_overflow_ranks, r.overbudget_ranks] for r in records],
        "stashes_pops": spies.stashes,
        "fallbacks": sum(adapter.fallbacks for adapter in spies.loops),
        "loops": len(spies.loops),
        "expert_params": spies.expert_params,
        "log": [line for line in log if line.startswith("te_paged: iteration")],
        "seconds": time.perf_counter() - start,
    }
    if passes is not None:
        out["passes"] = {"sums": passes.sums, "moved": passes.moved, "said": passes.said}
    return out


def _same(a: dict, b: dict, iterations: slice = slice(None)) -> list[bool]:
    """Per iteration: loss, grad norm and every parameter bitwise equal (a NaN loss, on a
    stage without the loss, equals a NaN)."""

    def same_float(x: float, y: float) -> bool:
        return x == y or (x != x and y != y)

    return [
        same_float(la, lb) and ga == gb and all(torch.equal(p, q) for p, q in zip(pa, pb))
        for la, lb, ga, gb, pa, pb in zip(
            a["loss"][iterations], b["loss"][iterations], a["grad_norm"][iterations],
            b["grad_norm"][iterations], a["params"][iterations], b["params"][iterations],
        )
    ]  # fmt: skip


#: (run, the run it must equal). ``off`` never goes over budget nor overflows (its attempts are
#: checked): it is also the run the forced reruns must equal.
PAIRS = {
    "on": ("on", "off"),
    "over_budget": ("over_budget", "off"),
    "overflow": ("overflow", "off"),
    "pp2": ("pp2_on", "pp2_off"),
    "vpp": ("vpp_on", "vpp_off"),
}


def run_cases(rank: int, world: int, out: Path) -> dict:
    log: list[str] = []
    handler = _Keep(log)
    te_logger = logging.getLogger("te_paged.integrations.megatron.loop")
    te_logger.addHandler(handler)
    runs = {}
    try:
        for name, run in _runs(out / "checkpoints").items():
            log.clear()
            runs[name] = pretrain_once(name, run, out, log)
            if rank == 0:  # progress, in the launch's output
                print(f"bridge pretrain_worker: {name} {runs[name]['seconds']:.1f} s", flush=True)
    finally:
        te_logger.removeHandler(handler)
    result: dict = {"equal": {k: _same(runs[a], runs[b]) for k, (a, b) in PAIRS.items()}}
    # The resumed runs train iterations 3 and 4 alone: the same as the runs that saved.
    for resumed, saved in (("resume", "on"), ("overflow_resume", "overflow")):
        result["equal"][resumed] = _same(runs[resumed], {
            k: v[2:] if isinstance(v, list) else v for k, v in runs[saved].items()
        })  # fmt: skip
    result["eval_equal"] = {  # NaN on a stage without the loss
        k: str(runs[a]["eval_loss"]) == str(runs[b]["eval_loss"]) for k, (a, b) in PAIRS.items()
    }
    result["runs"] = {
        name: {k: v for k, v in r.items() if k != "params"} for name, r in runs.items()
    }
    return result
