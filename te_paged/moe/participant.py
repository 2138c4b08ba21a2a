"""``PagedStashParticipant``: how a step runner finds the pieces of a model it drives.

A runner resets the stash managers at the step boundary, reads their flags and the
dispatchers' over-budget counters once per step, and for a rerun switches the dispatchers to
dropless and the managers off. It finds them through this explicit protocol, never by attribute
names: a module takes part by inheriting :class:`PagedStashParticipant` (te_paged's
``TEGroupedMLP`` and ``MoELayer`` do; so does the Megatron integration's MoE layer, whose token
dispatcher is not a module) and overriding what it owns. :func:`find_participants` walks a
model (or several model chunks) and returns each manager and dispatcher once, in module order.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

import torch
from torch import nn

from te_paged.moe.dispatcher import StaticBudgetDispatcher
from te_paged.stash import PagedStashManager

__all__ = ["PagedStashParticipant", "Participants", "find_participants"]


class PagedStashParticipant(abc.ABC):  # noqa: B024 - a marker protocol with default methods
    """A module a step runner drives; override what the module owns (both default to none)."""

    def paged_stash_managers(self) -> tuple[PagedStashManager, ...]:
        """The stash managers this module stashes into."""
        return ()

    def budget_dispatchers(self) -> tuple[StaticBudgetDispatcher, ...]:
        """The static-budget dispatchers this module routes through."""
        return ()

    def attach_runner(self, runner: object) -> None:  # noqa: B027 - optional, default none
        """Called by a step runner built over a model holding this module (default: nothing).
        A module whose static budget drops tokens can refuse to train without one, which
        would keep a step that dropped them."""

    def invalid_count_flags(self) -> tuple[torch.Tensor, ...]:
        """Device counters (int64 0-dim) of inputs this module found invalid without a host read
        (token counts that are negative or exceed the buffer). The runner zeroes them at each
        step boundary and refuses a step in which any is non-zero."""
        return ()


class Participants:
    """The distinct managers, dispatchers and invalid-count flags of a model, in module order."""

    def __init__(
        self,
        managers: Iterable[PagedStashManager],
        dispatchers: Iterable[StaticBudgetDispatcher],
        invalid_flags: Iterable[torch.Tensor] = (),
    ) -> None:
        self.managers = list({id(m): m for m in managers}.values())
        self.dispatchers = list({id(d): d for d in dispatchers}.values())
        self.invalid_flags = list({id(t): t for t in invalid_flags}.values())

    def __bool__(self) -> bool:
        return bool(self.managers or self.dispatchers or self.invalid_flags)


def find_participants(models: nn.Module | Iterable[nn.Module]) -> Participants:
    """Every :class:`PagedStashParticipant`'s managers and dispatchers in ``models`` (a module,
    e.g. a Megatron DDP wrapper, or a list of model chunks)."""
    chunks = [models] if isinstance(models, nn.Module) else list(models)
    managers: list[PagedStashManager] = []
    dispatchers: list[StaticBudgetDispatcher] = []
    flags: list[torch.Tensor] = []
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, PagedStashParticipant):
                managers.extend(module.paged_stash_managers())
                dispatchers.extend(module.budget_dispatchers())
                flags.extend(module.invalid_count_flags())
    return Participants(managers, dispatchers, flags)
