"""Occupancy from a compiled kernel's resources (te_paged/tools/occupancy.py): the worked
examples of its docstring, CUDA's occupancy calculator's answers for sm_90."""

from __future__ import annotations

import pytest

from te_paged.tools.occupancy import SM_LIMITS, KernelResources, occupancy

H100 = SM_LIMITS[90]


def resources(registers: int, threads: int = 128, shared: int = 0) -> KernelResources:
    return KernelResources("k", 90, registers, threads, shared, 0)


@pytest.mark.parametrize(
    ("registers", "blocks", "limited_by"),
    [
        (90, 5, "registers"),  # 3,072 a warp: 5 warps a sub-partition, 20 an SM
        (93, 5, "registers"),
        (40, 12, "registers"),  # 1,280 a warp: 12 a sub-partition, 48 an SM
        (32, 16, "warps, registers"),  # 1,024 a warp: 64 warps, the SM's limit as well
        (22, 16, "warps"),
        (0, 16, "warps"),
    ],
)
def test_four_warp_blocks_on_sm_90(registers: int, blocks: int, limited_by: str) -> None:
    occ = occupancy(resources(registers), H100)
    assert (occ.blocks, occ.warps, occ.limited_by) == (blocks, 4 * blocks, limited_by)
    assert occ.fraction == pytest.approx(4 * blocks / 64)


def test_the_block_limit_and_shared_memory_bind_where_they_are_smallest() -> None:
    # One warp a block at 16 registers: 64 warps would fit, 32 blocks are the limit.
    assert occupancy(resources(16, threads=32), H100).limited_by == "blocks"
    # 100 KiB of shared memory a block (+1 KiB reserved): two blocks in 228 KiB.
    occ = occupancy(resources(32, shared=100 * 1024), H100)
    assert (occ.blocks, occ.limited_by) == (2, "shared memory")


def test_a_launch_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="not a launch"):
        occupancy(resources(32, threads=0), H100)
