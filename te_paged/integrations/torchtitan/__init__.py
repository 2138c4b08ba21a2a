"""te_paged inside torchtitan 0.3: paged-stash MoE layers, a static-budget token dispatcher, a
Trainer whose step reruns when a budget overflowed, and CPU stand-ins for tests.

Importing ``te_paged`` never imports torchtitan; importing this package does, and without
torchtitan it raises ``ImportError`` with the install line. See docs/torchtitan.md.

=================  =====================================================================
module             what
=================  =====================================================================
``moe``            :class:`PagedGroupedExperts`, :class:`StaticBudgetTokenDispatcher`,
                   :class:`PagedRoutedExperts`, :func:`convert_moe`,
                   :class:`PagedStashConverter` (``model_registry(converters=[...])``),
                   :func:`attach_paged_stash`
``overrides``      ``paged_stash_moe``, for ``--override.imports``
``trainer``        :class:`PagedStashTrainer` (its config's ``te_paged`` section) and
                   :class:`TorchtitanPagedStashRunner`
``cpu_shims``      stand-ins for torchtitan 0.3.0's CUDA assumptions on a CPU-only torch,
                   for CPU runs only (never installed by importing anything)
=================  =====================================================================
"""

from __future__ import annotations

from te_paged.integrations import TORCHTITAN_INSTALL, TORCHTITAN_RELEASE
from te_paged.torch_compat import require_torch

# torchtitan 0.3.0 imports torch.distributed.fsdp.DataParallelMeshDims, new in torch 2.12.
require_torch((2, 12), f"te_paged.integrations.torchtitan (torchtitan {TORCHTITAN_RELEASE})")

try:
    import torchtitan  # noqa: F401
except ImportError as e:  # pragma: no cover - the tests run with torchtitan installed
    raise ImportError(
        f"te_paged.integrations.torchtitan needs torchtitan {TORCHTITAN_RELEASE}: "
        f"{TORCHTITAN_INSTALL} (the constraint keeps pip from replacing your torch)"
    ) from e

from te_paged.integrations.torchtitan.moe import (  # noqa: E402 - after the checks
    PagedGroupedExperts,
    PagedRoutedExperts,
    PagedStashConverter,
    StaticBudgetTokenDispatcher,
    attach_paged_stash,
    convert_moe,
)

__all__ = [
    "PagedGroupedExperts",
    "PagedRoutedExperts",
    "PagedStashConverter",
    "StaticBudgetTokenDispatcher",
    "attach_paged_stash",
    "convert_moe",
]
