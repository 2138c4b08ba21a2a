"""Worker of the Bridge ``finetune()`` functional test: supervised fine-tuning with microbatches
whose token counts change from step to step, te_paged's MoE layers paging them.

Bridge's SFT batches (``GPTSFTDatasetConfig``: a local JSONL of prompt/completion pairs, each
microbatch padded to its longest sample rounded up to 16 tokens) hold 16 to 64 tokens a
sequence. Bridge's packed-sequence path (offline packing) needs Transformer Engine's THD
attention, which a CPU cannot run; so this is the unpacked SFT path, whose token counts vary
the same way for te_paged's layers (docs/megatron-bridge.md). The tokenizer is a word-level
Hugging Face tokenizer the worker makes and saves itself; nothing is downloaded.

Runs (4 ranks, dropout 0.1, the distributed optimizer, :data:`STEPS` iterations from a
1-iteration ``pretrain()`` checkpoint), each ON run against its OFF run:

* ``ft_on`` / ``ft_off``: paged stash on (pool 1.6x) / off, EP 1 (every rank its own counts):
  on pages after at most one growth per new largest microbatch;
* ``ft_declared`` / ``ft_off_ep4``: EP 4 with ``moe_max_tokens_per_rank`` declared (2
  sequences of 64): the capture step sizes the pools for it and nothing reruns. The ranks of
  an expert-parallel group bring different counts in one step (each pads its own samples),
  which te_paged's dispatcher exchanges sync-free only with the maximum declared.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch.distributed as dist

from functional_tests.megatron_bridge import pretrain_worker as pw

STEPS = 6
MICRO_BATCH, SEQ = 2, 64
WORDS = [f"w{i}" for i in range(200)]
FT_STASH = {**pw.STATIC, "moe_paged_stash": True,
            "moe_paged_stash_buffer_size_factor_cuda": 1.6}  # fmt: skip


def _tokenizer(folder: Path) -> None:
    """A word-level Hugging Face tokenizer over :data:`WORDS`, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate([*specials, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                            bos_token="<s>", eos_token="</s>").save_pretrained(folder)  # fmt: skip


def _sft_data(folder: Path) -> None:
    """Prompt/completion pairs of 3 to 40 words: microbatches of 16 to 64 tokens a sequence."""
    rng = random.Random(1234)
    for split, count in (("training", 256), ("validation", 32), ("test", 32)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for _ in range(count):
                prompt = " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
                answer = " ".join(rng.choices(WORDS, k=rng.randint(2, 16)))
                f.write(json.dumps({"input": prompt, "output": answer}) + "\n")


def _config(run: dict, loop, folder: Path):
    from megatron.bridge.data.builders.gpt_sft import GPTSFTDatasetConfig
    from megatron.bridge.training.config import TokenizerConfig, TrainingConfig

    config = pw.bridge_config(run, loop, folder)
    config.train = TrainingConfig(train_iters=run.get("iters", STEPS), global_batch_size=16,
                                  micro_batch_size=MICRO_BATCH)  # fmt: skip
    config.tokenizer = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                       tokenizer_model=str(folder / "tokenizer"))  # fmt: skip
    if run.get("sft"):
        config.dataset = GPTSFTDatasetConfig(seq_length=SEQ, dataset_root=str(folder / "sft"),
                                             seed=1234, num_workers=0, pin_memory=False,
                                             do_test=False)  # fmt: skip
        config.checkpoint.pretrained_checkpoint = str(folder / "pretrained")
    return config


def _train(name: str, run: dict, folder: Path) -> dict:
    from megatron.bridge.training.callbacks import CallbackManager
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.initialize import destroy_global_state
    from megatron.bridge.training.pretrain import pretrain

    from te_paged.integrations.megatron import MegatronLoopAdapter
    from te_paged.tools.megatron_ab import _reset_aux_loss_tracker, destroy_groups_made_inside

    start = time.perf_counter()
    loop = MegatronLoopAdapter()
    spies = pw.Spies()
    tokens: list[list[int]] = []  # per record: the step's microbatches' local token counts

    def on_train_start(context) -> None:
        spies.on_train_start(context)
        layer_dispatchers = [d for adapter in spies.loops for d in adapter.dispatchers][:1]

        def on_record(record) -> None:
            tokens.append([n for d in layer_dispatchers for n in d.step_num_tokens])

        for adapter in spies.loops:
            adapter.on_record = on_record

    callbacks = CallbackManager()
    callbacks.register("on_train_start", on_train_start)
    callbacks.register("on_train_step_end", spies.on_train_step_end)
    with destroy_groups_made_inside():
        _reset_aux_loss_tracker()
        pw.fresh_megatron_stash_manager()
        try:
            run_loop = finetune if run.get("sft") else pretrain
            run_loop(_config(run, loop, folder), forward_step, callbacks=callbacks)
        finally:
            destroy_global_state()
    records = [r for adapter in spies.loops for r in adapter.records]
    return {
        "loss": spies.loss,
        "grad_norm": spies.grad_norm,
        "params": spies.params,
        "attempt": [r.attempt for r in records],
        "enabled": [r.enabled for r in records],
        # Per record: ranks whose stash overflowed, ranks that went over budget.
        "flags": [[r.stash_overflow_ranks, r.overbudget_ranks] for r in records],
        "tokens": tokens,
        "fallbacks": sum(adapter.fallbacks for adapter in spies.loops),
        "seconds": time.perf_counter() - start,
    }


def run_cases(rank: int, world: int, out: Path) -> dict:
    folder = out / "data"
    if rank == 0:
        (folder / "sft").mkdir(parents=True, exist_ok=True)
        _tokenizer(folder / "tokenizer")
        _sft_data(folder / "sft")
    dist.barrier()
    declared = {"moe_max_tokens_per_rank": MICRO_BATCH * SEQ}
    ep1 = {"expert_model_parallel_size": 1}
    runs = {
        # The checkpoint fine-tuning starts from: one mock-data iteration, saved.
        "pretrained": {"model": pw.STATIC, "spec": "function", "iters": 1,
                       "save": str(folder / "pretrained")},
        "ft_off": {"model": {**pw.STATIC, **ep1}, "spec": "function", "sft": True},
        "ft_on": {"model": {**FT_STASH, **ep1}, "spec": "function", "sft": True},
        "ft_off_ep4": {"model": pw.STATIC, "spec": "function", "sft": True,
                       "overrides": declared},
        "ft_declared": {"model": FT_STASH, "spec": "gpt_layer_spec", "sft": True,
                        "overrides": declared},
    }  # fmt: skip
    results = {}
    for name, run in runs.items():
        results[name] = _train(name, run, folder)
        if rank == 0:
            print(f"bridge finetune_worker: {name} {results[name]['seconds']:.1f} s", flush=True)
    equal = {"ft_on": pw._same(results["ft_on"], results["ft_off"]),
             "ft_declared": pw._same(results["ft_declared"], results["ft_off_ep4"])}  # fmt: skip
    return {
        "equal": equal,
        "runs": {
            name: {k: v for k, v in r.items() if k != "params"} for name, r in results.items()
        },
    }
