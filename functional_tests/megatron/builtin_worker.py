"""Worker of the megatron-core 0.19.2 built-in-stash functional test: ``run_cases`` per rank.

Run by ``test_megatron_builtin_stash.py`` through ``launch_workers.py`` (4 CPU ranks, gloo, EP
4) against megatron-core 0.19.2, whose ``TransformerConfig`` carries Megatron's own paged-stash
fields and whose ``megatron/core/transformer/moe/paged_stash.py`` holds a process-global stash
manager. The model is ``train_worker``'s (``te_paged.tools.megatron_ab``: a ``GPTModel``,
dropout 0.1, Megatron DDP and Adam), its config written as a user of Megatron's built-in stash
writes it (``moe_paged_stash=True``, ``moe_expert_rank_capacity_factor``, the ``"flex"``
dispatcher), with te_paged's MoE spec. Cases:

* ``inert``: paged stash ON vs OFF over 3 steps, with counting spies on Megatron's stash: under
  te_paged's runner Megatron's hooks do not run at all; driven by ``forward_backward_func``
  alone, the schedules' ``paged_stash_reset`` and ``GPTModel``'s chunk handler run, and
  Megatron's manager still allocates no ``PagedStashBuffer``, sees no saved tensor and holds
  no capture; te_paged's manager stashed and popped; ON == OFF bitwise;
* ``megatron_runner``: te_paged's layers under Megatron's own ``PagedStashRunner`` (what
  Megatron-LM's ``pretrain()`` builds), in a step of our own: ON vs OFF (and vs te_paged's
  runner) with spies on Megatron's stash, forced over budget (and again without the RNG
  restore), forced stash overflow, evaluations as ``evaluate()`` runs them;
* ``refusals``: Megatron's ``PagedStashRunner`` built beside te_paged's runner; te_paged's
  runner built around Megatron's own ``TEGroupedMLP`` on the op-fuser path with
  ``moe_paged_stash`` (Transformer Engine cannot be installed here, so the experts are
  Megatron's ``TEGroupedMLP`` over te_paged's linears with ``_with_fused_impl`` set, the one
  attribute Megatron's forward branches on);
* ``eval``: evaluation steps (``forward_only=True``, autograd on, no ``torch.no_grad()``)
  between training steps — and the same evaluation through the runner with ``forward_only``
  not passed on (``eval_mutation``), which stashes without popping;
* ``fallback_memory``: ``measure_fallback_memory=True`` with a ``forward_step`` that calls the
  DDP wrapper (which shadows ``nn.Module.buffers``), forced stash overflow;
* ``reruns``: a forced over-budget step under Megatron's ``PagedStashRunner`` (Megatron's own
  experts and alltoall dispatcher; the over-budget signal its runner reads, HybridEP's, is
  forced by the test on every step, since HybridEP cannot run on CPU) and under
  :class:`MegatronPagedStashRunner` (te_paged's layers, rank 0's routing skewed past the
  budget), each against the same model trained without any rerun.

"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from pathlib import Path

import torch

from functional_tests.megatron.train_worker import NEVER_OVERFLOWS, PARITY, config

STEPS = 3


@contextlib.contextmanager
def counting(owner: object, name: str, counts: dict[str, int], key: str):
    """Count the calls of ``owner.name`` (a test-only spy; restored on exit)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def spy(*args, **kwargs):
        counts[key] += 1
        return original(*args, **kwargs)

    setattr(owner, name, spy)
    try:
        yield
    finally:
        setattr(owner, name, original)


def step_kwargs(cfg, ddp, data: list, forward_step=None, forward_only: bool = False) -> dict:
    """``forward_backward_func``'s keyword arguments for one step over ``data``."""
    if forward_step is None:
        from te_paged.tools.megatron_ab import forward_step
    return {
        "forward_step_func": forward_step,
        "data_iterator": iter(data),
        "model": ddp,
        "num_microbatches": len(data),
        "seq_length": cfg.seq_length,
        "micro_batch_size": cfg.micro_batch_size,
        "forward_only": forward_only,
    }


