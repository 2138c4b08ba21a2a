"""Worker of the ``pretrain()`` functional test: Megatron-LM's own training loop, many runs.

Run by ``test_megatron_pretrain.py`` through ``launch_workers.py`` (4 CPU ranks, gloo) against
megatron-core 0.19.2, after :func:`~te_paged.integrations.megatron.cpu_shims.install` with
``training_loop=True``. Every run is one ``megatron.training.pretrain()`` call as
``pretrain_gpt.py`` makes it (Megatron's argument parser on an argv, ``gpt_config_from_args`` /
``hybrid_config_from_args``, ``pretrain_cfg_container_from_args``, the model built by
Megatron's model builder, mock data and a null tokenizer), with Megatron's own paged-stash
flags and te_paged's MoE layers in the spec, so Megatron's own ``PagedStashRunner`` drives
them (train and evaluation). Between runs Megatron's global state is destroyed
(``destroy_global_state``) and the gloo groups it made with it, so one launch pays the imports
once.

Per iteration a test-only spy on ``train_step`` keeps the loss, the grad norm and every
parameter after the optimizer step; one on ``evaluate`` keeps the evaluation losses. Runs
(:data:`RUNS`), all with dropout 0.1, Megatron DDP with overlapped grad reduce, the
distributed optimizer, an evaluation at iteration 2:

* ``gpt_off`` / ``gpt_on``: a 2-layer GPT, EP 4, static budget (capacity factor 2.0), paged
  stash off / on (a pool of 1.6x the balanced pages); ``gpt_spec_flag``: ``gpt_on`` with the
  layer spec named on the command line (``--spec te_paged.integrations.megatron
  gpt_layer_spec``) instead of set by the script;
* ``reference``: capacity factor and pool 8.0 (never over budget nor overflowing);
  ``over_budget``: capacity factor 1.0 (reruns); ``mutation_rng``: the same with te_paged's
  random-state restore removed; ``overflow``: a 0.3x pool with ``grow_pool`` off (reruns);
* ``gpt_on`` saves at iteration 2 (``--save``, Megatron's distributed checkpoint), and
  ``resume`` loads it (``--load``, ``--ckpt-step 2``) and trains iteration 3;
* ``pp2_off`` / ``pp2_on``: 2 pipeline stages (1F1B, one layer each), EP 2;
* ``hybrid_off`` / ``hybrid_on``: a ``HybridModel`` (pattern ``*E*E``: attention, MoE) with a
  spec without Transformer Engine and te_paged's MoE layers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from pathlib import Path

import torch

STEPS = 3
#: Megatron's own flags, as a user passes them (megatron-core 0.19.2's argument parser). The
#: backend is gloo already, so Megatron's extra gloo copies of its groups are turned off: each
#: gloo group's TCP loop thread wakes every 10 ms while it lives: this launch took 183-199 s of
#: CPU with them, 157-158 s without (benchmarks/results/suite-time-2026-12-07.md).
BASE = [
    "--distributed-backend", "gloo", "--disable-gloo-process-groups", "--transformer-impl", "local",
    "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--no-bias-gelu-fusion",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "64", "--max-position-embeddings", "64",
    "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128",
    "--swiglu", "--disable-bias-linear",
    "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4",
    "--expert-model-parallel-size", "4",
    "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
    "--micro-batch-size", "2", "--global-batch-size", "16",
    "--train-iters", str(STEPS), "--eval-interval", "2", "--eval-iters", "1",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--num-workers", "0",
    "--log-interval", "1", "--seed", "1234",
]  # fmt: skip
#: Megatron's paged-stash flags: 0.19.2's config asks for a flex backend beside a rank
#: capacity factor (te_paged's layer never builds that dispatcher).
STATIC = [
    "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "ncclep",
    "--moe-expert-rank-capacity-factor", "2.0", "--moe-paged-stash-page-size", "8",
]  # fmt: skip
STASH = ["--moe-paged-stash", "--moe-paged-stash-buffer-size-factor-cuda", "1.6"]
NEVER_OVERFLOWS = ["--moe-expert-rank-capacity-factor", "8.0",
                   "--moe-paged-stash-buffer-size-factor-cuda", "8.0"]  # fmt: skip
PP2 = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
HYBRID = ["--hybrid-layer-pattern", "*E*E", "--num-layers", "4"]


def _runs(save_dir: Path) -> dict[str, dict]:
    save = ["--save", str(save_dir), "--save-interval", "2"]
    return {
        "gpt_off": {"argv": STATIC},
        "gpt_on": {"argv": STATIC + STASH + save},  # saving at iteration 2 changes nothing
        "gpt_spec_flag": {"argv": STATIC + STASH, "spec_flag": True},
        "reference": {"argv": STATIC + STASH + NEVER_OVERFLOWS},
        "over_budget": {"argv": STATIC + STASH + ["--moe-expert-rank-capacity-factor", "1.0"]},
        "mutation_rng": {
            "argv": STATIC + STASH + ["--moe-expert-rank-capacity-factor", "1.0"],
            "mutation": "rng",
        },
        "overflow": {
            "argv": STATIC + STASH + ["--moe-paged-stash-buffer-size-factor-cuda", "0.3"],
            "loop": {"grow_pool": False},
        },
        "resume": {"argv": STATIC + STASH + ["--load", str(save_dir), "--ckpt-step", "2"]},
        "pp2_off": {"argv": STATIC + PP2},
        "pp2_on": {"argv": STATIC + STASH + PP2},
        "hybrid_off": {"argv": STATIC + HYBRID, "model": "hybrid"},
        "hybrid_on": {"argv": STATIC + STASH + HYBRID, "model": "hybrid"},
    }


# ------------------------------------------------------------------------- the user's script


def _get_batch(data_iterator, vp_stage=None):
    from megatron.training.utils import is_first_or_last_pipeline_stage

    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None
    batch = next(data_iterator)
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]


def _loss(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().clone().detach().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    from megatron.core.utils import get_attr_wrapped_model

    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, position_ids = _get_batch(data_iterator, vp_stage)
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
    return output, functools.partial(_loss, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import is_first_or_last_pipeline_stage

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,  # mock data
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        data_parallel_size=args.data_parallel_size,
        context_parallel_size=args.context_parallel_size,
    )

    def built_here() -> bool:
        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(
            vp_stage
        )

    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, built_here, config
    ).build()


datasets_provider.is_distributed = True


# ------------------------------------------------------------------------------ one run


def _stats(manager):
    return manager.stats()


class _Spies:
    """Per iteration: loss, grad norm, parameters after the step, the adapter's record;
    evaluation losses; Megatron's stash spies' counts."""

    def __init__(self) -> None:
        self.loss: list[float] = []
        self.grad_norm: list[float] = []
        self.params: list[list[torch.Tensor]] = []
        self.records: list[dict] = []
        self.eval_loss: list[float] = []
        self.loops: list = []
        # per record, per manager: [stashes, pops, kept unpaged (skip_immediate_backward)]
        self.stashes: list[list[list[int]]] = []

    @contextlib.contextmanager
    def on(self, counts: dict[str, int]):
        from megatron.core.utils import unwrap_model
        from megatron.training import training as loop

        from functional_tests.megatron.builtin_worker import counting, megatron_stash_spies
        from te_paged.integrations.megatron import PagedStashMoELayer, paged_stash_managers

        train_step, evaluate = loop.train_step, loop.evaluate

        def spied_train_step(forward_step_func, data_iterator, model, *args, **kwargs):
            chunks = [unwrap_model(c) for c in model]
            if not self.loops:  # the adapters, and te_paged's stash counts per step
                layers = [m for c in chunks for m in c.modules()
                          if isinstance(m, PagedStashMoELayer)]  # fmt: skip
                self.loops = list({id(m.loop): m.loop for m in layers}.values())
                managers = paged_stash_managers(chunks)
                for adapter in self.loops:
                    adapter.on_record = lambda record: self.stashes.append(
                        [[s.stashes, s.pops, s.stashes_skipped] for s in map(_stats, managers)]
                    )
            out = train_step(forward_step_func, data_iterator, model, *args, **kwargs)
            loss_reduced, grad_norm = out[0], out[5]
            loss = loss_reduced.get("lm loss") if loss_reduced else None
            self.loss.append(float("nan") if loss is None else float(loss))
            self.grad_norm.append(float(grad_norm))
            self.params.append([p.detach().clone() for c in chunks for p in c.parameters()])
            return out

        def spied_evaluate(*args, **kwargs):
            out = evaluate(*args, **kwargs)
            total = out[0]
            loss = total.get("lm loss") if total else None
            self.eval_loss.append(float("nan") if loss is None else float(loss))
            return out

        loop.train_step, loop.evaluate = spied_train_step, spied_evaluate
        counts["runner"] = 0
        try:
            with megatron_stash_spies(counts), counting(loop, "PagedStashRunner", counts, "runner"):
                yield
        finally:
            loop.train_step, loop.evaluate = train_step, evaluate


def _megatron_stash_state() -> dict:
    from megatron.core.transformer.moe import paged_stash

    manager = paged_stash.PagedStashManager.get_instance()
    return {
        "buffers": len(manager.stash_buffers or {}),
        "captured": manager.max_tokens_across_vp_stages is not None,
    }


def pretrain_once(name: str, run: dict, log: list[str]) -> dict:
    """One ``pretrain()`` call as ``pretrain_gpt.py`` makes it (see the module docstring)."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        hybrid_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.models.gpt import default_layer_spec
    from megatron.training.training import destroy_global_state

    from functional_tests.megatron.train_worker import mutated
    from te_paged.integrations.megatron import (
        MegatronLoopAdapter,
        local_hybrid_stack_spec,
        with_te_paged_moe,
    )
    from te_paged.tools.megatron_ab import _reset_aux_loss_tracker, destroy_groups_made_inside

    start = time.perf_counter()
    argv = BASE + run["argv"]
    if run.get("spec_flag"):
        argv += ["--spec", "te_paged.integrations.megatron", "gpt_layer_spec"]
    sys.argv = ["pretrain_gpt.py", *argv]
    spies, counts = _Spies(), {}
    loop_adapter = MegatronLoopAdapter(**run.get("loop", {}))
    with contextlib.ExitStack() as stack:
        stack.enter_context(destroy_groups_made_inside())
        args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
        if run.get("model") == "hybrid":
            model_cfg = hybrid_config_from_args(args)
            # A HybridModel's stack spec is a spec: te_paged's MoE layers go into it here.
            model_cfg.hybrid_stack_spec = with_te_paged_moe(
                local_hybrid_stack_spec(), model_cfg.transformer, loop=loop_adapter
            )
        else:
            model_cfg = gpt_config_from_args(args)
            if not run.get("spec_flag"):

                def layer_spec(config, vp_stage=None):
                    spec = default_layer_spec(config, vp_stage)
                    return with_te_paged_moe(spec, config.transformer, loop=loop_adapter)

                model_cfg.transformer_layer_spec = layer_spec
        cfg = pretrain_cfg_container_from_args(args, model_cfg)
        stack.enter_context(spies.on(counts))
        if "mutation" in run:
            stack.enter_context(mutated(run["mutation"]))
        _reset_aux_loss_tracker()  # sized by the first model's layers: a 4-layer run follows
        try:
            pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, forward_step)
            megatron_state = _megatron_stash_state()
        finally:
            destroy_global_state()
    loops = spies.loops
    records = [r for loop in loops for r in loop.records]
    return {
        "loss": spies.loss,
        "grad_norm": spies.grad_norm,
        "params": spies.params,
        "eval_loss": spies.eval_loss,
        "attempt": [r.attempt for r in records],
        "enabled": [r.enabled for r in records],
        "stashes_pops": spies.stashes,
        "fallbacks": sum(loop.fallbacks for loop in loops),
        "loops": len(loops),
        "megatron_counts": counts,
        "megatron_state": megatron_state,
        "log": [line for line in log if line.startswith("te_paged: iteration")],
        "seconds": time.perf_counter() - start,
    }


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


