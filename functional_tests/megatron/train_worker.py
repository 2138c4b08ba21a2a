"""Worker of the Megatron training-step functional test: ``run_cases`` on every rank.

Run by ``test_megatron_train.py`` through ``launch_workers.py`` (4 CPU ranks, gloo). Every case
trains a small Megatron ``GPTModel`` (te_paged's MoE spec with the static-budget dispatcher,
dropout 0.1, Megatron DDP with grad buffers, Megatron's Adam) for a few optimizer steps with
:class:`MegatronPagedStashRunner`, and compares runs step by step — loss, grad norm, every
parameter after the optimizer step and the MoE aux-loss tracker, bitwise
(:func:`te_paged.tools.megatron_ab.same_steps`):

* ``parity``: paged stash ON vs OFF, EP 2 and 4, ``overlap_grad_reduce`` off and on;
* ``over_budget``: rank 0's routing skewed past a 1.5 capacity factor (every rank reruns)
  vs a run that never goes over budget or overflows (factors 8); ``overflow``: a 0.3x pool
  vs a 8x pool; ``spill``: rank 0's 0.3x pool backed by a host tier (no rerun) vs the same;
* ``mutation_*``: ``over_budget`` again with the RNG restore, or the grad-buffer zeroing,
  removed from the runner — these must differ from the reference;
* ``desync``: rank 3 skips iteration 1; every rank must raise ``StepDesyncError``;
* ``recompute_*``: Megatron's full-layer and ``moe`` recompute with paged stash, ON vs OFF.

With ``TE_PAGED_TRAIN_CASES=release`` (:data:`CASES_ENV`) only the training step and the reruns
run: one ``parity`` case, ``over_budget`` and ``overflow`` (the earlier megatron-core release).

"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

STEPS = 3  # a capture step and two paged steps (each rerun, in the forced cases)
#: Small enough for the suite's time budget; every feature of the default engine model.
SMALL = {
    "layers": 2,
    "experts": 8,
    "hidden": 64,
    "ffn": 128,
    "heads": 2,
    "vocab": 128,
    "seq_length": 32,
    "micro_batch_size": 2,
    "microbatches": 2,
    "page_size": 8,
    "dropout": 0.1,
    "steps": STEPS,
    "max_consecutive_fallbacks": STEPS,  # forced cases rerun every step
    "measure_memory": False,  # the CLI test measures the saving
}
#: Parity cases must keep the stashing attempt: a pool with room for routing imbalance.
PARITY = {"buffer_factor_cuda": 1.6}
NEVER_OVERFLOWS = {"capacity_factor": 8.0, "buffer_factor_cuda": 8.0}


def config(**kw):
    from te_paged.tools.megatron_ab import MegatronModelConfig

    return MegatronModelConfig(**{**SMALL, **kw})


def summary(run, reference=None) -> dict:
    from te_paged.tools.megatron_ab import same_steps

    out = {
        name: [getattr(s, name) for s in run.steps]
        for name in ("attempt", "stash_overflow_ranks", "overbudget_ranks", "host_spill_ranks")
    }
    out["loss"] = [s.loss for s in run.steps]
    stats = run.managers[0].stats() if run.managers else None
    out["stashes_pops"] = [stats.stashes, stats.pops] if stats else None
    out["stashes_skipped"] = stats.stashes_skipped if stats else None
    out["capture_peak_pages"] = sum(stats.capture_peak_balanced_pages.values()) if stats else 0
    if reference is not None:
        out["equal"] = same_steps(run, reference)
    return out


@contextlib.contextmanager
def mutated(kind: str):
    """The runner with one guard removed (``rng``: no generator restore at all; ``grad_buffer``:
    DDP's grad buffers are not zeroed before the rerun)."""
    from megatron.core.tensor_parallel import random as mcore_random

    from te_paged.integrations.megatron import MegatronPagedStashRunner
    from te_paged.runtime import PagedStashRunner

    saved = []
    if kind == "rng":
        saved.append((PagedStashRunner, "restore_state", PagedStashRunner.restore_state))
        PagedStashRunner.restore_state = lambda self, state: None
        tracker_cls = mcore_random.CudaRNGStatesTracker
        saved.append((tracker_cls, "set_states", tracker_cls.set_states))
        tracker_cls.set_states = lambda self, states: None
    else:
        cls = MegatronPagedStashRunner
        saved.append((cls, "clear_gradients", cls.clear_gradients))

        def without_buffer_zeroing(self) -> None:
            PagedStashRunner.clear_gradients(self)
            self.optimizer.zero_grad()

        cls.clear_gradients = without_buffer_zeroing
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


#: ``all`` (default): every case; ``release``: the training step and the reruns
#: (:data:`RELEASE_PARITY`, ``over_budget``, ``overflow``), what the earlier megatron-core
#: release is tested with (the suite's time budget).
CASES_ENV = "TE_PAGED_TRAIN_CASES"
RELEASE_PARITY = ("ep4-overlap_True",)


def run_cases(rank: int, world: int, out: Path) -> dict:
    from te_paged.runtime import StepDesyncError
    from te_paged.tools.megatron_ab import megatron_parallel, train

    every = os.environ.get(CASES_ENV, "all") == "all"
    cpu = torch.device("cpu")
    results: dict = {"parity": {}}
    for ep in (2, 4):
        with megatron_parallel(ep):
            for overlap in (False, True):
                name = f"ep{ep}-overlap_{overlap}"
                if not every and name not in RELEASE_PARITY:
                    continue
                cfg = config(overlap_grad_reduce=overlap, **PARITY)
                off = train(cfg, False, ep, cpu, rank)
                on = train(cfg, True, ep, cpu, rank)
                results["parity"][name] = summary(on, off)
    ep = 4
    with megatron_parallel(ep):
        skew = {"skew": 2.0}
        skewed_reference = train(config(**skew, **NEVER_OVERFLOWS), True, ep, cpu, rank)
        results["reference_skewed"] = summary(skewed_reference)
        scenario = config(**skew, capacity_factor=1.5)
        run = train(scenario, True, ep, cpu, rank)
        results["over_budget"] = summary(run, skewed_reference)
        reference = train(config(buffer_factor_cuda=8.0), True, ep, cpu, rank)
        results["reference"] = summary(reference)
        overflow = train(config(buffer_factor_cuda=0.3, grow_pool=False), True, ep, cpu, rank)
        results["overflow"] = summary(overflow, reference)
        if not every:
            return results
        for kind in ("rng", "grad_buffer"):
            with mutated(kind):
                run = train(scenario, True, ep, cpu, rank)
            results[f"mutation_{kind}"] = summary(run, skewed_reference)
        spill = {"buffer_factor_cuda": 0.3, "buffer_factor_cpu": 8.0} if rank == 0 else {}
        # Rank 0's pool kept small and its own (not the group's largest), so it spills.
        spill.update(grow_pool=False, per_rank_pools=True)
        run = train(config(**{"buffer_factor_cuda": 8.0, **spill}), True, ep, cpu, rank)
        results["spill"] = summary(run, reference)

        for layer_recompute in ("full", "moe"):
            # Paging forced: under recompute every layer's backward follows its (recomputed)
            # forward at once, so the default (skip_immediate_backward) pages none of them.
            cfg = config(layer_recompute=layer_recompute, buffer_factor_cuda=2.0,
                         skip_immediate_backward=False)  # fmt: skip
            off = train(cfg, False, ep, cpu, rank)
            on = train(cfg, True, ep, cpu, rank)
            results[f"recompute_{layer_recompute}"] = summary(on, off)
            if layer_recompute == "full":  # the default: every layer kept, none paged
                default = config(layer_recompute="full", buffer_factor_cuda=2.0)
                run = train(default, True, ep, cpu, rank)
                results["recompute_full_default"] = summary(run, off)

        iterations = [0, 2, 3] if rank == world - 1 else [0, 1, 2]
        try:
            train(config(steps=3), True, ep, cpu, rank, iterations=iterations)
            results["desync"] = None
        except StepDesyncError as e:
            results["desync"] = str(e)
    return results
