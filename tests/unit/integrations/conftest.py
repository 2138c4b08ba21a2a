"""Fixtures of the integration unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    """The world group of a one-rank gloo process group, started here unless one runs."""
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group(
            "gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1
        )
    try:
        yield dist.group.WORLD
    finally:
        if started_here:
            dist.destroy_process_group()
