"""The ``ab`` engines' model and run configurations and the benchmarks' default grid, without
torch: the command line's parser reads their defaults where only the ``jax`` extra is
installed. The engines
(:mod:`.model`, :mod:`.megatron_ab`, :mod:`.torchtitan_ab`; the jax engine's is
:class:`~te_paged.tools.jax_ab.JaxModelConfig`) re-export theirs."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from te_paged.config import MoEConfig

__all__ = [
    "MODELS",
    "RUNNERS",
    "STASH_HIDDEN_SIZES",
    "STASH_TOKEN_COUNTS",
    "BridgeModelConfig",
    "MegatronModelConfig",
    "ModelConfig",
    "TorchtitanModelConfig",
]

#: The stash benchmark's default grid (DeepSeek-V3's hidden size is 7168).
STASH_HIDDEN_SIZES = (1024, 2048, 4096, 7168)
STASH_TOKEN_COUNTS = (2048, 16384, 65536)


@dataclasses.dataclass
class ModelConfig:
    """The ``ab`` model and run. Defaults finish in about a minute on 2 CPU cores, 4 ranks."""

    layers: int = 8
    experts: int = 8
    topk: int = 2
    hidden: int = 256
    ffn: int = 512
    tokens: int = 512  # per rank and step
    capacity_factor: float = 2.0
    a2a_capacity_factor: float | None = None  # None: auto (starts at capacity_factor)
    buffer_factor_cuda: float = 1.10
    buffer_factor_cpu: float = 0.0
    page_size: int = 64
    fp8: str | None = None
    recompute: bool = False
    op_fuser: bool = False
    activation: str = "swiglu"
    steps: int = 3
    seed: int = 0
    skew: float = 0.0  # logits added to expert 0 on rank 0 (0 = none): forces over-budget
    grow_pool: bool = True  # the runner's grow_pool (False: the pools as the factors size them)
    grow_capacity: bool = True  # the runner's grow_capacity (False: the wire stays put)
    kernel_backend: str = "auto"
    skip_immediate_backward: bool = True  # moe_paged_stash_skip_immediate_backward
    #: torch.compile's backend for every MoE block ("inductor", "aot_eager"), fullgraph, as
    #: torchtitan compiles its blocks; None: eager. Default and torchtitan engines only.
    compile: str | None = None
    #: A variable-length run: per step, each microbatch's tokens per rank (step ``s`` takes
    #: entry ``s`` modulo the schedule's length; ``tokens`` is then the largest). None: one
    #: microbatch of ``tokens`` a step. Default engine only.
    token_schedule: tuple[tuple[int, ...], ...] | None = None
    #: moe_max_tokens_per_rank: the largest microbatch declared up front (None: the
    #: pools sized from the capture step, grown by the runner at each new maximum).
    max_tokens_per_rank: int | None = None

    def microbatches(self, step: int) -> tuple[int, ...]:
        """Tokens per rank of each microbatch of ``step``."""
        if self.token_schedule is None:
            return (self.tokens,)
        return tuple(self.token_schedule[step % len(self.token_schedule)])

    def moe_config(self, ep_size: int, paged: bool) -> MoEConfig:
        from te_paged.config import MoEConfig

        return MoEConfig(
            hidden_size=self.hidden,
            moe_ffn_hidden_size=self.ffn,
            num_moe_experts=self.experts,
            moe_router_topk=self.topk,
            activation=self.activation,
            moe_expert_rank_capacity_factor=self.capacity_factor,
            moe_a2a_capacity_factor=self.a2a_capacity_factor,
            moe_paged_stash=paged,
            moe_paged_stash_page_size=self.page_size,
            moe_paged_stash_buffer_size_factor_cuda=self.buffer_factor_cuda,
            moe_paged_stash_buffer_size_factor_cpu=self.buffer_factor_cpu,
            fp8=self.fp8,
            recompute_granularity="selective" if self.recompute else None,
            recompute_modules=["moe_act"] if self.recompute else [],
            use_transformer_engine_op_fuser=self.op_fuser,
            expert_model_parallel_size=ep_size,
            moe_paged_stash_kernel_backend=self.kernel_backend,
            moe_paged_stash_skip_immediate_backward=self.skip_immediate_backward,
            moe_max_tokens_per_rank=self.max_tokens_per_rank,
        )


@dataclasses.dataclass
class MegatronModelConfig(ModelConfig):
    """The ``ab --engine megatron`` model and run (defaults: about a minute, 4 CPU ranks)."""

    layers: int = 4  # the command line's default: 4 per pipeline stage (ab_command.py)
    experts: int = 8
    hidden: int = 128
    ffn: int = 256
    heads: int = 4
    vocab: int = 512
    seq_length: int = 128
    micro_batch_size: int = 2
    microbatches: int = 2
    ep: int | None = None  # expert-parallel size; None: the ranks of one pipeline stage
    pipeline_parallel: int = 1  # pipeline stages (Megatron's 1F1B schedule when > 1)
    virtual_stages: int | None = None  # virtual stages per rank: the interleaved schedule
    dropout: float = 0.1
    overlap_grad_reduce: bool = False
    layer_recompute: str | None = None  # "full" (every layer) or "moe" (the MoE layer)
    max_consecutive_fallbacks: int = 3  # the runner's runaway guard
    per_rank_pools: bool = False  # the runner's per_rank_pools (tests: one rank's own pool)
    measure_memory: bool = True  # the peak of every step (torch's trackers; slow on CPU)
    steps: int = 3
    #: Which runner drives the step: "te_paged" (MegatronPagedStashRunner, the user-written
    #: step) or "megatron" (Megatron's own PagedStashRunner, as Megatron-LM's pretrain() builds
    #: it; megatron-core 0.19.2), which te_paged's layers serve through MegatronLoopAdapter.
    runner: str = "te_paged"
    #: "gpt" (Megatron-core's GPTModel) or "hybrid" (0.19.2's HybridModel, attention and MoE
    #: layers alternating: :func:`hybrid_layer_pattern`).
    model: str = "gpt"
    #: megatron-core 0.19.2's flex backend beside the rank capacity factor: "ncclep" or
    #: "hybridep". Megatron's dispatcher is kept where its library imports (and NCCL EP can
    #: drop), e.g. the tests' stand-ins; te_paged's own dispatcher replaces it otherwise.
    flex_backend: str = "ncclep"
    #: A variable-length run (megatron-core's ``variable_seq_lengths``): per step, the sequence
    #: length of each microbatch (one value: every microbatch of the step), the list repeated
    #: over the steps; ``seq_length`` is then the largest. None: ``seq_length`` throughout.
    seq_schedule: tuple[tuple[int, ...], ...] | None = None

    def seq_lengths(self, step: int) -> tuple[int, ...]:
        """The sequence length of each microbatch of ``step``."""
        if self.seq_schedule is None:
            return (self.seq_length,) * self.microbatches
        entry = tuple(self.seq_schedule[step % len(self.seq_schedule)])
        return entry * self.microbatches if len(entry) == 1 else entry

    def __post_init__(self) -> None:
        self.tokens = self.seq_length * self.micro_batch_size  # per rank and microbatch
        if self.seq_schedule is not None:
            wrong = [e for e in self.seq_schedule if len(e) not in (1, self.microbatches)]
            if wrong:
                raise ValueError(
                    f"--seq-length: a step of the schedule gives {len(wrong[0])} sequence "
                    f"lengths for {self.microbatches} microbatches (--microbatches); give one "
                    "(every microbatch) or one per microbatch"
                )
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.flex_backend not in ("ncclep", "hybridep"):
            raise ValueError(f"flex_backend must be ncclep or hybridep, got {self.flex_backend!r}")


@dataclasses.dataclass
class BridgeModelConfig(MegatronModelConfig):
    """The ``ab --engine bridge`` model and run: the megatron engine's GPT model, trained by
    Megatron-Bridge's ``pretrain()``, whose step Megatron's own ``PagedStashRunner`` drives
    (``runner`` is ``"megatron"``, ``model`` ``"gpt"``: the only ones Bridge's loop has)."""

    runner: str = "megatron"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.runner != "megatron" or self.model != "gpt" or self.seq_schedule is not None:
            raise ValueError(
                "the bridge engine trains Bridge's GPTModel under Megatron's own "
                "PagedStashRunner, one sequence length: runner='megatron', model='gpt', no "
                f"seq_schedule (got {self.runner!r}, {self.model!r}, {self.seq_schedule!r})"
            )


#: The runners a Megatron step can be driven by (:attr:`MegatronModelConfig.runner`).
RUNNERS = ("te_paged", "megatron")
#: The models of the Megatron engine (:attr:`MegatronModelConfig.model`).
MODELS = ("gpt", "hybrid")


@dataclasses.dataclass
class TorchtitanModelConfig(ModelConfig):
    """The ``ab --engine torchtitan`` model and run (defaults: about a minute, 4 CPU ranks)."""

    layers: int = 4  # MoE layers (the L of the reload-adjusted model)
    dense_layers: int = 1  # dense layers first, as in DeepSeek-V3
    experts: int = 8
    hidden: int = 128
    ffn: int = 256  # the experts' hidden dim
    heads: int = 4
    vocab: int = 512
    seq_length: int = 128
    micro_batch_size: int = 2
    ep: int | None = None  # expert-parallel size; None: every rank
    activation_checkpoint: str | None = None  # "selective" (torchtitan's per-op SAC), "full"
    spmd_backend: str = "partial_dtensor"  # torch 2.13's FSDP2 does not take spmd_types
    max_consecutive_fallbacks: int = 3
    measure_memory: bool = True
    steps: int = 3
    #: torchtitan's HybridEP dispatcher (``moe_comm_backend="hybridep"``) in its non-blocking
    #: mode with this ``non_blocking_capacity_factor``, kept by te_paged (its overflows rerun);
    #: None: te_paged's static-budget dispatcher. HybridEP must import (tests: the stand-in).
    hybridep_factor: float | None = None
    #: HybridEP's ``pad_multiple`` (torchtitan's MXFP8 converter sets it): each local expert's
    #: block padded to this many rows. None: no padding.
    hybridep_pad_multiple: int | None = None
    #: ``skew`` goes to the first ``skew_experts`` experts' routing bias, on rank 0 only or on
    #: every rank (tests: a routing that fills one rank's experts from every rank).
    skew_experts: int = 1
    skew_every_rank: bool = False

    #: A variable-length run: per step, the batch's sequence length (one a step: torchtitan's
    #: Trainer trains one batch a step), the list repeated over the steps; ``seq_length`` is
    #: then the largest (the rotary table's length). None: ``seq_length`` throughout.
    seq_schedule: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        self.tokens = self.seq_length * self.micro_batch_size  # per rank and step
        if self.seq_schedule is not None and any(len(e) != 1 for e in self.seq_schedule):
            raise ValueError(
                "--seq-length: torchtitan's Trainer trains one batch a step, so a schedule "
                "gives one sequence length a step (e.g. 64,128), not a step's microbatches"
            )
