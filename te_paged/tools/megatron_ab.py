"""``te-paged ab --engine megatron``: paged stash ON vs OFF inside a real Megatron-core step.

The model is a small Megatron ``GPTModel``: Megatron's local layer spec for attention (with
dropout), te_paged's MoE spec for every MLP (so with a capacity factor, Megatron's ``MoELayer``
with te_paged's static-budget dispatcher and te_paged's experts), DeepSeek-V3-style routing
(sigmoid scores, aux-loss-free expert bias, a small sequence aux loss), Megatron's DDP with
grad buffers (``main_grad``), Megatron's optimizer (Adam, gradient clipping) and
``forward_backward_func`` driven by :class:`MegatronPagedStashRunner`. Per rank it runs the
same steps OFF, then ON, from the same seed and data, and records per step the loss, the grad
norm, the runner's record, the aux-loss tracker, the peak activation memory (of the steps
that can be the measured step: :func:`te_paged.tools.ab.measures`) and every parameter after
the optimizer step (compared bitwise ON vs OFF).

``S`` for this model, as for the default engine: the balanced-case bytes of the tensors the
stash pages at the capture step's peak of concurrently live rows — per MoE layer FC1's input
``[balanced, H]``, the activation's input ``[balanced, 2F]`` and probabilities ``[balanced]``
and FC2's input ``[balanced, F]``, where ``balanced = avg_num_tokens(max_num_tokens)`` rows and
the peak holds the layers of one microbatch (the no-pipelining schedule runs each
microbatch's backward before the next forward). With ``--pipeline-parallel`` (Megatron's 1F1B
schedule; ``--virtual-stages``: the interleaved one) a stage holds its in-flight microbatches'
layers at its peak, and the memory table is per stage.

``--skew`` adds that much to expert 0's routing bias on rank 0 (the expert bias only steers
selection), so rank 0 sends more than its pair budget to expert 0's rank: a forced
over-budget rerun. Needs megatron-core 0.16.1; on CPU the caller installs
:mod:`te_paged.integrations.megatron.cpu_shims` first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import math
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from te_paged.tools.ab import (
    NOT_MEASURED,
    RankResult,
    StepMeter,
    StepResult,
    capturing,
    rank_result,
    step_result,
)
from te_paged.tools.engine_configs import MegatronModelConfig

__all__ = [
    "MegatronModelConfig",
    "TrainRun",
    "destroy_groups_made_inside",
    "megatron_parallel",
    "quiet_megatron",
    "run_megatron_ab",
    "same_steps",
    "train",
]


def quiet_megatron() -> None:
    """Keep the table readable: silence what this tool's run always prints and is not about the
    run — megatron-core's import-time notes that TE and Apex are absent (and that its MIMO model,
    which 0.19.2's optimizer factory imports, is experimental), its transformer layer
    naming te_paged's MoE layer an "Unknown MLP type" (see docs/megatron.md), and torch's module
    tracker skipping hooks of modules already freed."""
    for message in (
        ".*Transformer Engine and Apex are not installed.*",
        ".*Apex is not installed.*",
        ".*Transformer Engine is not installed.*",
        "Module is None. Skipping",
        ".*absl.logging is not installed.*",  # megatron-core 0.19.2's hyper_comm_grid
        "full scope is deprecated",  # megatron-core 0.16.1's own default cuda_graph_scope
        # 0.19.2's get_megatron_optimizer imports its MIMO model to test for one
        "MimoModelConfig is experimental",
    ):
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("megatron.core.transformer.transformer_layer").setLevel(logging.ERROR)
    # 0.19.2 logs that GPTModel is deprecated (for HybridModel) once per model built.
    logging.getLogger("megatron.core.models.gpt.gpt_model").setLevel(logging.ERROR)


@dataclasses.dataclass
class TrainRun:
    """One run of :func:`train` on this rank."""

    steps: list[StepResult]
    params: list[list[torch.Tensor]]  # per step, after the optimizer step
    aux: list[dict[str, torch.Tensor]]  # per step, Megatron's aux-loss tracker
    managers: list
    pool_bytes: list[int] = dataclasses.field(default_factory=list)  # per step
    s_bytes: list[int] = dataclasses.field(default_factory=list)  # per step (see module doc)
    memory_method: str = NOT_MEASURED


def _transformer_config(cfg: MegatronModelConfig, ep: int, paged_stash_fields: dict[str, object]):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = {}
    if cfg.recompute:
        recompute = {"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}
    if cfg.layer_recompute == "full":  # every layer, one at a time (Megatron's reentrant ckpt)
        recompute = {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    elif cfg.layer_recompute == "moe":
        recompute = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    fields = {
        "moe_token_dispatcher_type": "alltoall",  # replaced by te_paged's static-budget one
        **recompute,
        **paged_stash_fields,  # 0.19.2: the flex dispatcher its capacity factor requires
    }
    return TransformerConfig(
        num_layers=cfg.layers * (2 if cfg.model == "hybrid" else 1),  # hybrid: *E per layer
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        ffn_hidden_size=cfg.ffn,
        num_moe_experts=cfg.experts,
        moe_ffn_hidden_size=cfg.ffn,
        moe_router_topk=cfg.topk,
        moe_grouped_gemm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=True,
        add_bias_linear=False,
        hidden_dropout=cfg.dropout,
        attention_dropout=cfg.dropout,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=1e-3,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=1e-4,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=cfg.pipeline_parallel,
        virtual_pipeline_model_parallel_size=cfg.virtual_stages,
        pipeline_dtype=torch.float32,
        # Microbatches of different lengths: the pipeline's stages send shapes first.
        variable_seq_lengths=cfg.seq_schedule is not None,
        use_cpu_initialization=True,
        **fields,
    )


def _paged_stash_fields(cfg: MegatronModelConfig, paged: bool) -> dict[str, object]:
    """te_paged's fields: on the config where the release has them (0.19.2: the user's own
    ``TransformerConfig``, as for Megatron's built-in stash), else keyword overrides."""
    return {
        "moe_expert_rank_capacity_factor": cfg.capacity_factor,
        "moe_a2a_capacity_factor": cfg.a2a_capacity_factor,
        "moe_paged_stash": paged,
        "moe_paged_stash_page_size": cfg.page_size,
        "moe_paged_stash_buffer_size_factor_cuda": cfg.buffer_factor_cuda,
        "moe_paged_stash_buffer_size_factor_cpu": cfg.buffer_factor_cpu,
        "moe_paged_stash_kernel_backend": cfg.kernel_backend,
        "moe_paged_stash_skip_immediate_backward": cfg.skip_immediate_backward,
        "use_transformer_engine_op_fuser": cfg.op_fuser,
    }


