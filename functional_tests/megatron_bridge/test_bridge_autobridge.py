"""Hugging Face weights into te_paged's MoE layers and back through Megatron-Bridge's
``AutoBridge`` (0.6.2, on megatron-core 0.19.2), on 4 gloo ranks at EP 1 and EP 2.

The launch runs ``autobridge_worker.py`` (see its docstring): a tiny random Qwen3-MoE checkpoint
written by transformers' ``save_pretrained``, imported into a Megatron model whose MoE layers
are te_paged's, compared with the model Bridge builds without te_paged (Megatron's local
layers), exported back. te_paged's expert linears say themselves how Bridge must split them
(``declare_parallel_layout``); without that Bridge cannot convert them.
"""

from __future__ import annotations

import pytest

from functional_tests.megatron_bridge import bridge_launch

LAUNCH = bridge_launch("autobridge_worker", timeout_s=120)
LAUNCHES = [LAUNCH]
#: Tensors in the checkpoint: per layer 3 per expert × 4, the router, q/k/v/o, q/k norms and 2
#: layer norms (19 × 2 layers), plus the embedding, the final norm and the output layer.
CHECKPOINT_TENSORS = 45
#: Local expert weights a rank holds at EP 2: 2 layers × 2 experts × (fc1, fc2).
EP2_LOCAL_EXPERT_WEIGHTS = 8
BRIDGE_ERROR = (
    "Cannot determine parallelism type for module 'GroupedLinear' at weight "
    "'decoder.layers.0.mlp.experts.linear_fc2.weight0'."
)


@pytest.fixture(scope="module")
def ranks(launches) -> list[dict]:
    return launches.result(LAUNCH)


@pytest.mark.parametrize("case, ep", [("ep1", 1), ("ep2", 2)])
def test_imported_forward_equals_bridges_own_model(ranks, case, ep) -> None:
    """te_paged's layers with the imported weights give logits bitwise equal to the model Bridge
    builds without te_paged from the same checkpoint (each rank its own tokens; at EP 2 they
    cross to the other expert-parallel rank)."""
    for rank, result in enumerate(ranks):
        run = result["cases"][case]
        assert run["ep"] == ep, (rank, run)
        assert run["logits_equal"], (rank, case, run["max_abs_diff"])
        assert result["cases"]["ep1"]["logits_abs_sum"] > 0, rank  # not a model of zeros


def test_ep2_each_rank_holds_its_experts(ranks) -> None:
    """``load_hf_weights`` at EP 2: expert-parallel rank r holds the checkpoint's experts
    2r and 2r + 1, fc1 as ``[gate; up]``, fc2 as ``down``."""
    assert [r["cases"]["ep2"]["ep_rank"] for r in ranks] == [0, 1, 0, 1]
    for rank, result in enumerate(ranks):
        experts = result["cases"]["ep2"]["experts"]
        expected = {"equal": EP2_LOCAL_EXPERT_WEIGHTS, "total": EP2_LOCAL_EXPERT_WEIGHTS}
        assert experts == expected, (rank, experts)


@pytest.mark.parametrize("case, key", [("ep1", "export"), ("ep2", "saved")])
def test_export_gives_back_every_checkpoint_tensor(ranks, case, key) -> None:
    """``export_hf_weights`` (EP 1, every rank) and ``save_hf_pretrained`` (EP 2, read back):
    the checkpoint's names, every tensor ``torch.equal``."""
    for rank, result in enumerate(ranks):
        assert result["checkpoint_tensors"] == CHECKPOINT_TENSORS, rank
        exported = result["cases"][case][key]
        expected = {"equal": CHECKPOINT_TENSORS, "total": CHECKPOINT_TENSORS,
                    "missing": [], "extra": []}  # fmt: skip
        assert exported == expected, (rank, case, exported)
    assert all(r["cases"]["ep2"]["saved_config"] for r in ranks)


@pytest.mark.parametrize("case", ["ep1", "ep2"])
def test_te_paged_linears_declare_their_layout(ranks, case) -> None:
    for result in ranks:
        assert result["cases"][case]["layouts"] == {
            "linear_fc1": ["GroupedLinear", "column", True, 0],
            "linear_fc2": ["GroupedLinear", "row", True, 1],
        }


def test_without_the_declared_layout_bridge_cannot_convert(ranks) -> None:
    """The mutation: te_paged's 4 linears (2 layers × fc1, fc2) without what they declare, as
    before the fix. Import and export both fail on fc2 (fc1 goes through Bridge's
    ``GatedMLPMapping``, which needs no detection)."""
    for rank, result in enumerate(ranks):
        mutation = result["cases"]["mutation"]
        assert mutation["linears"] == 4, (rank, mutation)
        assert mutation["load_error"] == BRIDGE_ERROR, (rank, mutation)
        assert mutation["export_error"] == BRIDGE_ERROR, (rank, mutation)
