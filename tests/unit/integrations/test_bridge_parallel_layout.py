"""What te_paged's expert linears declare for Megatron-Bridge's ``AutoBridge`` (and megatron-
core's FSDP adapter): fc1 column-parallel, fc2 row-parallel, as module attributes. No Megatron or
Bridge needed; ``functional_tests/megatron_bridge/test_bridge_autobridge.py`` converts real
Hugging Face weights with them, and shows the conversion failing without them."""

from __future__ import annotations

import pytest
import torch

from te_paged import GroupedLinear
from te_paged.integrations import megatron as tpm
from te_paged.integrations.megatron.linears import declare_parallel_layout
from tests.unit.integrations.test_megatron_adapters import FFN, E, H, megatron_config

COLUMN = ("column", True, 0)
ROW = ("row", True, 1)


def layout(linear: torch.nn.Module) -> tuple:
    return linear.parallel_mode, linear.tensor_model_parallel, linear.partition_dim


def bridge_parallelism(linear: torch.nn.Module) -> str | None:
    """The fallback of megatron-bridge 0.6.2's ``AutoMapping._detect_parallelism_type``
    (``models/conversion/param_mapping.py:1512-1521``) for a class it has not registered, which
    ``GroupedLinear`` is: the module's ``tensor_model_parallel`` and ``partition_dim``."""
    if not hasattr(linear, "tensor_model_parallel"):
        return None  # Bridge raises "Cannot determine parallelism type"
    if not linear.tensor_model_parallel:
        return "replicated"
    return {0: "column", 1: "row"}.get(getattr(linear, "partition_dim", None))


def test_te_paged_experts_declare_fc1_column_and_fc2_row() -> None:
    experts = tpm.MegatronTEGroupedMLP(E, megatron_config())
    assert layout(experts.linear_fc1) == COLUMN
    assert layout(experts.linear_fc2) == ROW
    assert bridge_parallelism(experts.linear_fc1) == "column"
    assert bridge_parallelism(experts.linear_fc2) == "row"
    # Attributes, not state: the checkpoint keys are Megatron's TEGroupedMLP's, as before.
    keys = {f"linear_fc{j}.weight{i}" for j in (1, 2) for i in range(E)}
    assert set(experts.state_dict()) == keys


def test_a_plain_grouped_linear_declares_nothing() -> None:
    """Outside Megatron (te_paged's own TEGroupedMLP, a user's GroupedLinear) nothing is said:
    this is what Bridge met before the fix."""
    linear = GroupedLinear(E, H, FFN, bias=False)
    assert linear.parallel_mode is None
    assert bridge_parallelism(linear) is None


@pytest.mark.parametrize("buffer_name, expected", [("fc1", COLUMN), ("fc2", ROW), (None, COLUMN)])
def test_grouped_linear_adapter_declares_by_megatrons_buffer_name(buffer_name, expected) -> None:
    """Megatron's own TEGroupedMLP builds both linears from one class and names them by
    ``tp_comm_buffer_name`` (``experts.py``: ``'fc1'``, ``'fc2'``)."""
    linear = tpm.MegatronGroupedLinear(
        E, H, FFN, config=megatron_config(), init_method=None, bias=False,
        skip_bias_add=False, is_expert=True, tp_comm_buffer_name=buffer_name,
    )  # fmt: skip
    assert layout(linear) == expected


@pytest.mark.parametrize("mode", [None, "replicated", "Column"])
def test_declare_parallel_layout_refuses_other_modes(mode) -> None:
    linear = GroupedLinear(E, H, FFN, bias=False)
    with pytest.raises(ValueError, match="fc1 is 'column', its fc2 'row'"):
        declare_parallel_layout(linear, mode)
    assert not hasattr(linear, "tensor_model_parallel")


@pytest.mark.parametrize(
    "fields, expert_groups",
    [
        ({}, False),  # EP 1: the experts are replicated over data parallelism, as dense layers
        ({"expert_model_parallel_size": E}, True),
    ],
)
def test_expert_weights_tell_megatrons_ddp_which_group_reduces_them(fields, expert_groups) -> None:
    """Megatron's ``allreduce`` on every expert weight, as its own expert linears set it: False
    with expert parallelism (DDP's expert buffers, reduced over the ranks holding the same
    experts). Without it DDP averaged each local expert's gradient with other ranks' different
    experts (the functional Bridge test counts where DDP put them)."""
    from te_paged.integrations.megatron.linears import uses_expert_groups

    config = megatron_config(**fields)
    assert uses_expert_groups(config) is expert_groups
    experts = tpm.MegatronTEGroupedMLP(E, config)
    assert [p.allreduce for p in experts.parameters()] == [not expert_groups] * (2 * E)
    linear = tpm.MegatronGroupedLinear(
        E, H, FFN, config=config, init_method=None, bias=False, skip_bias_add=False,
        is_expert=True, tp_comm_buffer_name="fc2",
    )  # fmt: skip
    assert [p.allreduce for p in linear.parameters()] == [not expert_groups] * E


def test_expert_tensor_parallelism_unlike_the_dense_layers_uses_the_expert_groups() -> None:
    from te_paged.integrations.megatron.linears import uses_expert_groups

    assert uses_expert_groups(megatron_config(expert_tensor_parallel_size=2,
                                              tensor_model_parallel_size=1))  # fmt: skip