def microbatch(cfg: MegatronModelConfig, step: int, index: int, rank: int) -> torch.Tensor:
    """Token ids ``[micro_batch_size, seq_length + 1]`` of one microbatch (inputs and labels);
    a variable-length run's microbatch has its own length (:meth:`seq_lengths`)."""
    seed = ((cfg.seed * 1_000_003 + step) * 65_537 + index) * 1_031 + rank
    g = torch.Generator().manual_seed(seed)
    seq = cfg.seq_length if cfg.seq_schedule is None else cfg.seq_lengths(step)[index]
    return torch.randint(0, cfg.vocab, (cfg.micro_batch_size, seq + 1), generator=g)


def forward_step(data_iterator, model, before_forward: Callable[[], None] | None = None):
    """Megatron's ``forward_step_func``: the LM loss of one microbatch. ``before_forward`` (the
    CPU memory tracker's ``new_iteration``: each microbatch runs the same modules again) is
    called first."""
    from megatron.core.distributed import DistributedDataParallel

    if before_forward is not None:
        before_forward()

    tokens = next(data_iterator)
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
    # Megatron's DDP forward only calls its module. Calling the module directly keeps torch's
    # MemTracker working: it calls module.buffers(), which DDP shadows with its grad buffers.
    if isinstance(model, DistributedDataParallel):
        model = model.module
    output = model(inputs, positions, None, labels=labels)

    def loss_func(output_tensor: torch.Tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def _reset_aux_loss_tracker() -> None:
    """Drop Megatron's aux-loss entries. Megatron sizes each entry by the layer count of the
    first model that records it and only zeroes it afterwards, so a model of another depth built
    later in the process (a pipeline run after a 2-layer one) would index past its end."""
    try:  # megatron-core >= 0.17: a global MoEMetricsTracker
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # 0.16.1: the tracker is this global dict itself
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def _build(cfg: MegatronModelConfig, paged: bool, ep: int, device: torch.device, rank: int):
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from te_paged.integrations.megatron import (
        MegatronLoopAdapter,
        MegatronPagedStashRunner,
        PagedStashMoELayer,
        get_te_paged_moe_spec,
    )
    from te_paged.integrations.megatron.common import split_paged_stash_fields

    model_parallel_cuda_manual_seed(cfg.seed, force_reset_rng=True)
    torch.manual_seed(cfg.seed)
    _reset_aux_loss_tracker()
    native, overrides = split_paged_stash_fields(
        cfg.flex_backend, **_paged_stash_fields(cfg, paged)
    )
    tcfg = _transformer_config(cfg, ep, native)
    # The MLP spec is replaced below: ask for the plain one (no deprecation notice).
    loop = MegatronLoopAdapter(
        max_consecutive_fallbacks=cfg.max_consecutive_fallbacks,
        grow_pool=cfg.grow_pool,
        grow_capacity=cfg.grow_capacity,
    )
    if cfg.model == "hybrid":
        chunks = [_hybrid_model(cfg, tcfg, loop, device, overrides)]
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg.experts, moe_grouped_gemm=False)
        spec.submodules.mlp = get_te_paged_moe_spec(tcfg, device=device, loop=loop, **overrides)
        chunks = []
        for vp_stage in range(cfg.virtual_stages or 1):  # one model chunk per virtual stage
            vp = None if cfg.virtual_stages is None else vp_stage
            chunks.append(
                GPTModel(
                    config=tcfg,
                    transformer_layer_spec=spec,
                    vocab_size=cfg.vocab,
                    max_sequence_length=cfg.seq_length,
                    pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False,
                                                                       vp_stage=vp),
                    post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False,
                                                                       vp_stage=vp),
                    vp_stage=vp,
                ).to(device)
            )  # fmt: skip
    if cfg.skew and rank == 0:
        with torch.no_grad():
            for layer in (m for chunk in chunks for m in chunk.modules()):
                if isinstance(layer, PagedStashMoELayer):
                    layer.router.expert_bias[0] += cfg.skew
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=cfg.overlap_grad_reduce)
    ddp = [
        DistributedDataParallel(tcfg, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    tcfg.no_sync_func = [d.no_sync for d in ddp] if len(ddp) > 1 else ddp[0].no_sync
    tcfg.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0), ddp
    )
    if cfg.runner == "megatron":  # as Megatron-LM's train() builds it
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer.moe.paged_stash import PagedStashRunner

        return (
            ddp,
            optimizer,
            _MegatronsRunner(
                PagedStashRunner(tcfg, False, ddp, optimizer, get_forward_backward_func()),
                loop,
                ddp,
            ),
        )
    runner = MegatronPagedStashRunner(
        ddp,
        optimizer,
        max_consecutive_fallbacks=cfg.max_consecutive_fallbacks,
        grow_pool=cfg.grow_pool,
        per_rank_pools=cfg.per_rank_pools,
        max_tokens_per_rank=cfg.max_tokens_per_rank,  # ON and OFF: te_paged's dispatchers too
    )
    runner.grow_capacity = cfg.grow_capacity
    return ddp, optimizer, runner