@contextlib.contextmanager
def megatron_stash_spies(counts: dict[str, int]):
    """Count Megatron's stash hooks (the schedules' reset, GPTModel's chunk handler), its
    buffer allocations, the saved tensors it sees and its experts' entry into it."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.moe import experts, paged_stash

    spies = (
        (schedules, "paged_stash_reset", "reset"),
        (gpt_model, "paged_stash_init_chunk_handler", "chunk"),
        (paged_stash.PagedStashBuffer, "__init__", "buffers"),
        (paged_stash.PagedStashManager, "on_save_for_backward", "saved"),
        (experts, "paged_stash_group_start", "group"),  # Megatron's experts' entry
    )
    counts.update(dict.fromkeys((key for _, _, key in spies), 0))
    with contextlib.ExitStack() as stack:
        for owner, name, key in spies:
            stack.enter_context(counting(owner, name, counts, key))
        yield


def inert_case(ep: int, rank: int) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe import paged_stash

    from te_paged.tools.megatron_ab import _build, microbatch, same_steps, train

    cpu = torch.device("cpu")
    cfg = config(steps=STEPS, **PARITY)
    manager = paged_stash.PagedStashManager.get_instance()
    off = train(cfg, False, ep, cpu, rank)
    under_runner: dict[str, int] = {}
    with megatron_stash_spies(under_runner):
        on = train(cfg, True, ep, cpu, rank)
    stats = on.managers[0].stats()
    # The same model driven by forward_backward_func itself, no runner (an evaluation or a
    # script of the user's own): Megatron's hooks run, capture and "allocate" — nothing.
    ddp, _, _ = _build(cfg, True, ep, cpu, rank)
    direct: dict[str, int] = {}
    with megatron_stash_spies(direct):
        for step in range(2):  # Megatron's manager: capture, then captured (allocation)
            data = [microbatch(cfg, step, i, rank) for i in range(2)]
            get_forward_backward_func()(**step_kwargs(cfg, ddp, data))
    return {
        "under_runner": under_runner,
        "direct": direct,
        "megatron_status": manager.status,
        "megatron_stash_buffers": manager.stash_buffers,
        "megatron_captured": manager.max_tokens_across_vp_stages,
        "megatron_pending": len(manager.paged_tensors_to_stash)
        + len(manager.paged_tensors_stash_in_progress),
        "te_paged_stashes_pops": [stats.stashes, stats.pops],
        "attempt": [s.attempt for s in on.steps],
        "equal": same_steps(on, off),
    }


def refusals_case(ep: int, rank: int) -> dict:
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.paged_stash import PagedStashRunner

    from te_paged.integrations.megatron import (
        MegatronPagedStashRunner,
        get_te_paged_linear_moe_spec,
    )
    from te_paged.tools.megatron_ab import _build

    out = {}
    ddp, optimizer, _ = _build(config(steps=1), True, ep, torch.device("cpu"), rank)
    tcfg = ddp[0].module.config
    try:
        PagedStashRunner(tcfg, False, ddp, optimizer, get_forward_backward_func())
        out["megatron_runner"] = None
    except TypeError as e:
        out["megatron_runner"] = str(e)
    # Megatron's MoELayer would build the flex dispatcher this config names: alltoall here.
    layer_config = copy.copy(tcfg)
    layer_config.moe_token_dispatcher_type = "alltoall"
    layer = get_te_paged_linear_moe_spec()(config=layer_config)
    (experts,) = [m for m in layer.modules() if isinstance(m, TEGroupedMLP)]
    for fused in (True, False):  # True: what use_transformer_engine_op_fuser gives with TE
        experts._with_fused_impl = fused
        try:
            MegatronPagedStashRunner([layer])
            out[f"te_paged_runner_fused_{fused}"] = None
        except ValueError as e:
            out[f"te_paged_runner_fused_{fused}"] = str(e)
    return out


def _eval_step(runner, ddp, cfg, step: int, rank: int, forward_only: bool):
    from te_paged.tools.megatron_ab import microbatch

    data = [microbatch(cfg, 1000 + step, i, rank) for i in range(cfg.microbatches)]
    kwargs = step_kwargs(cfg, ddp, data, forward_only=True)
    if forward_only:
        return runner(iteration=step, **kwargs)
    # The runner as it was before it knew evaluation steps: Megatron's schedule still runs
    # forward only, but the runner stashes as for training.
    from megatron.core.pipeline_parallel import get_forward_backward_func

    func = get_forward_backward_func()
    return runner.step(lambda: func(**{**kwargs, "data_iterator": iter(data)}), step=step)


def eval_case(ep: int, rank: int, forward_only: bool) -> dict:
    from te_paged.runtime import FallbackLimitError
    from te_paged.tools.megatron_ab import _build, microbatch

    cfg = config(steps=1, max_consecutive_fallbacks=3, **PARITY)
    ddp, optimizer, runner = _build(cfg, True, ep, torch.device("cpu"), rank)
    (manager,) = runner.managers
    out: dict = {"train_attempt": [], "eval": [], "error": None}

    def train_step(step: int) -> None:
        data = [microbatch(cfg, step, i, rank) for i in range(cfg.microbatches)]
        optimizer.zero_grad()
        for chunk in ddp:
            chunk.zero_grad_buffer()
        _, record = runner(iteration=step, **step_kwargs(cfg, ddp, data))
        optimizer.step()
        out["train_attempt"].append(record.attempt)

    try:
        train_step(0)  # capture
        train_step(1)  # paged
        for i in range(4):  # more evaluations in a row than max_consecutive_fallbacks (3)
            with torch.enable_grad():
                losses, record = _eval_step(runner, ddp, cfg, 2 + i, rank, forward_only)
            stats = manager.stats()
            out["eval"].append(
                {
                    "attempt": record.attempt,
                    "stash_overflow_ranks": record.stash_overflow_ranks,
                    "enabled": record.enabled,
                    "stashes": stats.stashes,
                    "consecutive_fallbacks": runner.consecutive_fallbacks,
                    "losses": len(losses),
                    "pool_pages": sum(stats.pool_pages.values()),
                }
            )
        train_step(6)  # training goes on, paged
    except FallbackLimitError as e:
        out["error"] = str(e)
    return out


def fallback_memory_case(ep: int, rank: int) -> dict:
    from te_paged.integrations.megatron import MegatronPagedStashRunner
    from te_paged.tools.megatron_ab import _build, microbatch

    cfg = config(steps=1, buffer_factor_cuda=0.3)  # kept small: every step after capture overflows
    ddp, optimizer, _ = _build(cfg, True, ep, torch.device("cpu"), rank)
    runner = MegatronPagedStashRunner(ddp, optimizer, grow_pool=False, measure_fallback_memory=True)

    def forward_step(data_iterator, model):  # calls the DDP wrapper, as users' steps do
        tokens = next(data_iterator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(inputs.shape[1]).expand_as(inputs)
        output = model(inputs, positions, None, labels=labels)
        return output, lambda t: (t.float().mean(), {"lm loss": t.float().mean().detach()})

    records = []
    for step in range(2):
        optimizer.zero_grad()
        for chunk in ddp:
            chunk.zero_grad_buffer()
        data = [microbatch(cfg, step, i, rank) for i in range(2)]
        _, record = runner(iteration=step, **step_kwargs(cfg, ddp, data, forward_step))
        optimizer.step()
        records.append(
            {
                "attempt": record.attempt,
                "fallback_peak_bytes": record.fallback_peak_bytes,
                "fallback_memory_method": record.fallback_memory_method,
            }
        )
    return {"records": records}


def _megatron_own_model(cfg, ep: int):
    """The same GPT with Megatron's own MoE layer (SequentialMLP experts, alltoall dispatcher),
    DDP and Adam, and Megatron's ``PagedStashRunner`` (reads and clears the over-budget signal
    of each layer's dispatcher)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from te_paged.tools.megatron_ab import _transformer_config

    model_parallel_cuda_manual_seed(cfg.seed, force_reset_rng=True)
    torch.manual_seed(cfg.seed)
    clear_aux_losses_tracker()
    tcfg = _transformer_config(cfg, ep, {})
    spec = get_gpt_layer_local_spec(num_experts=cfg.experts, moe_grouped_gemm=False)
    model = GPTModel(tcfg, spec, vocab_size=cfg.vocab, max_sequence_length=cfg.seq_length)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        # HybridEP's over-budget interface, which Megatron's runner reads; the test forces it.
        d = layer.token_dispatcher
        d._comm_manager = types.SimpleNamespace(moe_expert_rank_capacity_factor=None)
        d.check_over_budget = functools.partial(
            lambda d: torch.tensor([d._comm_manager.moe_expert_rank_capacity_factor is not None]),
            d,
        )
        d.reset_over_budget = lambda: None
    ddp = DistributedDataParallel(tcfg, DistributedDataParallelConfig(), model)
    tcfg.no_sync_func = ddp.no_sync
    tcfg.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0), [ddp]
    )
    return [ddp], optimizer, layers


