"""``te-paged ab --engine torchtitan``: paged stash ON vs OFF inside torchtitan's own Trainer.

The model is a tiny torchtitan DeepSeek-V3 (``DeepSeekV3Model``, built by torchtitan's
``_build_dsv3_layers``: MLA attention, ``dense_layers`` dense layers then ``layers`` MoE layers
with a shared expert, softmax top-k routing with an aux-loss-free expert bias), FlexAttention
swapped for torchtitan's ``ScaledDotProductAttention`` (FlexAttention has no CPU backward). Each
run is a :class:`~te_paged.integrations.torchtitan.PagedStashTrainer` — torchtitan's Trainer,
its FSDP2, expert parallelism on its ``ep`` mesh, AdamW, gradient clipping and the
load-balancing hook — whose config's ``te_paged`` section turns the MoE layers into te_paged's
(static-budget dispatcher, paged experts). OFF is the same trainer with
``moe_paged_stash=False``. Per rank it runs the same steps OFF, then ON, from the same seed and
data (a generator seeded by step and data-parallel rank), driving ``trainer.train_step`` itself,
and records per step the loss, the local gradient norm, the runner's record, the peak
activation memory (of the steps that can be the measured step:
:func:`te_paged.tools.ab.measures`) and every parameter shard after the optimizer step
(compared bitwise).

``S`` as for the other engines: the balanced-case bytes of the tensors the stash pages at the
capture step's peak — per MoE layer the bf16 expert input ``[T·K, D]`` and four ``[T·K, F]``
intermediates. ``--skew`` adds that much to expert 0's routing bias on rank 0 (selection only):
a forced over-budget rerun. On CPU the caller installs
:mod:`te_paged.integrations.torchtitan.cpu_shims` first.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from te_paged.tools.ab import (
    NOT_MEASURED,
    RankResult,
    StepMeter,
    StepResult,
    capturing,
    rank_result,
    step_result,
)
from te_paged.tools.engine_configs import TorchtitanModelConfig

__all__ = [
    "TorchtitanModelConfig",
    "TorchtitanRun",
    "model_spec",
    "offline_data",
    "quiet_torchtitan",
    "run_torchtitan_ab",
    "train",
    "trainer_config",
]


@dataclasses.dataclass
class TorchtitanRun:
    steps: list[StepResult]
    params: list[list[torch.Tensor]]  # per step, this rank's shards after the optimizer step
    grads: list[list[torch.Tensor]]  # per step, this rank's gradient shards (after clipping)
    managers: list
    memory_method: str = NOT_MEASURED


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def offline_data(vocab: int, seed: int = 0, seq_schedule: tuple[int, ...] | None = None):
    """``(tokenizer config, data loader config)``: torchtitan components that need no files or
    network (random token ids seeded by step and data-parallel rank), for the ``ab`` engine,
    the tests and docs/torchtitan.md's example; a job uses its own tokenizer and dataset.
    ``seq_schedule``: each step's sequence length, repeated (a variable-length run)."""
    tokenizer, loader = _data_classes()
    return tokenizer.Config(vocab=vocab), loader.Config(
        vocab=vocab, seed=seed, seq_schedule=seq_schedule
    )


