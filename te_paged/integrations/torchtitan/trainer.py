"""torchtitan's ``Trainer`` with paged stash: :class:`PagedStashTrainer` and the step runner
:class:`TorchtitanPagedStashRunner`.

A torchtitan job selects the trainer by its config class (``config.build()`` builds the
config's owner): a config registry function returns ``PagedStashTrainer.Config(...)`` where it
returned ``Trainer.Config(...)``, and the ``te_paged`` section carries te_paged's knobs::

    PagedStashTrainer.Config(
        model_spec=..., ...,                               # as for Trainer.Config
        te_paged=TePagedConfig(moe_expert_rank_capacity_factor=1.25),
        training=TrainingConfig(..., disable_cuda_graphs=True),
    )

or, on the command line, ``--te_paged.moe_expert_rank_capacity_factor 1.5``.

The trainer converts the model config's MoE layers (:func:`~.moe.convert_moe`) before
torchtitan builds the model, gives the built experts their shared stash manager, and runs every
optimizer step's forward and backward passes under :class:`TorchtitanPagedStashRunner`:
torchtitan's own ``train_step`` still fetches the data, counts the valid tokens, clips, steps
the optimizer and the scheduler and logs; the runner sits in ``forward_backward_step``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.trainer import Trainer

from te_paged.config.checks import require_bool, require_int
from te_paged.integrations.torchtitan.moe import (
    PagedStashConverter,
    attach_paged_stash,
    convert_moe,
)
from te_paged.runtime import PagedStashRunner, StepRecord, StepState
from te_paged.stash import PagedStashManager

__all__ = ["PagedStashTrainer", "TePagedConfig", "TorchtitanPagedStashRunner"]

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True, slots=True)
class TePagedConfig(PagedStashConverter.Config):
    """The ``te_paged`` section of :class:`PagedStashTrainer`'s config: the converter's knobs
    (te_paged's names) and the runner's."""

    #: Convert the model config's MoE layers (off: the model already has te_paged's layers,
    #: e.g. from ``model_registry(converters=[PagedStashConverter.Config(...)])``).
    convert_moe: bool = True
    max_consecutive_fallbacks: int = 3
    grow_pool: bool = True
    grow_headroom: float = 1.10
    per_rank_pools: bool = False
    max_pool_bytes: int | None = None
    grow_capacity: bool = True
    capacity_headroom: float = 1.10
    max_capacity_factor: float | None = None
    auto_wire_steps: int = 8
    #: The largest batch of any step, tokens per rank (``local_batch_size x`` the longest
    #: ``seq_len``), for a variable-length run: the runner's ``max_tokens_per_rank``.
    max_tokens_per_rank: int | None = None

    def __post_init__(self) -> None:  # checked where given, not after the model is built
        PagedStashConverter.Config.__post_init__(self)
        for name in ("convert_moe", "grow_pool", "per_rank_pools", "grow_capacity"):
            require_bool(name, getattr(self, name))  # "no" would read as True
        if self.max_tokens_per_rank is not None:
            require_int("max_tokens_per_rank", self.max_tokens_per_rank, minimum=1)


class TorchtitanPagedStashRunner(PagedStashRunner):
    """:class:`~te_paged.runtime.PagedStashRunner` over a torchtitan trainer's model parts.

    On top of the base runner (managers reset, one world-wide flag reduction per step, the
    dropless rerun without the stash, RNG and module buffers — the routers' ``expert_bias`` and
    ``tokens_per_expert_E`` — restored), gradients are cleared as torchtitan's ``train_step``
    clears them (``optimizers.zero_grad(set_to_none=...)``), so a rerun starts from exactly the
    state the first attempt started from, FSDP's sharded gradients included.
    """

    def __init__(self, trainer: Trainer, **kwargs: Any) -> None:
        super().__init__(trainer.model_parts, group=None, measure_fallback_memory=False, **kwargs)
        self.trainer = trainer

    def snapshot_state(self) -> StepState:
        state = super().snapshot_state()
        state.extra["ntokens_seen"] = getattr(self.trainer, "ntokens_seen", None)
        return state

    def restore_state(self, state: StepState) -> None:
        super().restore_state(state)
        if state.extra["ntokens_seen"] is not None:
            self.trainer.ntokens_seen = state.extra["ntokens_seen"]

    def clear_gradients(self) -> None:
        self.trainer.optimizers.zero_grad(
            set_to_none=self.trainer.config.training.disable_cuda_graphs
        )


def _to_device(batch: Any, device: torch.device) -> Any:
    """One microbatch group as ``Trainer.train_step`` hands it to ``forward_backward_step``."""
    if isinstance(batch, list):
        return [_to_device(b, device) for b in batch]
    input_dict, labels = batch
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
    return moved, labels.to(device)


class PagedStashTrainer(Trainer):
    """torchtitan's ``Trainer`` whose steps run under :class:`TorchtitanPagedStashRunner`.

    Per optimizer step, the first ``forward_backward_step`` call runs the forward and backward
    passes of *every* microbatch group of the step as one runner step (the step's data was read
    ahead by :meth:`train_step`, so a rerun replays it); it and the later calls return each
    group's loss to torchtitan's ``train_step``, which logs and steps the optimizer as usual.
    :attr:`paged_stash_records` keeps the runner's records (``StepRecord``: attempts, flags,
    pool sizes and suggestions).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        te_paged: TePagedConfig = dataclasses.field(default_factory=TePagedConfig)

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            if not self.training.disable_cuda_graphs:
                raise ValueError(
                    "PagedStashTrainer needs --training.disable_cuda_graphs: the paged stash's "
                    "hooks and its dropless rerun (one host read per layer) cannot be captured "
                    "in torchtitan's CUDA graph"
                )

    def __init__(self, config: Config) -> None:
        options = config.te_paged
        if options.convert_moe:
            convert_moe(config.model_spec.model, **options.stash_options())
        super().__init__(config)
        self.paged_stash_managers: list[PagedStashManager] = attach_paged_stash(
            self.model_parts, self.device
        )
        self.paged_stash_runner = TorchtitanPagedStashRunner(
            self,
            max_consecutive_fallbacks=options.max_consecutive_fallbacks,
            grow_pool=options.grow_pool,
            grow_headroom=options.grow_headroom,
            per_rank_pools=options.per_rank_pools,
            max_pool_bytes=options.max_pool_bytes,
            grow_capacity=options.grow_capacity,
            capacity_headroom=options.capacity_headroom,
            max_capacity_factor=options.max_capacity_factor,
            auto_wire_steps=options.auto_wire_steps,
            max_tokens_per_rank=options.max_tokens_per_rank,
        )
        self._groups: list[Any] | None = None  # this step's microbatch groups, read ahead
        self._losses: list[torch.Tensor] | None = None
        self._call = 0

    @property
    def paged_stash_records(self):
        return self.paged_stash_runner.records

    @property
    def last_losses(self) -> list[torch.Tensor] | None:
        """The losses of the last step's microbatch groups (the kept attempt's)."""
        return self._losses

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        per_group = self.num_pipeline_parallel_microbatches
        groups = []
        for _ in range(self.gradient_accumulation_steps):
            microbatches = [next(data_iterator) for _ in range(per_group)]
            groups.append(microbatches if self.parallel_dims.pp_enabled else microbatches[0])
        self._groups, self._losses, self._call = groups, None, 0
        flat = [b for g in groups for b in (g if isinstance(g, list) else [g])]
        try:
            super().train_step(iter(flat))
        finally:
            self._groups = None

    def forward_backward_step(
        self,
        *,
        input_dict: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
        labels: torch.Tensor | list[torch.Tensor],
        global_valid_tokens: torch.Tensor,
    ) -> torch.Tensor:
        base = super().forward_backward_step
        if self._groups is None:  # called outside train_step: a step of this group alone
            groups: list[Any] = [(input_dict, labels)]
            if isinstance(input_dict, list):
                groups = [list(zip(input_dict, labels, strict=True))]
        elif self._call == 0:
            groups = self._groups
        else:
            self._call += 1
            return self._losses[self._call - 1]

        def attempt() -> list[torch.Tensor]:
            losses = []
            for group in groups:
                moved = _to_device(group, self.device)
                if isinstance(moved, list):
                    inputs, targets = [m[0] for m in moved], [m[1] for m in moved]
                else:
                    inputs, targets = moved
                losses.append(
                    base(input_dict=inputs, labels=targets, global_valid_tokens=global_valid_tokens)
                )
            return losses

        self._losses, _ = self.paged_stash_runner.step(attempt, step=self.step)
        self._call = 1
        return self._losses[0]

    @property
    def last_record(self) -> StepRecord | None:
        records = self.paged_stash_runner.records
        return records[-1] if records else None