def train_megatron_runner(cfg, ep: int, rank: int, forced: bool):
    """``cfg.steps`` steps under Megatron's ``PagedStashRunner``; ``forced``: every step's first
    attempt reports over budget (what HybridEP reports after dropping tokens)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )
    from megatron.core.transformer.moe.paged_stash import PagedStashRunner

    from te_paged.tools.ab import StepResult
    from te_paged.tools.megatron_ab import TrainRun, microbatch

    ddp, optimizer, layers = _megatron_own_model(cfg, ep)
    runner = PagedStashRunner(ddp[0].module.config, False, ddp, optimizer, None)
    attempts = []

    def counted(**kwargs):
        attempts[-1] += 1
        return get_forward_backward_func()(**kwargs)

    runner.forward_backward_func = counted
    run = TrainRun([], [], [], [])
    for step in range(cfg.steps):
        for layer in layers:
            layer.token_dispatcher._comm_manager.moe_expert_rank_capacity_factor = (
                1.0 if forced else None
            )
        optimizer.zero_grad()
        ddp[0].zero_grad_buffer()
        attempts.append(0)
        data = [microbatch(cfg, step, i, rank) for i in range(cfg.microbatches)]
        losses = runner(**step_kwargs(cfg, ddp, data))
        _, grad_norm, _ = optimizer.step()
        tracker = get_moe_layer_wise_logging_tracker()
        run.aux.append({n: e["values"].detach().clone() for n, e in tracker.items()})
        clear_aux_losses_tracker()
        run.params.append([p.detach().clone() for p in ddp[0].module.parameters()])
        loss = torch.stack([x["lm loss"] for x in losses]).mean()
        run.steps.append(
            StepResult(float(loss), float(grad_norm), attempts[-1], False, 0, 0, 0, 0, {})
        )
    return run


def reruns_case(ep: int, rank: int) -> dict:
    from te_paged.tools.megatron_ab import same_steps, train

    cpu = torch.device("cpu")
    cfg = config(steps=STEPS)
    reference = train_megatron_runner(cfg, ep, rank, forced=False)
    forced = train_megatron_runner(cfg, ep, rank, forced=True)
    megatron = {
        "attempt": [s.attempt for s in forced.steps],
        "reference_attempt": [s.attempt for s in reference.steps],
        "equal": same_steps(forced, reference),
        "loss": [s.loss for s in forced.steps],
        "reference_loss": [s.loss for s in reference.steps],
        "max_param_diff": [
            max(float((a - b).abs().max()) for a, b in zip(pa, pb))
            for pa, pb in zip(forced.params, reference.params)
        ],
    }
    skew = {"skew": 2.0}
    te_reference = train(config(steps=STEPS, **skew, **NEVER_OVERFLOWS), True, ep, cpu, rank)
    te_forced = train(config(steps=STEPS, **skew, capacity_factor=1.5), True, ep, cpu, rank)
    te_paged = {
        "attempt": [s.attempt for s in te_forced.steps],
        "reference_attempt": [s.attempt for s in te_reference.steps],
        "equal": same_steps(te_forced, te_reference),
    }
    return {"megatron": megatron, "te_paged": te_paged}


def megatron_runner_case(ep: int, rank: int) -> dict:
    """te_paged's layers under Megatron's own ``PagedStashRunner`` (what Megatron-LM's
    ``pretrain()`` builds around ``forward_backward_func``), in a training step of our own."""
    from functional_tests.megatron.train_worker import mutated
    from te_paged.tools.megatron_ab import same_steps, train

    cpu = torch.device("cpu")
    out: dict = {}

    def attempts(run) -> list[int]:
        return [s.attempt for s in run.steps]

    off = train(config(steps=STEPS, runner="megatron", **PARITY), False, ep, cpu, rank)
    counts: dict[str, int] = {}
    with megatron_stash_spies(counts):
        on = train(config(steps=STEPS, runner="megatron", **PARITY), True, ep, cpu, rank)
    te_runner = train(config(steps=STEPS, **PARITY), True, ep, cpu, rank)
    out["parity"] = {
        "equal": same_steps(on, off),
        "equal_te_paged_runner": same_steps(on, te_runner),
        "attempt": attempts(on),
        "stashes_pops": [[s.stashes, s.pops] for s in on.steps],
        "megatron_counts": counts,
    }
    skew = {"skew": 2.0}
    reference = train(config(steps=STEPS, runner="megatron", **skew, **NEVER_OVERFLOWS), True,
                      ep, cpu, rank)  # fmt: skip
    forced = config(steps=STEPS, runner="megatron", **skew, capacity_factor=1.5)
    run = train(forced, True, ep, cpu, rank)
    out["over_budget"] = {
        "equal": same_steps(run, reference),
        "attempt": attempts(run),
        "reference_attempt": attempts(reference),
        "overbudget_ranks": [s.overbudget_ranks for s in run.steps],
    }
    with mutated("rng"):
        run = train(forced, True, ep, cpu, rank)
    out["mutation_rng"] = {"equal": same_steps(run, reference), "attempt": attempts(run)}
    roomy = train(config(steps=STEPS, runner="megatron", **NEVER_OVERFLOWS), True, ep, cpu, rank)
    small = config(steps=STEPS, runner="megatron", buffer_factor_cuda=0.3, grow_pool=False)
    run = train(small, True, ep, cpu, rank)
    out["overflow"] = {
        "equal": same_steps(run, roomy),
        "attempt": attempts(run),
        "stash_overflow_ranks": [s.stash_overflow_ranks for s in run.steps],
    }
    out["eval"] = _megatron_runner_eval(ep, rank)
    out["unchecked"] = _unchecked_step(ep, rank)
    out["host_reads"] = _adapter_host_reads(ep, rank)
    for runner in ("te_paged", "megatron"):  # HybridModel, in a step of our own
        cfg = config(steps=STEPS, runner=runner, model="hybrid", **PARITY)
        on, off = train(cfg, True, ep, cpu, rank), train(cfg, False, ep, cpu, rank)
        out[f"hybrid_{runner}"] = {
            "equal": same_steps(on, off),
            "attempt": attempts(on),
            "stashes_pops": [[s.stashes, s.pops] for s in on.steps],
        }
    return out


def _adapter_host_reads(ep: int, rank: int) -> list[str]:
    """The adapter's calls inside a paged step — each layer's forward, Megatron's check, the
    kept step's boundary — under the host-read guard (``tests.host_reads``); the capture step
    (which reads counts on the host by design) runs unguarded. The host reads found."""
    from te_paged.integrations.megatron.loop import MegatronLoopAdapter
    from te_paged.tools.megatron_ab import _build, microbatch
    from tests.host_reads import NoHostReads

    cfg = config(steps=1, runner="megatron", **PARITY)
    ddp, optimizer, runner = _build(cfg, True, ep, torch.device("cpu"), rank)
    runner.loop.on_record = None  # the tool's statistics read the flags on the host
    found: list[str] = []

    def guarded(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            try:
                with NoHostReads():
                    return method(self, *args, **kwargs)
            except AssertionError as e:
                found.append(f"{method.__name__}: {e}")
                raise

        return call

    for step in range(2):
        data = [microbatch(cfg, step, i, rank) for i in range(cfg.microbatches)]
        optimizer.zero_grad()
        for chunk in ddp:
            chunk.zero_grad_buffer()
        if step == 1:  # paged: every call of the adapter's under the guard
            stack = contextlib.ExitStack()
            for name in ("on_forward", "check", "_keep"):
                method = getattr(MegatronLoopAdapter, name)
                stack.callback(setattr, MegatronLoopAdapter, name, method)
                setattr(MegatronLoopAdapter, name, guarded(method))
            with stack:
                _, record = runner(**step_kwargs(cfg, ddp, data))
            found.append(f"attempt {record.attempt}, enabled {record.enabled}")
        else:
            runner(**step_kwargs(cfg, ddp, data))
        optimizer.step()
    return found


def _unchecked_step(ep: int, rank: int) -> str | None:
    """Megatron's runner built around te_paged's layers, then a step that bypasses it: the
    optimizer step after it raises (its flags were never read)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from te_paged.tools.megatron_ab import _build, microbatch

    cfg = config(steps=1, runner="megatron")
    ddp, optimizer, _ = _build(cfg, True, ep, torch.device("cpu"), rank)  # builds its runner
    data = [microbatch(cfg, 0, i, rank) for i in range(cfg.microbatches)]
    get_forward_backward_func()(**step_kwargs(cfg, ddp, data))
    try:
        optimizer.step()
    except RuntimeError as e:
        return str(e)
    return None