@functools.cache
def _data_classes():
    """A tokenizer and a data loader as torchtitan components (offline, seeded)."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class Tokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab: int = 512

        def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
            super().__init__()
            self.vocab, self.eos_id = config.vocab, 0

        def encode(self, *args: object, **kwargs: object) -> list[int]:
            return [1]

        def decode(self, *args: object, **kwargs: object) -> str:
            return ""

        def get_vocab_size(self) -> int:
            return self.vocab

    class Loader(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab: int = 512
            seed: int = 0
            seq_schedule: tuple[int, ...] | None = None  # each step's length, repeated

        def __init__(self, config: Config, *, dp_rank: int, seq_len: int,
                     local_batch_size: int, **kwargs: object) -> None:  # fmt: skip
            self.config, self.rank = config, dp_rank
            self.seq_len, self.batch = seq_len, local_batch_size

        def __iter__(self) -> Iterator:
            step = 0
            while True:
                seed = (self.config.seed * 1_000_003 + step) * 1_031 + self.rank
                g = torch.Generator().manual_seed(seed)
                lengths = self.config.seq_schedule
                seq = self.seq_len if lengths is None else lengths[step % len(lengths)]
                t = torch.randint(0, self.config.vocab, (self.batch, seq + 1), generator=g)
                yield {"input": t[:, :-1]}, t[:, 1:]
                step += 1

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    return Tokenizer, Loader


def model_spec(cfg: TorchtitanModelConfig):
    """torchtitan's ``ModelSpec`` of the tiny DeepSeek-V3 (torchtitan's own MoE layers)."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
        parallelize_deepseekv3,
    )
    from torchtitan.protocols.model_spec import ModelSpec

    rope = 16
    layers = _build_dsv3_layers(
        n_layers=cfg.dense_layers + cfg.layers,
        n_dense_layers=cfg.dense_layers,
        dim=cfg.hidden,
        n_heads=cfg.heads,
        q_lora_rank=0,
        kv_lora_rank=cfg.hidden // 2,
        qk_nope_head_dim=cfg.hidden // cfg.heads,
        qk_rope_head_dim=rope,
        v_head_dim=cfg.hidden // cfg.heads,
        mscale=1.0,
        dense_hidden_dim=2 * cfg.ffn,
        moe_hidden_dim=cfg.ffn,
        num_experts=cfg.experts,
        num_shared_experts=1,
        router_top_k=cfg.topk,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard" if cfg.hybridep_factor is None else "hybridep",
        non_blocking_capacity_factor=cfg.hybridep_factor,
        rope=ComplexRoPE.Config(dim=rope, max_seq_len=cfg.seq_length, theta=10000.0),
    )
    model = DeepSeekV3Model.Config(
        vocab_size=cfg.vocab,
        dim=cfg.hidden,
        tok_embeddings=Embedding.Config(
            num_embeddings=cfg.vocab, embedding_dim=cfg.hidden, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=cfg.hidden, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=cfg.hidden,
            out_features=cfg.vocab,
            param_init=_output_linear_init(cfg.hidden),
        ),
        layers=layers,
        mtp_layers=[],
    )
    for _fqn, _node, parent, attr in list(model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    if cfg.hybridep_pad_multiple is not None:  # as torchtitan's MXFP8 converter sets it
        from torchtitan.models.common.token_dispatcher import HybridEPTokenDispatcher

        for _fqn, node, _parent, _attr in list(model.traverse(HybridEPTokenDispatcher.Config)):
            node.pad_multiple = cfg.hybridep_pad_multiple
    return ModelSpec(
        name="deepseek_v3",
        flavor="te-paged-ab",
        model=model,
        parallelize_fn=parallelize_deepseekv3,
        pipelining_fn=None,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=None,
    )


def trainer_config(cfg: TorchtitanModelConfig, paged: bool, world: int, dump_folder: str):
    """``PagedStashTrainer.Config`` of one run (``paged``: the stash ON)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from te_paged.integrations.torchtitan.trainer import PagedStashTrainer, TePagedConfig

    lengths = None if cfg.seq_schedule is None else tuple(e[0] for e in cfg.seq_schedule)
    tokenizer, loader = offline_data(cfg.vocab, cfg.seed, lengths)
    ac = {None: None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}
    # te_paged's budget knobs size its own dispatcher; a HybridEP model has its own budget and
    # refuses them (te_paged.integrations.torchtitan.moe.convert_node).
    budget = {} if cfg.hybridep_factor is not None else {
        "moe_expert_rank_capacity_factor": cfg.capacity_factor,
        "moe_a2a_capacity_factor": cfg.a2a_capacity_factor,
    }  # fmt: skip
    return PagedStashTrainer.Config(
        model_spec=model_spec(cfg),
        tokenizer=tokenizer,
        dataloader=loader,
        loss=CrossEntropyLoss.Config(global_vocab_size=cfg.vocab),
        optimizer=default_adamw(lr=1e-3),
        metrics=MetricsProcessor.Config(log_freq=10**9),
        training=TrainingConfig(
            local_batch_size=cfg.micro_batch_size,
            seq_len=cfg.seq_length,
            steps=cfg.steps,
            disable_cuda_graphs=True,
            max_norm=1.0,
        ),
        parallelism=ParallelismConfig(
            spmd_backend=cfg.spmd_backend if world > 1 else "spmd_types",
            expert_parallel_degree=cfg.ep or world,
        ),
        activation_checkpoint=ac[cfg.activation_checkpoint],
        compile=CompileConfig(
            enable=cfg.compile is not None, components=["model"], backend=cfg.compile or "inductor"
        ),
        debug=DebugConfig(seed=cfg.seed),
        dump_folder=dump_folder,
        te_paged=TePagedConfig(
            **budget,
            moe_paged_stash=paged,
            moe_paged_stash_page_size=cfg.page_size,
            moe_paged_stash_buffer_size_factor_cuda=cfg.buffer_factor_cuda,
            moe_paged_stash_buffer_size_factor_cpu=cfg.buffer_factor_cpu,
            moe_paged_stash_kernel_backend=cfg.kernel_backend,
            moe_paged_stash_skip_immediate_backward=cfg.skip_immediate_backward,
            grow_pool=cfg.grow_pool,
            grow_capacity=cfg.grow_capacity,
            max_tokens_per_rank=cfg.max_tokens_per_rank,
            max_consecutive_fallbacks=cfg.max_consecutive_fallbacks,
        ),
    )


def _skew(trainer, amount: float, experts: int = 1) -> None:
    """Add ``amount`` to the first ``experts`` experts' routing bias in every MoE layer of
    this rank."""
    with torch.no_grad():
        for module in trainer.model_parts[0].modules():
            bias = getattr(module, "expert_bias_E", None)
            if isinstance(bias, torch.Tensor) and hasattr(module, "router"):
                _local(bias)[:experts] += amount


def _static_tensors(trainer, params: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """What a step allocates that is not its activations or temporaries, for a measurement
    without ``MemTracker``'s categories (compiled code): the gradients torchtitan reallocates
    every step (``zero_grad(set_to_none=True)``) and the optimizer's states."""
    for p in params:
        if p.grad is not None:
            yield _local(p.grad)
    for optimizer in trainer.optimizers.optimizers:
        for state in optimizer.state.values():
            yield from (_local(v) for v in state.values() if isinstance(v, torch.Tensor))


def train(
    cfg: TorchtitanModelConfig,
    paged: bool,
    device: torch.device,
    progress: Callable[[str], None] | None = None,
) -> TorchtitanRun:
    """``cfg.steps`` steps of a fresh :class:`PagedStashTrainer` on this rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    os.environ.setdefault("LOCAL_RANK", str(rank if device.type == "cuda" else 0))
    with tempfile.TemporaryDirectory(prefix="te-paged-torchtitan-") as dump:
        if cfg.compile is not None:
            torch._dynamo.reset()  # OFF's graphs are not ON's
        trainer = trainer_config(cfg, paged, world, dump).build()
        try:
            if cfg.skew and (rank == 0 or cfg.skew_every_rank):
                _skew(trainer, cfg.skew, cfg.skew_experts)
            run = TorchtitanRun([], [], [], trainer.paged_stash_managers)
            data = trainer.batch_generator(trainer.dataloader)
            runner = trainer.paged_stash_runner
            params = [p for m in trainer.model_parts for p in m.parameters()]
            for step in range(cfg.steps):
                trainer.step = step + 1
                for manager in runner.managers:
                    manager.reset()  # allocates the pool after the capture step: unmeasured
                capture = capturing(runner.managers)
                compiled = cfg.compile is not None
                meter = StepMeter(
                    device, step, capture, cfg.measure_memory, compiled,
                    static=functools.partial(_static_tensors, trainer, params),
                )  # fmt: skip
                runner.before_rerun = meter.new_iteration
                with meter:
                    trainer.train_step(data)
                record = trainer.last_record
                grads = [_local(p.grad).detach().cpu().clone()
                         for p in params if p.grad is not None]  # fmt: skip
                norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
                run.grads.append(grads)
                run.params.append([_local(p).detach().cpu().clone() for p in params])
                loss = torch.stack([x.detach().float() for x in trainer.last_losses]).sum()
                peak = meter.peak_bytes
                run.steps.append(
                    step_result(
                        loss, norm, record, peak, capture, runner.managers, runner.dispatchers
                    )
                )
                if cfg.seq_schedule is not None and runner.capture_tokens:
                    # S of this step's batch (te_paged.tools.ab: balanced rows scale with tokens)
                    scale = record.max_microbatch_tokens / runner.capture_tokens
                    run.steps[-1].s_bytes = round(run.steps[-1].s_bytes * scale)
                run.memory_method = meter.method or run.memory_method
                if progress is not None:
                    progress(f"torchtitan {'ON ' if paged else 'OFF'} step {step + 1}/{cfg.steps}")
        finally:
            trainer.close()
    return run


def run_torchtitan_ab(
    cfg: TorchtitanModelConfig,
    device: torch.device | str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> RankResult:
    """OFF then ON on this rank of an initialised process group."""
    device = torch.device(device)
    off = train(cfg, False, device, progress)
    on = train(cfg, True, device, progress)

    def same(x: list[torch.Tensor], y: list[torch.Tensor]) -> bool:
        return len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))

    equal = [
        same(pa, pb) and same(ga, gb)
        for pa, pb, ga, gb in zip(on.params, off.params, on.grads, off.grads)
    ]
    host = sum(m.stats().host_pool_bytes for m in on.managers)
    reloads = max((m.reload_layers for m in on.managers), default=1)
    return rank_result(
        dist.get_rank(), on.steps, off.steps, equal, host, on.memory_method, [],
        reload_layers=reloads,
    )  # fmt: skip


def quiet_torchtitan() -> None:
    """Keep the table readable: torchtitan's log (its logger is the root logger: one INFO line
    per component built, and warnings about this CPU machine — no ``lspci``, an A100's peak
    FLOPs assumed, the process group already up), CPU autocast disabled in its router and
    DTensor's RNG notes on a CPU mesh. te_paged's own warnings (the runner's fallbacks) stay."""
    import logging
    import warnings

    from torchtitan.tools.logging import logger

    logger.setLevel(logging.ERROR)
    ours = logging.getLogger("te_paged")
    if ours.level == logging.NOTSET:  # no longer inherits the root's ERROR
        ours.setLevel(logging.WARNING)
    for message in (
        "In CPU autocast",  # the router asks for fp32 autocast, which CPU autocast lacks
        "DTensor .* may not have complete support on cpu",  # its RNG and manual_seed notes
    ):
        warnings.filterwarnings("ignore", message=message)