class _MegatronsRunner:
    """Megatron's own ``PagedStashRunner`` with te_paged's call shape: ``runner(**kwargs) ->
    (result, the adapter's StepRecord)``, ``managers`` and ``before_rerun`` (unused: the
    memory meter's re-entry is te_paged's runner's hook)."""

    def __init__(self, megatron_runner: Callable[..., object], loop: object, ddp: list) -> None:
        from te_paged.integrations.megatron import paged_stash_managers

        self.megatron_runner, self.loop = megatron_runner, loop
        self.managers = paged_stash_managers(ddp)
        self.before_rerun = None
        #: Per step, the managers' statistics as the step left them: the adapter resets them
        #: when Megatron's runner keeps the step, after its ``on_record``.
        self.stats: list[list] = []
        #: Per step, the dispatchers' dropless reference bytes, read before that reset too.
        self.dropless_bytes: list[int] = []
        loop.on_record = self._on_record

    def _on_record(self, record: object) -> None:
        self.stats.append([m.stats() for m in self.managers])
        self.dropless_bytes.append(sum(int(d.dropless_bytes) for d in self.loop.dispatchers))

    def __call__(self, *, iteration: int | None = None, **kwargs: object):
        result = self.megatron_runner(**kwargs)
        return result, self.loop.records[-1]


