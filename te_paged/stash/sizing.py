"""Pool sizing from the capture step: Megatron's sign convention for the buffer factors, as pure
functions the manager calls.

A capture step records, per pool key, two peaks of concurrently live pages (each live tensor's
rows rounded up to whole pages, summed, maximised over the step):

* the *balanced* peak — every tensor at the balanced-case row count (``avg_num_tokens``),
  whatever the routing of that step was;
* the *observed* peak — every tensor at the rows it really had (``num_tokens``).

megatron-core 0.19.2 (``PagedStashManager.allocate_stash_buffers`` in
``megatron/core/transformer/moe/paged_stash.py``) reads the sign of
``moe_paged_stash_buffer_size_factor_cuda`` and ``_cpu`` to choose between them, and te_paged
keeps the same convention on every release:

=========  ===============================================================================
factor     pool pages
=========  ===============================================================================
``f > 0``  ``ceil(f × balanced peak)`` — sized for the balanced case; ``f`` is headroom for
           imbalance (the default 1.10)
``f < 0``  ``ceil(|f| × observed peak)`` — sized for what the capture step really held
``f = 0``  no pages (only the host factor may be 0: no host tier)
=========  ===============================================================================

Worked example, page size 64: two live tensors of 100 and 300 real rows, 200 balanced rows
each. Balanced peak = 4 + 4 = 8 pages, observed peak = 2 + 5 = 7 pages. Factor 1.10 →
``ceil(8.8)`` = 9 pages; factor −1.5 → ``ceil(10.5)`` = 11 pages.
"""

from __future__ import annotations

import math

from te_paged.config.checks import require_real

__all__ = ["check_factor", "describe_factor", "pool_pages"]


def check_factor(name: str, factor: object, *, zero_ok: bool) -> float:
    """``factor`` as a finite float, either sign; 0 only with ``zero_ok`` (the host factor)."""
    value = require_real(name, factor, -math.inf)
    if value == 0 and not zero_ok:
        raise ValueError(
            f"{name}=0 leaves no device pages, so every stash would spill or overflow; use a "
            "positive factor (× the balanced peak, e.g. 1.10) or a negative one (× the capture "
            "step's observed peak, e.g. -1.2)"
        )
    return value


def pool_pages(factor: float, balanced_pages: int, observed_pages: int) -> int:
    """Pages of one pool for ``factor`` (see the module's table).

    >>> pool_pages(1.10, balanced_pages=8, observed_pages=7)
    9
    >>> pool_pages(-1.5, balanced_pages=8, observed_pages=7)
    11
    >>> pool_pages(0.0, balanced_pages=8, observed_pages=7)
    0
    """
    peak = balanced_pages if factor >= 0 else observed_pages
    return math.ceil(abs(factor) * peak)


def describe_factor(factor: float) -> str:
    """How a factor sizes its pool, for log lines and records."""
    if factor >= 0:
        return f"{factor:g} x the balanced peak"
    return f"{-factor:g} x the observed peak"
