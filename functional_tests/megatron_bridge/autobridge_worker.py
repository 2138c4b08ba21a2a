"""Worker of the AutoBridge functional test: Hugging Face weights into te_paged's MoE layers and
back, through Megatron-Bridge's ``AutoBridge`` as a Bridge user calls it.

Run by ``test_bridge_autobridge.py`` on 4 CPU ranks (gloo) against megatron-bridge 0.6.2 and
megatron-core 0.19.2, with :mod:`te_paged.tools.preload_bridge` imported first. Rank 0 writes a
tiny random Qwen3-MoE checkpoint with transformers' own ``Qwen3MoeConfig`` and
``save_pretrained`` (45 tensors on disk: per layer, 3 per expert × 4 experts, the router, the
attention's 4 projections and 2 norms, 2 layer norms; the embedding, the final norm, the
output layer); nothing touches the Hub (offline mode, see :func:`hub_offline`). Then, as a user
writes it: ``AutoBridge.from_hf_pretrained(path)``, ``bridge.to_megatron_provider()``, the
provider's layer spec given to te_paged (Megatron's local layers, since a CPU has no
Transformer Engine), the static-budget fields, ``provide_distributed_model`` (whose pre-wrap
hook loads the weights) or ``load_hf_weights``, and ``export_hf_weights`` /
``save_hf_pretrained``. Cases:

* ``ep1`` (every rank holds every expert): Bridge's own model (``local_layer_spec``, Megatron's
  ``SequentialMLP`` experts, no te_paged) and te_paged's (``with_te_paged_moe`` on that spec),
  weights loaded by the provider's hook; logits of one eval forward without autograd (per rank
  its own tokens; te_paged's dispatcher is dropless there) compared with ``torch.equal``; every
  exported tensor compared with the checkpoint's;
* ``ep2`` (2 expert-parallel ranks × 2 data-parallel): te_paged's layers through
  ``gpt_layer_spec`` (``transformer_impl="local"``), built without weights and loaded with
  ``bridge.load_hf_weights``; each rank's experts against the checkpoint's, the logits against
  ``ep1``'s Bridge model on the same tokens, ``save_hf_pretrained`` read back tensor by tensor;
* ``mutation`` (EP 1): te_paged's linears without the layout they declare (what they were
  before :func:`~te_paged.integrations.megatron.linears.declare_parallel_layout`): importing
  and exporting must both raise Bridge's ``ValueError``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

STEPS = 1  # one forward per model
#: The checkpoint: small enough to build in a second, with 2 experts a rank at EP 2.
HF_CONFIG = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64,
    "tie_word_embeddings": False, "norm_topk_prob": True, "dtype": "float32",
}  # fmt: skip
BATCH, SEQ = 2, 16
#: te_paged's static budget, as Bridge's perf recipes set it on megatron-core 0.19.2 (the flex
#: backend the config asks for beside a rank capacity factor; te_paged's layer replaces it).
STATIC = {
    "moe_expert_rank_capacity_factor": 2.0,
    "moe_token_dispatcher_type": "flex",
    "moe_flex_dispatcher_backend": "ncclep",
}


def hub_offline() -> None:
    """Hugging Face's offline mode for this rank. ``HF_HUB_OFFLINE`` is read once, when
    huggingface_hub is imported (``constants.py``), which the preload did before this worker
    ran: set the variable for any child process and the flag every Hub request checks
    (``constants.is_offline_mode()``), so a request raises instead of downloading."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def write_checkpoint(folder: Path) -> None:
    """Rank 0: a random Qwen3-MoE checkpoint (every tensor drawn, the norms around 1) written by
    transformers' ``save_pretrained`` (its per-expert layout on disk)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF_CONFIG))
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    model.save_pretrained(folder)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def provider_for(bridge, *, ep: int, te_paged: str | None, load_weights: bool = True):
    """``bridge``'s provider at expert parallelism ``ep`` on Megatron's local layers: Bridge's
    own (``te_paged=None``), or with te_paged's MoE layers through ``"with_te_paged_moe"`` on
    Bridge's local spec function or ``"gpt_layer_spec"``."""
    from megatron.bridge.models.gpt_provider import local_layer_spec

    from te_paged.integrations.megatron import (
        MegatronLoopAdapter,
        gpt_layer_spec,
        with_te_paged_moe,
    )

    provider = bridge.to_megatron_provider(load_weights=load_weights)
    provider.transformer_impl = "local"  # no Transformer Engine on a CPU
    provider.transformer_layer_spec = local_layer_spec
    provider.moe_permute_fusion = False  # Transformer Engine's kernel
    provider.expert_model_parallel_size = ep
    if te_paged is not None:
        for key, value in STATIC.items():
            setattr(provider, key, value)
        loop = MegatronLoopAdapter()
        if te_paged == "gpt_layer_spec":
            provider.transformer_layer_spec = functools.partial(gpt_layer_spec, loop=loop)
        else:
            provider.transformer_layer_spec = with_te_paged_moe(
                provider.transformer_layer_spec, provider, loop=loop
            )
    provider.finalize()
    return provider


def build(provider) -> list:
    # Bridge sets up Megatron's parallel state from the provider's sizes when there is none.
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)


