"""Megatron distributed checkpoints (``dist_checkpointing``) of te_paged's experts.

Megatron writes MoE experts sharded over the *global* expert index: ``SequentialMLP`` and
``TEGroupedMLP`` both store ``<prefix>experts.linear_fc1.weight`` as one logical tensor with the
expert axis prepended (EP rank ``r`` writes experts ``[r·L, (r+1)·L)``), mark copies of the same
experts on other expert-data-parallel ranks as replicas, split a gated FC1 into its two halves
(Megatron's swiglu factory, so tensor parallelism can be resharded) and keep one
``_extra_state`` object per expert and linear. :func:`expert_sharded_state_dict` writes exactly
that for te_paged's ``linear_fc1.weight{i}``/``linear_fc2.weight{i}``, so a checkpoint moves
between Megatron's expert modules and te_paged's, and between EP sizes.

Without it Megatron falls back to treating the experts' state dict as replicated: every EP rank
would claim ``linear_fc1.weight0`` (its own, different expert 0) as the main copy, and the
checkpoint would keep one rank's experts for all of them.

Worked example (8 experts, EP 4, rank 2, local expert 1): global expert 5; FC1's weight
``[2F, H]`` becomes two ``ShardedTensor`` halves ``[1, F, H]`` at global offsets ``(5, 0, 0)``
and ``(5, F, 0)`` of ``[8, 2F, H]`` under the key ``<prefix>experts.linear_fc1.weight``; its
replica id is ``(0, 0, expert-data-parallel rank)``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["drop_extra_state_keys", "expert_sharded_state_dict", "linear_sharded_state_dict"]

_LINEARS = (("linear_fc1", 0), ("linear_fc2", 1))  # and the axis tensor parallelism splits


def _group(pg_collection: object, name: str, fallback: str) -> Any:
    group = getattr(pg_collection, name, None)
    if group is None:
        from megatron.core import parallel_state

        group = getattr(parallel_state, fallback)()
    return group


def _groups(pg_collection: object) -> tuple[Any, Any, Any]:
    return (
        _group(pg_collection, "ep", "get_expert_model_parallel_group"),
        _group(pg_collection, "expt_dp", "get_expert_data_parallel_group"),
        _group(pg_collection, "expt_tp", "get_expert_tensor_parallel_group"),
    )


def linear_sharded_state_dict(
    linear: nn.Module,
    prefix: str,
    key_outer: str,
    key_inner: str,
    *,
    tp_axis: int,
    swiglu: bool,
    sharded_offsets: tuple = (),
    metadata: dict | None = None,
    pg_collection: object = None,
) -> dict[str, Any]:
    """One expert :class:`~te_paged.grouped.GroupedLinear` (one weight per local expert):
    dict keys ``{prefix}weight{i}``, ``{prefix}bias{i}``, ``{prefix}_extra_state[i]``;
    sharded keys ``{key_outer}{key_inner}weight`` etc. with the global expert axis prepended
    (with ``singleton_local_shards``, ``{key_outer}{e}.{key_inner}weight`` for global expert
    ``e`` instead).
    ``tp_axis``: 0 for a column-parallel FC1 (its bias split too), 1 for a row-parallel FC2;
    ``swiglu`` splits FC1's gated halves as Megatron's MLP does."""
    if linear.single_grouped_weight or (linear.use_bias and linear.single_grouped_bias):
        raise NotImplementedError(
            "Megatron checkpoints of a single grouped weight or bias are not supported; build "
            "the expert linears with one parameter per expert (the default)"
        )
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import (
        ensure_metadata_has_dp_cp_group,
        make_sharded_tensors_for_checkpoint,
    )
    from megatron.core.utils import get_pg_rank, get_pg_size

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    singleton = metadata.get("singleton_local_shards", False)
    ep, expt_dp, expt_tp = _groups(pg_collection)
    local = linear.num_gemms
    num_global, first = get_pg_size(ep) * local, get_pg_rank(ep) * local
    weights, biases = linear.weight_params(), linear.bias_params()
    out: dict[str, Any] = {}
    for i in range(local):
        expert = first + i
        if singleton:
            keys, offsets = f"{key_outer}{expert}.{key_inner}", sharded_offsets
        else:
            keys = f"{key_outer}{key_inner}"
            offsets = (*sharded_offsets, (len(sharded_offsets), expert, num_global))
        state: dict[str, Any] = {"weight": weights[i], "_extra_state": None}
        axes = {"weight": tp_axis}
        if biases:
            state["bias"] = biases[i]
            if tp_axis == 0:  # FC1's bias is split like its rows; FC2's (row-parallel) is not
                axes["bias"] = 0
        sub = make_sharded_tensors_for_checkpoint(
            state, keys, axes, offsets, tp_group=expt_tp, dp_cp_group=metadata["dp_cp_group"]
        )
        for param in ("weight", "bias") if swiglu else ():
            if f"{keys}{param}" in sub:
                sub[f"{keys}{param}"] = apply_swiglu_sharded_factory(
                    sub[f"{keys}{param}"], offsets, singleton
                )
        for sharded in sub.values():  # replicated along expert data parallelism only
            sharded.replica_id = (*sharded.replica_id[:2], get_pg_rank(expt_dp))
        out[f"{prefix}weight{i}"] = sub[f"{keys}weight"]
        out[f"{prefix}_extra_state{i or ''}"] = sub[f"{keys}_extra_state"]
        if biases:
            out[f"{prefix}bias{i}"] = sub[f"{keys}bias"]
    return out


def expert_sharded_state_dict(
    module: nn.Module,
    prefix: str = "",
    sharded_offsets: tuple = (),
    metadata: dict | None = None,
    pg_collection: object = None,
) -> dict[str, Any]:
    """The sharded state dict of te_paged experts ``module`` (``linear_fc1``/``linear_fc2``),
    with Megatron's expert keys ``{prefix}experts.linear_fcK.weight``; the dict's own keys are
    ``module``'s state-dict keys under ``prefix`` plus ``linear_fcK._extra_state[i]`` (which
    :func:`drop_extra_state_keys` removes on load). Groups come from ``pg_collection``
    (``ep``, ``expt_dp``, ``expt_tp``), else from Megatron's ``parallel_state``.
    """
    out: dict[str, Any] = {}
    for name, tp_axis in _LINEARS:
        out |= linear_sharded_state_dict(
            getattr(module, name),
            f"{prefix}{name}.",
            f"{prefix}experts.",
            f"{name}.",
            tp_axis=tp_axis,
            swiglu=name == "linear_fc1" and module.config.gated_linear_unit,
            sharded_offsets=sharded_offsets,
            metadata=metadata,
            pg_collection=pg_collection,
        )
    return out


def drop_extra_state_keys(
    module: nn.Module, linears: tuple[str, ...] = ("linear_fc1", "linear_fc2")
) -> None:
    """Make ``module.load_state_dict`` ignore the ``_extra_state[i]`` entries of its expert
    ``linears`` (``""``: ``module`` itself): Megatron's Transformer Engine linears keep FP8
    metadata there, te_paged's linears keep nothing."""
    heads = tuple(f"{name}." if name else "" for name in linears)

    def hook(state_dict, prefix, *args) -> None:
        for key in [k for k in state_dict if k.startswith(prefix)]:
            rest = key[len(prefix) :]
            for head in heads:
                tail = rest[len(head) :]
                if rest.startswith(head) and tail.startswith("_extra_state") and "." not in tail:
                    del state_dict[key]
                    break

    module._register_load_state_dict_pre_hook(hook)