def hybrid_layer_pattern(cfg: MegatronModelConfig) -> str:
    """``--model hybrid``'s ``HybridModel`` layer pattern: per MoE layer an attention layer and
    an MoE layer (``*E``), ``cfg.layers`` of them, split evenly over the pipeline stages
    (``|``). Example: 4 layers, 2 stages: ``*E*E|*E*E``."""
    per_stage = cfg.layers // cfg.pipeline_parallel
    return "|".join(["*E" * per_stage] * cfg.pipeline_parallel)


def _hybrid_model(cfg: MegatronModelConfig, tcfg, loop, device: torch.device, overrides: dict):
    """Megatron-core 0.19.2's ``HybridModel`` (:func:`hybrid_layer_pattern`) from Megatron's
    local layers (``local_hybrid_stack_spec``) with te_paged's MoE layers; learned absolute
    position embeddings, as the GPT engine's."""
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from te_paged.integrations.megatron import local_hybrid_stack_spec, with_te_paged_moe

    spec = with_te_paged_moe(
        local_hybrid_stack_spec(cfg.experts), tcfg, loop=loop, device=device, **overrides
    )
    return HybridModel(
        config=tcfg,
        hybrid_stack_spec=spec,
        vocab_size=cfg.vocab,
        max_sequence_length=cfg.seq_length,
        hybrid_layer_pattern=hybrid_layer_pattern(cfg),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type="learned_absolute",
    ).to(device)


@contextlib.contextmanager
def megatron_parallel(ep: int, pp: int = 1, vpp: int | None = None) -> Iterator[None]:
    """Megatron's model-parallel state with expert parallelism ``ep``, pipeline parallelism
    ``pp`` (``vpp`` virtual stages per rank) and TP = 1 inside; on exit, the process groups
    made inside are destroyed (:func:`destroy_groups_made_inside`)."""
    from megatron.core import parallel_state

    with destroy_groups_made_inside():
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=ep,
        )
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def destroy_groups_made_inside() -> Iterator[None]:
    """Destroy, on exit, every process group made inside the block, and collect the garbage
    that still holds them. Megatron's ``destroy_model_parallel`` only forgets its groups
    (about 20 per ``initialize_model_parallel`` on 4 ranks), and each gloo group keeps a TCP
    loop thread that wakes on a timer for as long as the group lives: measured on 2 CPU
    cores, 150 live groups cost each rank a fifth of a core while idle and made a fixed
    compute loop 60 % slower. A process that sets up Megatron's parallel state again and again
    (each case of a test worker) otherwise carries every earlier set-up's groups: the four
    Megatron workers' launch ended with 161 groups and 488 threads a rank, and took 250 s of
    CPU (214 s with this). Every rank must leave the block together, as it entered it (SPMD)."""
    from torch.distributed import distributed_c10d

    def groups() -> list[dist.ProcessGroup]:  # torch keeps no public list of the live groups
        return list(distributed_c10d._world.pg_map)

    def destroy(before: set[dist.ProcessGroup]) -> None:  # its frame holds no group after
        for group in groups():
            if group not in before:
                dist.destroy_process_group(group)

    before = set(groups())
    try:
        yield
    finally:
        destroy(before)
        gc.collect()  # the models and optimizers of the block hold groups in reference cycles


