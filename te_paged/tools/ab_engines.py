"""The engines ``te-paged ab`` runs, one registry: each engine's name, its words in ``--engine``'s
help, its model configuration, and the argument group of the flags only it takes. The command
line (:mod:`te_paged.cli`) composes the groups; ``ab``'s checks and runs look the engine up here.

Nothing here imports torch or a framework: the parser builds where only the ``jax`` extra is
installed. A flag more than one engine takes (``--ep``, ``--seq-length``, ``--compile``) is in
the shared engine group the command line builds; the checks in :mod:`.ab_command` refuse a flag
where its engine does not run.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

from te_paged.tools.argtypes import integer, knob, real

__all__ = ["AB_ENGINES", "AbEngine", "register"]

#: Group = what ``ArgumentParser.add_argument_group`` returns.
Group = argparse._ArgumentGroup


@dataclasses.dataclass(frozen=True)
class AbEngine:
    """One ``ab`` engine.

    ``summary``: what it runs, for ``--engine``'s help; ``short``: a few words for the engine
    group's title (None for the default engine, which needs no ``--engine``); ``config``: its
    model configuration class (imported when called); ``arguments``: adds the flags only this
    engine takes to the group it is given, titled ``title`` (None: it has none); ``takes``:
    another engine whose group's flags this one takes too (those it refuses, its checks name)."""

    name: str
    summary: str
    config: Callable[[], type]
    short: str | None = None
    title: str | None = None
    arguments: Callable[[Group], None] | None = None
    takes: str | None = None


#: name -> engine, in ``--engine``'s order (the default engine first).
AB_ENGINES: dict[str, AbEngine] = {}


def register(engine: AbEngine) -> AbEngine:
    if engine.name in AB_ENGINES:
        raise ValueError(f"an ab engine named {engine.name!r} is registered already")
    if (engine.arguments is None) != (engine.title is None):
        raise ValueError(f"ab engine {engine.name!r}: a group of flags needs a title, and only one")
    AB_ENGINES[engine.name] = engine
    return engine


def _default_config() -> type:
    from te_paged.tools.engine_configs import ModelConfig

    return ModelConfig


def _megatron_config() -> type:
    from te_paged.tools.engine_configs import MegatronModelConfig

    return MegatronModelConfig


def _bridge_config() -> type:
    from te_paged.tools.engine_configs import BridgeModelConfig

    return BridgeModelConfig


def _jax_config() -> type:
    from te_paged.tools.jax_ab import JaxModelConfig  # imports no JAX

    return JaxModelConfig


def _torchtitan_config() -> type:
    from te_paged.tools.engine_configs import TorchtitanModelConfig

    return TorchtitanModelConfig


def _default_arguments(g: Group) -> None:
    g.add_argument(
        "--record-profile",
        type=Path,
        help="write the OFF run's routing profile (JSON) for `te-paged plan` (default engine only)",
    )


def _megatron_arguments(g: Group) -> None:
    m = _megatron_config()()
    g.add_argument(
        "--dropout",
        type=real(0, 1, strict_max=True),
        help=f"hidden and attention dropout ({m.dropout}; megatron and bridge only)",
    )
    knob(
        g,
        "--microbatches",
        type=integer(1),
        help=f"microbatches per step, gradient accumulation ({m.microbatches}; megatron and "
        "bridge only)",
    )
    knob(
        g,
        "--pipeline-parallel",
        type=integer(1),
        help=f"pipeline-parallel stages, Megatron's 1F1B schedule ({m.pipeline_parallel}; "
        "megatron and bridge only; the expert-parallel size defaults to the ranks of one "
        "stage); the memory table is per stage",
    )
    knob(
        g,
        "--virtual-stages",
        type=integer(1),
        help="virtual pipeline stages per rank: Megatron's interleaved schedule (megatron "
        "and bridge only; needs --pipeline-parallel > 1)",
    )
    g.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="Megatron DDP's overlapped gradient all-reduce (megatron and bridge only)",
    )
    g.add_argument(
        "--model",
        choices=["gpt", "hybrid"],
        help="the Megatron model: gpt (GPTModel, the default) or hybrid (megatron-core 0.19.2's "
        "HybridModel, an attention and an MoE layer per --layers: *E*E...; megatron only)",
    )
    g.add_argument(
        "--runner",
        choices=["te_paged", "megatron"],
        help="what drives the step: te_paged (MegatronPagedStashRunner, the default) or megatron "
        "(Megatron's own PagedStashRunner, as Megatron-LM's pretrain() builds it, te_paged's "
        "layers serving its calls; megatron-core 0.19.2; megatron only)",
    )


def _torchtitan_arguments(g: Group) -> None:
    g.add_argument(
        "--activation-checkpoint",
        choices=["selective", "full"],
        help="torchtitan's activation checkpointing: per-op selective (SelectiveAC) or full "
        "(torchtitan only; default: none)",
    )


register(
    AbEngine(
        "default",
        "the embedded te_paged model",
        _default_config,
        title="default engine (the embedded te_paged model)",
        arguments=_default_arguments,
    )
)
register(
    AbEngine(
        "megatron",
        "Megatron-core's GPTModel with te_paged's MoE spec, Megatron DDP, optimizer and "
        "forward_backward_func under MegatronPagedStashRunner (needs megatron-core 0.19.2 or "
        "0.16.1)",
        _megatron_config,
        short="a Megatron-core GPTModel",
        title="megatron engine (Megatron-core's GPTModel, its DDP and pipeline schedules)",
        arguments=_megatron_arguments,
    )
)
register(
    AbEngine(
        "bridge",
        "Megatron-Bridge's own pretrain() on the megatron engine's GPT model (a GPTModelProvider "
        "with te_paged's MoE layers), its DDP, distributed optimizer and Megatron's own "
        "PagedStashRunner (needs megatron-bridge 0.6.2, docs/megatron-bridge.md)",
        _bridge_config,
        short="Megatron-Bridge's pretrain()",
        takes="megatron",  # --dropout, --microbatches, the pipeline's, --overlap-grad-reduce
    )
)
register(
    AbEngine(
        "jax",
        "te_paged.jax's ring-of-experts MoE stack in one process on CPU, memory from XLA's "
        "compiled memory analysis (needs the jax extra; model defaults: docs/jax.md)",
        _jax_config,
        short="te_paged.jax",
    )
)
register(
    AbEngine(
        "torchtitan",
        "a tiny torchtitan DeepSeek-V3 under te_paged's PagedStashTrainer (torchtitan's "
        "Trainer, FSDP2, EP mesh, AdamW; needs torchtitan 0.3.0, docs/torchtitan.md)",
        _torchtitan_config,
        short="torchtitan's Trainer and DeepSeek-V3 model",
        title="torchtitan engine (torchtitan's Trainer and DeepSeek-V3 model)",
        arguments=_torchtitan_arguments,
    )
)
