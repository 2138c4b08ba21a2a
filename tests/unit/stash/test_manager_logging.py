"""The manager logs its pool (re)allocations at INFO, with the sizes it chose."""

from __future__ import annotations

import logging

import torch

from te_paged import PagedStashManager, mark_grouped_tensor
from tests.saving import Keep

LOGGER = "te_paged.stash.manager"


def _step(manager: PagedStashManager) -> None:
    manager.reset()
    outs = []
    for n in (5, 2):  # two live tensors of 8 rows, 4 balanced rows each: 2 balanced pages
        t = torch.randn(8, 3, requires_grad=True)
        mark_grouped_tensor(t)
        with manager.scope(8, torch.tensor(n), 4):
            outs.append(Keep.apply(t))
    sum(o.sum() for o in outs).backward()


def test_pool_sizing_after_the_capture_step_is_logged_at_info(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="te_paged")
    manager = PagedStashManager(
        page_size=4, buffer_size_factor_cuda=1.5, device="cpu", skip_immediate_backward=False
    )
    _step(manager)  # capture: nothing allocated, nothing said
    assert [r for r in caplog.records if r.name == LOGGER] == []
    _step(manager)  # the reset allocates: ceil(1.5 x 2) = 3 pages of 4 rows x 3 floats
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert record.levelno == logging.INFO
    message = record.getMessage()
    assert "pools sized from the capture step" in message
    assert "float32x3: 3 pages of 4 rows, 0.00 MiB" in message
    assert "capture peak 2 balanced / 3 observed pages" in message
    assert "buffer_size_factor_cuda 1.5 x the balanced peak" in message
    assert manager.buffers[next(iter(manager.buffers))].num_pages == 3
    caplog.clear()
    _step(manager)  # allocation-free steps say nothing
    assert [r for r in caplog.records if r.name == LOGGER] == []


def test_reallocation_after_release_is_logged_at_info(caplog) -> None:
    manager = PagedStashManager(
        page_size=4, buffer_size_factor_cuda=1.5, device="cpu", skip_immediate_backward=False
    )
    _step(manager)
    _step(manager)
    caplog.set_level(logging.DEBUG, logger="te_paged")
    manager.release()
    manager.buffer_size_factor_cuda = 3.0  # what the runner's grow_pool does
    _step(manager)
    levels = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert levels[0][0] == logging.DEBUG and "freed the paged-stash pools" in levels[0][1]
    assert levels[1][0] == logging.INFO
    assert "pools reallocated after release()" in levels[1][1]
    assert "float32x3: 6 pages" in levels[1][1] and "buffer_size_factor_cuda 3" in levels[1][1]
    assert all(r.levelno < logging.WARNING for r in caplog.records)