@contextlib.contextmanager
def parallel_state_inside() -> Iterator[None]:
    """Megatron's parallel state that Bridge makes inside the block, and its process groups,
    gone on exit."""
    from megatron.core import parallel_state

    from te_paged.tools.megatron_ab import destroy_groups_made_inside

    with destroy_groups_made_inside():
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def tokens_of(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
    return torch.randint(0, HF_CONFIG["vocab_size"], (BATCH, SEQ), generator=generator)


def logits(model: list, tokens: torch.Tensor) -> torch.Tensor:
    """One eval forward without autograd (te_paged's dispatcher is dropless there)."""
    module = model[0]
    module.eval()
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        return module(tokens, positions, attention_mask=None)


def grouped_linears(model: list) -> list[torch.nn.Module]:
    from te_paged.grouped import GroupedLinear

    return [m for m in model[0].modules() if isinstance(m, GroupedLinear)]


def layouts(model: list) -> dict[str, list]:
    """What each te_paged linear declares: ``[type, parallel_mode, tensor_model_parallel,
    partition_dim]`` for fc1 and fc2 (the same in every layer, else both are listed)."""
    seen: dict[str, list] = {}
    for name, m in model[0].named_modules():
        if name.endswith(("experts.linear_fc1", "experts.linear_fc2")):
            attributes = ("parallel_mode", "tensor_model_parallel", "partition_dim")
            entry = [type(m).__name__, *(getattr(m, a, None) for a in attributes)]
            key = name.rsplit(".", 1)[-1]
            if seen.get(key, entry) != entry:
                key = name
            seen[key] = entry
    return seen


def compare(exported: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> dict:
    return {
        "equal": sum(k in exported and torch.equal(exported[k], v) for k, v in original.items()),
        "total": len(original),
        "missing": sorted(set(original) - set(exported)),
        "extra": sorted(set(exported) - set(original)),
    }


def experts_as_imported(model: list, original: dict[str, torch.Tensor], ep_rank: int) -> dict:
    """Each local expert of te_paged's layers against the checkpoint's expert it holds (global
    ``ep_rank × local experts + i``): fc1 is ``[gate; up]``, fc2 ``down``."""
    equal = total = 0
    for layer, mlp in enumerate(model[0].decoder.layers):
        experts = mlp.mlp.experts
        local = experts.num_local_experts
        for i in range(local):
            hf = f"model.layers.{layer}.mlp.experts.{ep_rank * local + i}"
            fc1 = torch.cat([original[f"{hf}.gate_proj.weight"], original[f"{hf}.up_proj.weight"]])
            equal += torch.equal(getattr(experts.linear_fc1, f"weight{i}"), fc1)
            equal += torch.equal(getattr(experts.linear_fc2, f"weight{i}"),
                                 original[f"{hf}.down_proj.weight"])  # fmt: skip
            total += 2
    return {"equal": equal, "total": total}


def without_declared_layout(model: list) -> int:
    """te_paged's linears as they were before they declared their layout; how many."""
    linears = grouped_linears(model)
    for m in linears:
        del m.tensor_model_parallel, m.partition_dim
        m.parallel_mode = None
    return len(linears)


def first_error(call) -> str | None:
    """The first line of the ``ValueError`` ``call()`` raises (None: it raised none)."""
    try:
        call()
    except ValueError as error:
        return str(error).splitlines()[0]
    return None


def run_cases(rank: int, world: int, out: Path) -> dict:
    import torch.distributed as dist
    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state

    hub_offline()
    start = time.perf_counter()
    checkpoint = out / "qwen3_moe"
    if rank == 0:
        write_checkpoint(checkpoint)
    dist.barrier()
    original = read_safetensors(checkpoint)
    bridge = AutoBridge.from_hf_pretrained(checkpoint)
    tokens = tokens_of(rank)
    cases: dict[str, dict] = {}

    with parallel_state_inside():
        t = time.perf_counter()
        reference = logits(build(provider_for(bridge, ep=1, te_paged=None)), tokens)
        model = build(provider_for(bridge, ep=1, te_paged="with_te_paged_moe"))
        got = logits(model, tokens)
        exported = dict(bridge.export_hf_weights(model, cpu=True, show_progress=False))
        cases["ep1"] = {
            "ep": parallel_state.get_expert_model_parallel_world_size(),
            "logits_equal": torch.equal(got, reference),
            "max_abs_diff": float((got - reference).abs().max()),
            "logits_abs_sum": float(reference.abs().sum()),
            "export": compare(exported, original),
            "layouts": layouts(model),
            "seconds": time.perf_counter() - t,
        }

        t = time.perf_counter()
        model = build(provider_for(bridge, ep=1, te_paged="with_te_paged_moe", load_weights=False))
        stripped = without_declared_layout(model)
        cases["mutation"] = {
            "linears": stripped,
            "load_error": first_error(lambda: bridge.load_hf_weights(model)),
            "export_error": first_error(
                lambda: dict(bridge.export_hf_weights(model, cpu=True, show_progress=False))
            ),
            "seconds": time.perf_counter() - t,
        }

    with parallel_state_inside():
        t = time.perf_counter()
        provider = provider_for(bridge, ep=2, te_paged="gpt_layer_spec", load_weights=False)
        model = build(provider)
        bridge.load_hf_weights(model)
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        got = logits(model, tokens)
        saved = out / "exported"
        bridge.save_hf_pretrained(model, saved, show_progress=False)
        dist.barrier()
        cases["ep2"] = {
            "ep": parallel_state.get_expert_model_parallel_world_size(),
            "ep_rank": ep_rank,
            "experts": experts_as_imported(model, original, ep_rank),
            "logits_equal": torch.equal(got, reference),
            "max_abs_diff": float((got - reference).abs().max()),
            "saved": compare(read_safetensors(saved), original),
            "saved_config": (saved / "config.json").is_file(),
            "layouts": layouts(model),
            "seconds": time.perf_counter() - t,
        }
    return {"checkpoint_tensors": len(original), "cases": cases,
            "seconds": time.perf_counter() - start}  # fmt: skip