def _megatron_runner_eval(ep: int, rank: int) -> dict:
    """Evaluations as Megatron-LM's ``evaluate()`` runs them (a runner of their own without an
    optimizer, eval mode, ``torch.no_grad()``, ``forward_only``) between training steps that
    go over budget: they rerun too, and never count towards the fallback limit."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.paged_stash import PagedStashRunner

    from te_paged.tools.megatron_ab import _build, microbatch

    cfg = config(steps=1, runner="megatron", skew=2.0, capacity_factor=1.5,
                 max_consecutive_fallbacks=3)  # fmt: skip
    ddp, optimizer, runner = _build(cfg, True, ep, torch.device("cpu"), rank)
    loop = runner.loop
    out: dict = {"train": [], "eval": [], "error": None}

    def train_step(step: int) -> None:
        data = [microbatch(cfg, step, i, rank) for i in range(cfg.microbatches)]
        optimizer.zero_grad()
        for chunk in ddp:
            chunk.zero_grad_buffer()
        _, record = runner(**step_kwargs(cfg, ddp, data))
        optimizer.step()
        out["train"].append([record.attempt, loop.fallbacks])

    try:
        train_step(0)
        train_step(1)
        evaluator = PagedStashRunner(ddp[0].module.config, False, ddp, None,
                                     get_forward_backward_func())  # fmt: skip
        for chunk in ddp:
            chunk.eval()
        with torch.no_grad():
            for i in range(4):  # more evaluations in a row than max_consecutive_fallbacks
                data = [microbatch(cfg, 1000 + i, j, rank) for j in range(cfg.microbatches)]
                losses = evaluator(**step_kwargs(cfg, ddp, data, forward_only=True))
                record = loop.records[-1]
                (stats,) = runner.stats[-1]  # as the evaluation left the manager
                out["eval"].append([record.attempt, record.enabled, stats.stashes,
                                    loop.fallbacks, len(losses)])  # fmt: skip
        for chunk in ddp:
            chunk.train()
        train_step(2)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def run_cases(rank: int, world: int, out: Path) -> dict:
    from te_paged.tools.megatron_ab import megatron_parallel

    ep = world
    with megatron_parallel(ep):
        return {
            "megatron_runner": megatron_runner_case(ep, rank),
            "inert": inert_case(ep, rank),
            "refusals": refusals_case(ep, rank),
            "eval": eval_case(ep, rank, forward_only=True),
            "eval_mutation": eval_case(ep, rank, forward_only=False),
            "fallback_memory": fallback_memory_case(ep, rank),
            "reruns": reruns_case(ep, rank),
        }
