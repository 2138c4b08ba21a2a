"""The device-side layout shared by every stash kernel implementation.

All bookkeeping lives in small int tensors on the pool's device, so that a kernel can read and
update it without a host round trip:

``state`` (int64, one per :class:`~te_paged.stash.PagedStashBuffer`)
    ``HEAD``/``TAIL`` and ``HOST_HEAD``/``HOST_TAIL`` are monotone counters of the circular free
    lists (free pages = tail − head; slot ``i`` of the queue is ``free[i % num_pages]``);
    ``HWM``/``HOST_HWM`` the most pages ever in use; ``ROWS_STASHED`` and ``SPILLED`` running
    totals for statistics. ``DEMANDED``/``RETURNED`` count the pages stashes asked for and pops
    gave back *whether or not they were stored* (a stash that found no room, or ran after an
    overflow, still counts what it needed), and ``DEMAND_HWM`` is the most ever outstanding
    (``DEMANDED − RETURNED``): the pool a step would have needed to hold everything, which is
    what a runner grows an overflowed pool to. Each counter has one writer (the copy writes
    ``DEMANDED`` and ``DEMAND_HWM``, the pop ``RETURNED``), so copies and pops on two streams
    never race on a read-modify-write; a stale ``RETURNED`` only over-states the peak.
    ``COPY_TICKET``/``POP_TICKET`` are the fused kernels' scratch (:mod:`.triton_stash`): the
    programs of one launch count themselves out there, the last one writes the launch's
    bookkeeping and puts the ticket back to 0. Between launches both are 0 (the reference never
    touches them).

``flags`` (int64, one per manager, shared by all its pools)
    ``OVERFLOW`` counts stashes that found no room — once non-zero, every copy and pop is a
    no-op; ``HOST_SPILL`` counts tensors that went to the host tier; ``INVALID`` counts misuse
    the kernels refuse on the device: a token count the static buffer cannot hold (negative, or
    more tokens than its rows: nothing is stored, the step's result is wrong and a rerun would
    see the same count), a record popped a second time (and, from the layers, expert ids or
    token counts that cannot be right).

``record`` (per stashed tensor) — ``pages`` (int32, ``ceil(max_rows / page_size)`` slots) and
    ``meta`` (int64): ``ROWS`` stored, the ``TIER`` they went to, ``POPPED`` (0, then 1 once
    a pop returned the pages: a second pop of the record leaves the free list alone, zeroes the
    destination and counts ``INVALID``) and ``NEED``, the pages the tensor asked for (0 for an
    invalid count), which the first pop adds to ``RETURNED`` and clears.

Worked example (4 device pages, page size 2, free list initially ``[0 1 2 3]``, head 0, tail 4):
stash A (3 rows) takes slots 0–1 → pages ``[0 1]``, head 2; stash B (1 row) takes slot 2 → page
``[2]``, head 3; stash C (3 rows) needs 2 pages but only 1 is free → host tier or overflow. Pop A
writes pages 0, 1 into slots 4 % 4 = 0 and 5 % 4 = 1, tail 6; the queue now holds, from head 3,
``[3 0 1]``, so the next stash takes page 3 then 0: pages need not be contiguous and pops need
not be in stash order.
"""

from __future__ import annotations

import enum

__all__ = ["FLAGS_LEN", "META_LEN", "STATE_LEN", "Flag", "Meta", "State", "Tier"]


class State(enum.IntEnum):
    HEAD = 0
    TAIL = 1
    HWM = 2
    HOST_HEAD = 3
    HOST_TAIL = 4
    HOST_HWM = 5
    ROWS_STASHED = 6
    SPILLED = 7
    DEMANDED = 8
    RETURNED = 9
    DEMAND_HWM = 10
    COPY_TICKET = 11
    POP_TICKET = 12


class Flag(enum.IntEnum):
    OVERFLOW = 0
    HOST_SPILL = 1
    INVALID = 2


class Meta(enum.IntEnum):
    ROWS = 0
    TIER = 1
    POPPED = 2
    NEED = 3


class Tier(enum.IntEnum):
    NONE = 0  # nothing stored: the step overflowed
    DEVICE = 1
    HOST = 2


STATE_LEN = len(State)
FLAGS_LEN = len(Flag)
META_LEN = len(Meta)
