"""te_paged's MoE layers as a torchtitan override, for ``--override.imports``::

    --override.imports \
      'te_paged.integrations.torchtitan.overrides.paged_stash_moe={"moe_paged_stash": true}'

The override replaces every ``RoutedExperts`` node (after torchtitan set its sharding, which
the replacement keeps) as :func:`~te_paged.integrations.torchtitan.moe.convert_node` does; its
keyword arguments are te_paged's knobs. The layers still need a step runner: use it with
:class:`~te_paged.integrations.torchtitan.PagedStashTrainer` (whose own conversion, before the
override, it then re-applies with these options).
"""

from __future__ import annotations

from typing import Any

from torchtitan.config import override
from torchtitan.models.common.moe import RoutedExperts

from te_paged.integrations.torchtitan.moe import convert_node

__all__ = ["paged_stash_moe"]


@override(target=RoutedExperts.Config, description="te_paged: static budget, paged experts")
def paged_stash_moe(cfg: RoutedExperts.Config, **options: Any) -> RoutedExperts.Config:
    return convert_node(cfg, **options)