def run_cases(rank: int, world: int, out: Path) -> dict:
    from te_paged.integrations.megatron import cpu_shims

    cpu_shims.install(training_loop=True)
    log: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            log.append(record.getMessage())

    handler = Keep(logging.INFO)
    te_logger = logging.getLogger("te_paged.integrations.megatron.loop")
    te_logger.addHandler(handler)
    te_logger.setLevel(logging.INFO)
    runs = {}
    try:
        for name, run in _runs(out / "checkpoint").items():
            log.clear()
            runs[name] = pretrain_once(name, run, log)
    finally:
        te_logger.removeHandler(handler)
    pairs = {
        "gpt": ("gpt_on", "gpt_off"),
        "gpt_spec_flag": ("gpt_spec_flag", "gpt_on"),
        "over_budget": ("over_budget", "reference"),
        "mutation_rng": ("mutation_rng", "reference"),
        "overflow": ("overflow", "reference"),
        "pp2": ("pp2_on", "pp2_off"),
        "hybrid": ("hybrid_on", "hybrid_off"),
    }
    result: dict = {"equal": {k: _same(runs[a], runs[b]) for k, (a, b) in pairs.items()}}
    # The resumed run trains iteration 3 only: the same as gpt_on's third.
    result["equal"]["resume"] = _same(runs["resume"], {
        k: v[2:] if isinstance(v, list) else v for k, v in runs["gpt_on"].items()
    })  # fmt: skip
    result["eval_equal"] = {  # NaN on a stage without the loss
        k: str(runs[a]["eval_loss"]) == str(runs[b]["eval_loss"]) for k, (a, b) in pairs.items()
    }
    result["runs"] = {
        name: {k: v for k, v in r.items() if k != "params"} for name, r in runs.items()
    }
    return result
