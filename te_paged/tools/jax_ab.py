"""``te-paged ab --engine jax``: the ring-of-experts MoE stack of :mod:`te_paged.jax.moe` with
paged stash ON and OFF, in this one process (CPU), as the same :class:`~te_paged.tools.ab.
ABResult` the torch engines produce — the same table and run record.

Memory is XLA's compiled memory analysis of each step function (``jit(step).lower(...)
.compile().memory_analysis()``): ``temp_size_in_bytes``, the activations and temporaries XLA
allocates inside the step. The pool is an argument of the ON step (donated, carried from step
to step), so, as with the torch engines' pool allocated at the step boundary, the table adds it
to ON. The figure is static: every step of a run has the same one.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from te_paged.tools.ab_result import ABResult, StepResult, rank_result

__all__ = ["MEMORY_METHOD", "JaxModelConfig", "run_jax_ab"]

MEMORY_METHOD = (
    "XLA compiled memory analysis, temp_size_in_bytes (activations + temporaries; "
    "the pool, a donated argument, added to ON)"
)


@dataclasses.dataclass
class JaxModelConfig:
    """The jax engine's model and run: :class:`~te_paged.jax.moe.RingMoEConfig` under the ab
    flags' names. ``capacity_factor`` is ``ep``, not a flag: the ring-of-experts buffer holds
    every EP rank's tokens."""

    layers: int = 8
    experts: int = 8
    topk: int = 2
    hidden: int = 128
    ffn: int = 128
    tokens: int = 512  # per EP rank; this device sees ep × tokens
    ep: int = 4
    buffer_factor_cuda: float = 1.10
    page_size: int = 64
    steps: int = 3
    seed: int = 0
    skew: float = 0.0  # added to expert 0's router logit (a local expert): forces overflow
    grow_pool: bool = True  # the runner's grow_pool (False: the pool as the planner sized it)
    capacity_factor: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.capacity_factor = float(self.ep)

    def ring(self):
        """The model's config (imports JAX; raises ``ValueError`` on an invalid model)."""
        from te_paged.jax.moe import RingMoEConfig

        return RingMoEConfig(
            layers=self.layers,
            experts=self.experts,
            topk=self.topk,
            hidden=self.hidden,
            ffn=self.ffn,
            tokens=self.tokens,
            ep=self.ep,
            page_size=self.page_size,
            buffer_factor=self.buffer_factor_cuda,
            seed=self.seed,
        )


def _bitwise(a, b) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb)
    )


def run_jax_ab(cfg: JaxModelConfig, progress: Callable[[str], None] | None = None) -> ABResult:
    """OFF then ON for ``cfg.steps`` steps from the same weights and data; compare bitwise;
    measure both step functions."""
    from te_paged.jax.moe import PagedStepRunner, init_params, make_batch
    from te_paged.runtime.records import StepRecord

    ring = cfg.ring()
    runner = PagedStepRunner(ring, grow_pool=cfg.grow_pool)
    params0 = init_params(ring)
    batches = [make_batch(ring, step, cfg.skew) for step in range(cfg.steps)]

    @functools.cache
    def temp_bytes(step_fn, pages: int | None) -> int:
        """XLA's figure for ``step_fn`` with the pool of ``pages`` (compiled once per pool
        size; jit's cache then holds the executable the steps run)."""
        pool = None if pages is None else runner.pool
        compiled = step_fn.lower(params0, batches[0], pool).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    off_temp = temp_bytes(runner.plain_step, None)
    s_bytes = ring.s_bytes()

    off_steps, off_grads, params = [], [], params0
    for step, batch in enumerate(batches):
        out = runner.plain_step(params, batch, None)
        params = out.params
        off_grads.append(out.grads)
        record = StepRecord(
            step=step,
            attempt=1,
            enabled=False,
            stash_overflow_ranks=0,
            overbudget_ranks=0,
            host_spill_ranks=0,
            will_retry=False,
            pool_high_water_pages={},
            pool_pages={},
            peak_tokens=int(max(out.num_tokens_L)),
            budget_tokens=ring.max_rows,
            balanced_tokens=ring.balanced_rows,
        )
        off_steps.append(
            StepResult(
                loss=float(out.loss),
                grad_norm=float(out.grad_norm),
                attempt=1,
                enabled=False,
                stash_overflow_ranks=0,
                overbudget_ranks=0,
                host_spill_ranks=0,
                peak_bytes=off_temp,
                record=dataclasses.asdict(record),
            )
        )
        if progress is not None:
            progress(f"OFF step {step + 1}/{cfg.steps}")

    on_steps, equal, params = [], [], params0
    for step, batch in enumerate(batches):
        pool_bytes = runner.pool.nbytes  # the pool this step holds (grow_pool may grow it)
        on_temp = temp_bytes(runner.paged_step, runner.pool.num_pages)
        out, record = runner.step(params, batch)
        params = out.params
        equal.append(_bitwise(out.grads, off_grads[step]))
        paged = record.enabled
        if not paged:  # the rerun's memory, as the torch runner reports it
            record.fallback_peak_bytes, record.fallback_memory_method = off_temp, MEMORY_METHOD
        on_steps.append(
            StepResult(
                loss=float(out.loss),
                grad_norm=float(out.grad_norm),
                attempt=record.attempt,
                enabled=record.enabled,
                stash_overflow_ranks=record.stash_overflow_ranks,
                overbudget_ranks=record.overbudget_ranks,
                host_spill_ranks=record.host_spill_ranks,
                # A rerun ran both step functions, one after the other.
                peak_bytes=on_temp if paged else max(on_temp, off_temp),
                record=dataclasses.asdict(record),
                pool_bytes=pool_bytes if paged else 0,
                s_bytes=s_bytes if paged else 0,
                stashes=ring.layers,  # attempt 1: one stash per layer, each popped in backward
                pops=ring.layers,
            )
        )
        if progress is not None:
            progress(f"ON  step {step + 1}/{cfg.steps}")
    rank = rank_result(0, on_steps, off_steps, equal, 0, MEMORY_METHOD, [])
    return ABResult(dataclasses.asdict(cfg), 1, [rank])