def train(
    cfg: MegatronModelConfig,
    paged: bool,
    ep: int,
    device: torch.device,
    rank: int,
    progress: Callable[[str], None] | None = None,
    iterations: list[int] | None = None,
) -> TrainRun:
    """``cfg.steps`` training steps (or the given ``iterations``, passed to the runner) of a
    fresh model, inside :func:`megatron_parallel`."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    ddp, optimizer, runner = _build(cfg, paged, ep, device, rank)
    run = TrainRun([], [], [], runner.managers)
    # The stages of one pipeline read the same microbatches: the data follows the data-parallel
    # rank (the global rank without pipelining).
    dp_rank = parallel_state.get_data_parallel_rank()
    for step in range(cfg.steps) if iterations is None else iterations:
        data = [microbatch(cfg, step, i, dp_rank) for i in range(cfg.microbatches)]
        # One iterator per model chunk (the interleaved schedule reads each chunk's own).
        iterators = [iter(data) for _ in ddp] if len(ddp) > 1 else iter(data)
        optimizer.zero_grad()
        for chunk in ddp:
            chunk.zero_grad_buffer()
        if cfg.runner == "te_paged":  # Megatron's runner: te_paged's adapter resets after a step
            for manager in runner.managers:
                manager.reset()  # allocates the pool after the capture step: outside the meter
        capture = capturing(runner.managers)
        with StepMeter(device, step, capture, cfg.measure_memory) as meter:
            runner.before_rerun = meter.new_iteration
            losses, record = runner(
                forward_step_func=functools.partial(
                    forward_step, before_forward=runner.before_rerun
                ),
                data_iterator=iterators,
                model=ddp,
                num_microbatches=cfg.microbatches,
                seq_length=cfg.seq_length,
                micro_batch_size=cfg.micro_batch_size,
                forward_only=False,
                iteration=step,
            )
        _, grad_norm, _ = optimizer.step()
        tracker = get_moe_layer_wise_logging_tracker()
        run.aux.append({n: e["values"].detach().cpu().clone() for n, e in tracker.items()})
        clear_aux_losses_tracker()  # as Megatron's training loop does after logging
        run.params.append(
            [p.detach().cpu().clone() for chunk in ddp for p in chunk.module.parameters()]
        )
        # Only the last pipeline stage computes the loss; the others report NaN (null in JSON).
        loss = torch.stack([x["lm loss"] for x in losses]).mean() if losses else torch.nan
        dispatchers = [] if isinstance(runner, _MegatronsRunner) else runner.dispatchers
        result = step_result(
            loss, grad_norm, record, meter.peak_bytes, capture, runner.managers, dispatchers
        )
        if isinstance(runner, _MegatronsRunner):  # the managers were reset after the step
            stats = runner.stats[-1]
            result.stashes, result.pops = sum(s.stashes for s in stats), sum(s.pops for s in stats)
            result.dropless_bytes = runner.dropless_bytes[-1]
        capture_tokens = getattr(runner, "capture_tokens", 0)
        if cfg.seq_schedule is not None and capture_tokens and record.max_microbatch_tokens:
            # S of this step's microbatches (te_paged.tools.ab: the balanced rows scale with
            # the tokens; under a pipeline, an estimate from the largest microbatch).
            result.s_bytes = round(result.s_bytes * record.max_microbatch_tokens / capture_tokens)
        run.steps.append(result)
        run.memory_method = meter.method or run.memory_method
        run.pool_bytes.append(run.steps[-1].pool_bytes)
        run.s_bytes.append(run.steps[-1].s_bytes)
        if progress is not None:
            progress(f"megatron {'ON ' if paged else 'OFF'} step {step + 1}/{cfg.steps}")
    return run


def same_steps(a: TrainRun, b: TrainRun) -> list[bool]:
    """Per step: loss, grad norm, every parameter after the optimizer step and the aux-loss
    tracker bitwise equal."""

    def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
        return len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))

    def same_float(x: float, y: float) -> bool:  # a stage without the loss has NaN in both
        return x == y or (math.isnan(x) and math.isnan(y))

    return [
        same_float(sa.loss, sb.loss)
        and sa.grad_norm == sb.grad_norm
        and same(pa, pb)
        and aa.keys() == ab.keys()
        and same(list(aa.values()), [ab[k] for k in aa])
        for sa, sb, pa, pb, aa, ab in zip(a.steps, b.steps, a.params, b.params, a.aux, b.aux)
    ]


def run_megatron_ab(
    cfg: MegatronModelConfig,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> RankResult:
    """OFF then ON on this rank of an initialised process group; Megatron's model-parallel
    state is initialised here (pipeline ``cfg.pipeline_parallel`` × EP ``cfg.ep``, default the
    ranks of one stage) and destroyed after."""
    from megatron.core import parallel_state

    device = torch.device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = cfg.ep or world // cfg.pipeline_parallel
    with megatron_parallel(ep, cfg.pipeline_parallel, cfg.virtual_stages):
        stage = parallel_state.get_pipeline_model_parallel_rank()
        off = train(cfg, False, ep, device, rank, progress)
        on = train(cfg, True, ep, device, rank, progress)
    equal = same_steps(on, off)
    (manager,) = on.managers
    result = rank_result(
        rank, on.steps, off.steps, equal, manager.stats().host_pool_bytes, on.memory_method, []
    )
    result.stage = stage
    return result
