"""The static token budget's arithmetic, as pure functions of integers and a capacity factor.

For one rank with ``N`` input tokens, top-``K`` routing and capacity factor ``cf``::

    rank_rows     = ceil(N × K × cf)               [↑ block: 32 for MXFP8, one scale row]
    balanced_rows = floor(rank_rows / cf)          (the balanced case; N × K when known)
    split_rows    = rank_rows ↑ lcm(P, block)      (P equal pair budgets of split_rows / P)

Both use the decimal value of the factor, not its binary float: with 100 tokens, top-2 and
factor 1.1 the budget is 220 rows (float math gives 221) and ``balanced_rows(220, 1.1)`` is 200
(float ``//`` gives 199). :class:`~te_paged.config.MoEConfig` and the dispatcher call these;
neither rebuilds a config to change a factor.
"""

from __future__ import annotations

import math
from fractions import Fraction

__all__ = [
    "balanced_rows",
    "exact",
    "rank_rows",
    "round_up",
    "split_rows",
]


def exact(value: float) -> Fraction:
    """The decimal the user wrote, not its binary float: 100 × 2 × 1.1 must give 220, not 221."""
    return Fraction(repr(float(value)))


def round_up(rows: int, multiple: int) -> int:
    """``rows`` rounded up to a multiple of ``multiple`` (≥ 1)."""
    return -(-rows // multiple) * multiple


def rank_rows(num_tokens: int, topk: int, capacity_factor: float, block: int = 1) -> int:
    """A rank's static budget: ``ceil(num_tokens · topk · capacity_factor)``, whole ``block``s."""
    return round_up(math.ceil(num_tokens * topk * exact(capacity_factor)), block)


def balanced_rows(max_num_tokens: int, capacity_factor: float) -> int:
    """The balanced-case rows of a budget of ``max_num_tokens``: ``floor(max / factor)``."""
    return math.floor(max_num_tokens / exact(capacity_factor))


def split_rows(rows: int, ep_size: int, block: int = 1) -> tuple[int, int]:
    """``(rows, pair_rows)``: ``rows`` rounded up so that it splits into ``ep_size`` equal pair
    budgets that stay ``block``-aligned (``lcm(ep_size, block)``)."""
    rows = round_up(rows, math.lcm(ep_size, block))
    return rows, rows // ep_size
