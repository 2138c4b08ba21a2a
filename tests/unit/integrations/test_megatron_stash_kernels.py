"""Megatron-core 0.19.2's paged-stash Triton kernels and te_paged's leave the same bytes.

Both designs keep one pool of fixed-size pages per (dtype, hidden) and a circular free list of
page ids whose monotone head/tail counters live on the device: a stash takes the pages at the
head, a pop writes them back at the tail. Fed the same rows and the same pool state they must
take the same pages in the same order and leave the same pool, free lists, popped rows and
flags. Megatron's kernels are driven the way Megatron drives them (``PagedTensor``'s
``offload_to_stash`` / ``reload_from_stash`` on a ``PagedStashBuffer``: both run on CPU), te_paged's
are :func:`triton_stash_copy` / :func:`triton_stash_pop`; both run under the Triton interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py). Everything is compared after every call
through one explicit mapping of the two layouts (:func:`megatron_layout`). Where the designs
differ the difference is asserted, not skipped (the tests after "Where the designs differ").

Shape suffixes: ``R`` rows of the static buffer, ``H`` hidden, ``N`` pool rows (``P·S``), ``P``
pages, ``S`` page size, ``M`` record page slots.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

pytest.importorskip("triton", reason="the stash kernels need `pip install triton`")
pytest.importorskip(
    "megatron.core.transformer.moe.ops.paged_stash",
    reason="needs megatron-core 0.19.2, whose paged stash ships these Triton kernels",
)

from megatron.core.transformer.moe import paged_stash as mc

from te_paged.kernels.layout import FLAGS_LEN, META_LEN, Flag, Meta, State, Tier
from te_paged.kernels.triton_stash import triton_stash_copy, triton_stash_pop
from te_paged.runtime.schedules import PipelineConfig, pass_order
from te_paged.stash import PagedStashBuffer, StashKey, storage_dtype
from te_paged.tools.free_lists import FreeList, prepare_free_list
from tests.triton_device import triton_device

S = 4  # page size: a handful of rows spans pages and ends in a partial page
R = 10  # rows of the static buffer: 3 record slots, the last one partial
H = 8  # hidden: under Megatron's 1024-element block, so its masked loop runs
COUNTS = (0, S, S + 3, R)  # token counts: none, exactly a page, a partial last page, all rows
FP8 = torch.float8_e4m3fn  # Megatron stores it as uint8 bytes, as te_paged does
DTYPES = (torch.bfloat16, torch.float32, FP8)

# The two layouts, te_paged's (te_paged/kernels/layout.py) against Megatron 0.19.2's
# (megatron/core/transformer/moe/paged_stash.py:63-98 the pool, :185-186 the record; the
# kernels are in ops/paged_stash.py, and bare line numbers below are paged_stash.py's):
#
#   te_paged                                   Megatron
#   state[HEAD], state[HOST_HEAD]              free_list_head[0], free_list_head[1]
#   state[TAIL], state[HOST_TAIL]              free_list_tail[0], free_list_tail[1]
#   free_P.numel(), host_free_P.numel()        free_list_capacity[0], free_list_capacity[1]
#   free_P, host_free_P (int32)                free_list_cuda, free_list_host (int64)
#   pool_NH, host_pool_NH (same-width ints)    cuda_buffer, host_buffer (the dtype; FP8 as uint8)
#   flags[OVERFLOW] (a count: 1 at most, as    overflow[0] (0/1, one tensor for every buffer)
#     copies stop counting once it is set)
#   flags[HOST_SPILL] (tensors spilled)        host_spill[0] (0/1): the count > 0
#   rec_pages_M[:need]                         page_record[:need] (each stash zeroes the rest)
#   rec_meta[TIER] DEVICE / HOST / NONE        spilled_to_host 0 / 1 / 1 if this stash overflowed,
#                                              0 if an earlier one had
#   rec_meta[ROWS], rec_meta[POPPED]           none: Megatron's pop re-reads num_tokens and
#                                              marks nothing
#   state[HWM, HOST_HWM, ROWS_STASHED,         none
#     SPILLED], flags[INVALID]
#
# Worked example, 4 device pages of S = 2, no host tier. Fresh: te_paged HEAD 0, TAIL 4, free_P
# [0 1 2 3] is Megatron's head [0 0], tail [4 0], capacity [4 0], free_list_cuda [0 1 2 3].
# Stash A (3 rows): both read slots 0, 1 -> pages [0 1] (rec_pages_M / page_record), HEAD 2 is
# head [2 0]. Stash B (1 row): slot 2 -> page 2, head [3 0]. Pop A: pages 0, 1 go to slots
# 4 % 4 and 5 % 4, TAIL 6 is tail [6 0]. Stash C (3 rows): slots 3 and 4 % 4 -> pages [3 0],
# head [5 0]. Counters only grow in both; a slot is the counter modulo the capacity.


def megatron_layout(pool: PagedStashBuffer, flags: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """te_paged's pool state written in Megatron's layout: every field both designs have.

    The pools come back as bytes (Megatron stores bf16 as bf16, te_paged as int16)."""
    state = pool.state
    capacity = [pool.free_P.numel(), pool.host_free_P.numel()]
    return {
        "free_list_head": state[[int(State.HEAD), int(State.HOST_HEAD)]],
        "free_list_tail": state[[int(State.TAIL), int(State.HOST_TAIL)]],
        "free_list_capacity": torch.tensor(capacity, device=state.device),
        "free_list_cuda": pool.free_P.long(),
        "free_list_host": pool.host_free_P.long(),
        "cuda_buffer": _bytes(pool.pool_NH),
        "host_buffer": _bytes(pool.host_pool_NH) if pool.host_num_pages else None,
        "overflow": flags[[int(Flag.OVERFLOW)]],
        "host_spill": (flags[[int(Flag.HOST_SPILL)]] > 0).long(),
    }


def megatron_state(buf: mc.PagedStashBuffer) -> dict[str, torch.Tensor | None]:
    """The same fields read from Megatron's buffer."""
    out = {k: getattr(buf, k) for k in ("free_list_head", "free_list_tail", "free_list_capacity")}
    out |= {"free_list_cuda": buf.free_list_cuda, "free_list_host": buf.free_list_host}
    out["cuda_buffer"] = _bytes(buf.cuda_buffer)
    out["host_buffer"] = None if buf.host_buffer is None else _bytes(buf.host_buffer)
    out |= {"overflow": buf.overflow, "host_spill": buf.host_spill}
    return {k: None if v is None else v.clone() for k, v in out.items()}  # a snapshot


def megatron_record(rec_pages_M: torch.Tensor, rec_meta: torch.Tensor) -> tuple[list[int], int]:
    """te_paged's record in Megatron's terms: the page ids ``page_record`` starts with and
    ``spilled_to_host`` (-1 for ``Tier.NONE``: Megatron's value then depends on whether this
    stash or an earlier one overflowed, which the overflow test asserts)."""
    need = -(-int(rec_meta[Meta.ROWS]) // S)
    spilled = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NONE: -1}[Tier(int(rec_meta[Meta.TIER]))]
    return rec_pages_M[:need].tolist(), spilled


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a, b)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int, device) -> torch.Tensor:
    """Random bytes as ``dtype``: NaN payloads, infinities and -0 included."""
    width = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * width), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def _megatron_buffer(
    dtype: torch.dtype, hidden: int, pages: int, host_pages: int, device
) -> mc.PagedStashBuffer:
    """Megatron's buffer as ``allocate_stash_buffers`` builds it (FP8 e4m3/e8m0 as uint8:
    paged_stash.py:609-611), sharing fresh ``overflow`` / ``host_spill`` flags."""
    buf_dtype = torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu) else dtype
    flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(2)]
    pinned = device.type == "cuda"
    host_tokens = host_pages * S if pinned else 0
    buf = mc.PagedStashBuffer(pages * S, hidden, S, device, *flags, buf_dtype, host_tokens)
    if host_pages and not pinned:
        # Megatron pins its host tier (paged_stash.py:76-78), which needs CUDA: the same tier in
        # plain memory, every other field as paged_stash.py:71-112 sets it.
        buf.num_host_pages, buf.total_host_tokens = host_pages, host_pages * S
        buf.host_buffer = torch.empty(host_pages * S, hidden, dtype=buf_dtype)
        buf.free_list_host = torch.arange(host_pages, dtype=torch.int64, device=device)
        buf._reset_free_list_host = buf.free_list_host.clone()
        for t in (buf.free_list_tail, buf.free_list_capacity, buf._reset_tail):
            t[1] = host_pages
    return buf


@dataclasses.dataclass
class Stashed:
    """One tensor stashed by both: te_paged's record, Megatron's ``PagedTensor``."""

    src_RH: torch.Tensor
    rec_pages_M: torch.Tensor
    rec_meta: torch.Tensor
    paged: mc.PagedTensor


class Pair:
    """The same pool twice, in te_paged's layout and in Megatron's, fed the same calls."""

    def __init__(self, dtype: torch.dtype, pages: int, host_pages: int = 0, hidden: int = H):
        self.device = triton_device()
        self.dtype, self.hidden, self.seed = dtype, hidden, 0
        self.te = PagedStashBuffer(StashKey(dtype, hidden), pages, S, self.device, host_pages)
        self.flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=self.device)
        self.mc = _megatron_buffer(dtype, hidden, pages, host_pages, self.device)
        # Garbage, not zeros, in the pools: a row a call must leave alone shows if it is written.
        for pool in (self.te.pool_NH, self.te.host_pool_NH):
            pool.copy_(_random(pool.dtype, tuple(pool.shape), self._next_seed(), self.device))
        self.load()

    def _next_seed(self) -> int:
        self.seed += 1
        return self.seed

    def load(self) -> None:
        """Write te_paged's state into Megatron's buffer through the mapping, then compare."""
        for name, value in megatron_layout(self.te, self.flags).items():
            target = getattr(self.mc, name)
            if name.endswith("_buffer"):
                target = None if target is None else _bytes(target)
            if value is not None:
                target.copy_(value)
        self.check("load")

    def set_free_list(self, free_P: tuple[int, ...], head: int, tail: int) -> None:
        """Give te_paged's device tier this free list, then Megatron's through the mapping."""
        self.te.free_P.copy_(torch.tensor(free_P, dtype=torch.int32))
        self.te.state[State.HEAD], self.te.state[State.TAIL] = head, tail
        self.load()

    def check(self, after: str) -> None:
        want, got = megatron_layout(self.te, self.flags), megatron_state(self.mc)
        for name, value in want.items():
            assert _same(value, got[name]), (
                f"after {after}: {name} differs: te_paged {value}, Megatron {got[name]}"
            )

    def stash(self, num_tokens: int, src_RH: torch.Tensor | None = None, tokens_per_row: int = 1,
              compare: bool = True) -> Stashed:  # fmt: skip
        """Stash ``num_tokens`` of ``src_RH`` (random ``R`` rows by default) with both."""
        if src_RH is None:
            src_RH = _random(self.dtype, (R, self.hidden), self._next_seed(), self.device)
        max_rows = src_RH.shape[0]
        n = torch.tensor([num_tokens], dtype=torch.int64, device=self.device)
        # Garbage record: te_paged's copy must write the meta and leave unused slots alone.
        rec_pages_M = torch.full((-(-max_rows // S),), -7, dtype=torch.int32, device=self.device)
        rec_meta = torch.full((META_LEN,), 5, dtype=torch.int64, device=self.device)
        # As the manager does: the rows as their same-width integers (te_paged/stash/packing.py).
        triton_stash_copy(src_RH.view(storage_dtype(self.dtype)), n, tokens_per_row, S,
                          *self.te.kernel_args(), self.flags, rec_pages_M, rec_meta)  # fmt: skip
        paged = mc.PagedTensor(
            src_RH,
            num_tokens_tensor=n.clone(),
            max_num_tokens=max_rows * tokens_per_row,
            hidden_size=self.hidden,
            page_size=S,
            is_columnwise_scale_inv=tokens_per_row == mc.SCALE_INV_BLOCK_SIZE,
        )
        paged.offload_to_stash(self.mc)
        stashed = Stashed(src_RH, rec_pages_M, rec_meta, paged)
        if compare:
            pages, spilled = megatron_record(rec_pages_M, rec_meta)
            record = paged.page_record.tolist()
            assert record[: len(pages)] == pages, f"stash of {num_tokens}: pages {record} {pages}"
            assert not any(record[len(pages) :]), f"Megatron zeroes unused slots: {record}"
            if spilled >= 0:
                assert int(paged.spilled_to_host) == spilled, (num_tokens, spilled)
            self.check(f"stash of {num_tokens} tokens")
        return stashed

    def pop(self, stashed: Stashed, zero_padding: bool = False, compare: bool = True):
        """Pop ``stashed`` with both into the same garbage; returns (te_paged's, Megatron's)."""
        garbage = _random(self.dtype, tuple(stashed.src_RH.shape), self._next_seed(), self.device)
        te_dst, mc_dst = garbage.clone(), garbage.clone()
        rec = (stashed.rec_pages_M, stashed.rec_meta)
        triton_stash_pop(te_dst.view(storage_dtype(self.dtype)), S, *self.te.kernel_args(),
                         self.flags, *rec, zero_padding)  # fmt: skip
        # reload_paged_tensors allocates the destination (torch.empty, paged_stash.py:526) and
        # then calls reload_from_stash, which fills it.
        stashed.paged._tensor = mc_dst
        stashed.paged.reload_from_stash(self.mc)
        if compare:
            assert torch.equal(_bytes(te_dst), _bytes(mc_dst)), "popped rows differ"
            self.check("pop")
        return te_dst, mc_dst


def _rows(stashed: Stashed) -> int:
    return int(stashed.rec_meta[Meta.ROWS])


def _assert_round_trip(stashed: Stashed, dst_RH: torch.Tensor) -> None:
    """The popped rows are the stashed ones, bit for bit (both sides agree, and are right)."""
    rows = _rows(stashed)
    assert torch.equal(_bytes(dst_RH[:rows]), _bytes(stashed.src_RH[:rows]))


# ------------------------------------------------------------------------- same bytes


@pytest.mark.parametrize("host_pages", [0, 3])
def test_fresh_pools_map_onto_each_other(host_pages: int) -> None:
    """The mapping holds between the two constructors' own fresh states (pool bytes aside:
    Megatron's are uninitialised), so it is not only self-consistent."""
    device = triton_device()
    te = PagedStashBuffer(StashKey(torch.bfloat16, H), 5, S, device, host_pages)
    flags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=device)
    want = megatron_layout(te, flags)
    got = megatron_state(_megatron_buffer(torch.bfloat16, H, 5, host_pages, device))
    for name in want:
        if name.endswith("_buffer"):
            assert (want[name] is None) == (got[name] is None), name
            assert want[name] is None or want[name].shape == got[name].shape, name
        else:
            assert torch.equal(want[name], got[name]), (name, want[name], got[name])


@pytest.mark.parametrize(
    ("dtype", "hidden"),
    [*((d, H) for d in DTYPES), (torch.bfloat16, 1024), (torch.float32, 1030)],
    ids=["bf16", "fp32", "fp8", "bf16-h1024", "fp32-h1030"],  # 1024: Megatron's unmasked loop
)
def test_stash_and_out_of_order_pops(dtype: torch.dtype, hidden: int) -> None:
    """Token counts 0, a page, a partial page and the whole buffer; pops out of stash order;
    a last stash whose slots wrap around the circular list."""
    pair = Pair(dtype, pages=7, hidden=hidden)
    stashed = [pair.stash(n) for n in COUNTS]  # 0 + 1 + 2 + 3 = 6 of 7 pages
    assert [len(megatron_record(s.rec_pages_M, s.rec_meta)[0]) for s in stashed] == [0, 1, 2, 3]
    for i in (2, 0, 3, 1):
        te_dst, _ = pair.pop(stashed[i])
        _assert_round_trip(stashed[i], te_dst)
    last = pair.stash(R)  # head 6: slots 6, 7 % 7, 8 % 7; the pops wrote pages 1, 2 to 0, 1
    assert megatron_record(last.rec_pages_M, last.rec_meta)[0] == [6, 1, 2]
    _assert_round_trip(last, pair.pop(last)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_1f1b_stage0_free_list(dtype: torch.dtype) -> None:
    """Stage 0 of 4 under 1F1B with 8 microbatches, 2 layers: every forward stashes a tensor
    per layer, every backward pops its microbatch's in reverse layer order. The free list ends
    permuted and wrapped, and tensors get pages from several popped ones."""
    pair = Pair(dtype, pages=24)  # 4 microbatches x 2 layers x 3 pages live at most
    rng = random.Random(1)
    live: dict[tuple[int, int], Stashed] = {}
    scattered = False
    for p in pass_order(PipelineConfig(pipeline_parallel=4, microbatches=8), 0):
        for layer in range(2) if p.forward else (1, 0):
            if p.forward:
                s = live[p.microbatch, layer] = pair.stash(rng.choice(COUNTS[1:]))
                pages = megatron_record(s.rec_pages_M, s.rec_meta)[0]
                scattered |= any(b != a + 1 for a, b in itertools.pairwise(pages))
            else:
                s = live.pop((p.microbatch, layer))
                _assert_round_trip(s, pair.pop(s)[0])
    # The case this test is for: pages not consecutive, and the counters past the capacity.
    assert scattered and int(pair.te.state[State.HEAD]) > 24, pair.te.state
    assert not pair.flags.any(), pair.flags


@pytest.mark.parametrize("kind", list(FreeList), ids=[k.value for k in FreeList])
def test_bench_free_lists(kind: FreeList) -> None:
    """The free lists ``te-paged bench`` and the GPU check start from (te_paged/tools/
    free_lists.py: 1F1B's is stage 0's after its last forward, counters far past the capacity;
    alternating's has no two adjacent pages): both take exactly the pages the list holds."""
    prepared = prepare_free_list(kind, R, S)
    pair = Pair(torch.bfloat16, pages=prepared.num_pages)
    pair.set_free_list(prepared.free_P, prepared.head, prepared.tail)
    for _ in range(2):  # a pop hands the same pages back in the same order
        a = pair.stash(R)
        assert tuple(megatron_record(a.rec_pages_M, a.rec_meta)[0]) == prepared.pages
        _assert_round_trip(a, pair.pop(a)[0])


def test_random_order_fragmented() -> None:
    """Seeded random stashes and pops in any order on a small pool, each only when it fits."""
    pair = Pair(torch.float32, pages=6)
    rng = random.Random(0)
    live: list[Stashed] = []
    free = 6
    for _ in range(24):
        n = rng.choice((*COUNTS, rng.randint(1, R)))
        need = -(-n // S)
        if live and (need > free or rng.random() < 0.4):
            s = live.pop(rng.randrange(len(live)))
            _assert_round_trip(s, pair.pop(s)[0])
            free += -(-_rows(s) // S)
        else:
            live.append(pair.stash(n))
            free -= need
    assert int(pair.te.state[State.HEAD]) > 12, "the sequence must wrap the free list twice"
    assert not pair.flags.any(), pair.flags


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_host_tier(dtype: torch.dtype) -> None:
    """A tensor the device tier cannot hold goes whole to the host tier in both; the flag is a
    count in te_paged and 0/1 in Megatron."""
    pair = Pair(dtype, pages=2, host_pages=4)
    a = pair.stash(R)  # 3 pages > 2: host
    b = pair.stash(S + 3)  # 2 pages: device
    c = pair.stash(S)  # device full, 1 host page left: host
    tiers = [int(s.rec_meta[Meta.TIER]) for s in (a, b, c)]
    assert tiers == [Tier.HOST, Tier.DEVICE, Tier.HOST]
    assert [int(s.paged.spilled_to_host) for s in (a, b, c)] == [1, 0, 1]
    assert int(pair.flags[Flag.HOST_SPILL]) == 2 and int(pair.mc.host_spill) == 1
    for s in (a, c, b):
        _assert_round_trip(s, pair.pop(s)[0])
    assert pair.te.state[State.HOST_TAIL] == 8


@pytest.mark.parametrize("host_pages", [0, 2])
def test_overflow_copies_nothing(host_pages: int) -> None:
    """More pages than either tier has free: both flag the overflow, take no page and write no
    row; every later stash and pop is then a no-op in both."""
    pair = Pair(torch.bfloat16, pages=3, host_pages=host_pages)
    a = pair.stash(S + 3)  # 2 of 3 pages
    before = megatron_state(pair.mc)
    b = pair.stash(R)  # 3 pages: 1 device and `host_pages` host pages free
    assert int(pair.flags[Flag.OVERFLOW]) == 1 and int(pair.mc.overflow) == 1
    assert int(b.rec_meta[Meta.TIER]) == Tier.NONE and _rows(b) == 0
    assert b.rec_pages_M.tolist() == [-7, -7, -7], "te_paged records no page"
    assert int(b.paged.spilled_to_host) == 1 and not b.paged.page_record.any()
    after = megatron_state(pair.mc)
    touched = [k for k, v in before.items() if k != "overflow" and not _same(v, after[k])]
    assert not touched, f"the overflowing stash changed {touched}"
    c = pair.stash(S)  # would fit, but the step has overflowed
    assert int(c.rec_meta[Meta.TIER]) == Tier.NONE
    assert int(c.paged.spilled_to_host) == 0, "an earlier overflow leaves it as zeroed"
    for s in (a, b, c):  # the destinations keep their garbage: nothing read, nothing freed
        te_dst, _ = pair.pop(s)  # pop() has checked that Megatron's is the same
        assert not torch.equal(_bytes(te_dst[:1]), _bytes(s.src_RH[:1]))
    assert megatron_state(pair.mc)["free_list_tail"].tolist() == [3, host_pages]


# ------------------------------------------------------------- where the designs differ


def test_second_pop() -> None:
    """te_paged marks a popped record: a second pop frees nothing and counts INVALID. Megatron
    keeps no mark (ops/paged_stash.py:251-253): it returns the pages again, so the free list holds
    more pages than the pool has and a later stash can be given a page still in use."""
    pair = Pair(torch.bfloat16, pages=4)
    a = pair.stash(S + 3)
    pair.pop(a)
    te_dst, mc_dst = pair.pop(a, compare=False)
    te_free = megatron_layout(pair.te, pair.flags)
    mc_free = megatron_state(pair.mc)
    assert int(pair.flags[Flag.INVALID]) == 1
    assert te_free["free_list_tail"].tolist() == [6, 0]
    assert mc_free["free_list_tail"].tolist() == [8, 0]  # tail - head = 6 free of 4 pages
    assert mc_free["free_list_cuda"].tolist() == [0, 1, 0, 1], "pages 0, 1 listed twice"
    assert not torch.equal(_bytes(te_dst), _bytes(mc_dst)), "te_paged reads nothing"
    _assert_round_trip(a, mc_dst)  # Megatron reads the (by now free) pages again
    b = pair.stash(R, compare=False)  # head 2: slots 2, 3, 4 % 4
    assert b.rec_pages_M.tolist() == [2, 3, 0]
    assert b.paged.page_record[:3].tolist() == [0, 1, 0], "page 0 twice: rows overwrite rows"


def test_pop_rereads_num_tokens() -> None:
    """te_paged pops the rows its record holds; Megatron's pop reads ``num_tokens`` again
    (ops/paged_stash.py:184-186), so a count changed after the stash changes how many rows come
    back and how many pages go back (here one page leaks)."""
    pair = Pair(torch.bfloat16, pages=4)
    a = pair.stash(S + 3)  # 2 pages
    a.paged.num_tokens_tensor.fill_(S)
    te_dst, mc_dst = pair.pop(a, compare=False)
    _assert_round_trip(a, te_dst)
    assert torch.equal(_bytes(mc_dst[:S]), _bytes(a.src_RH[:S]))
    assert not torch.equal(_bytes(mc_dst[S : S + 3]), _bytes(a.src_RH[S : S + 3]))
    assert int(pair.te.state[State.TAIL]) == 6 and pair.mc.free_list_tail.tolist() == [5, 0]


@pytest.mark.parametrize("num_tokens", [R + 1, -1])
def test_counts_the_buffer_cannot_hold(num_tokens: int) -> None:
    """te_paged flags a count above the static buffer (or negative) as invalid. Megatron's
    copy does not check it (ops/paged_stash.py:55-56, :111): above the buffer it copies the rows
    past the end of the source, here from the rest of its storage; -1 stashes nothing."""
    pair = Pair(torch.bfloat16, pages=4)
    storage = _random(torch.bfloat16, (R + S, H), 99, pair.device)
    a = pair.stash(num_tokens, src_RH=storage[:R], compare=False)
    assert int(pair.flags[Flag.INVALID]) == 1 and int(a.rec_meta[Meta.TIER]) == Tier.NONE
    assert int(pair.flags[Flag.OVERFLOW]) == 0
    assert int(pair.mc.overflow) == 0 and int(a.paged.spilled_to_host) == 0
    rows = max(num_tokens, 0)
    assert pair.mc.free_list_head.tolist() == [-(-rows // S), 0]
    got = pair.mc.cuda_buffer[:rows]  # a fresh list: pages 0, 1, 2 in order
    assert torch.equal(_bytes(got), _bytes(storage[:rows]))


def test_scale_inv_rows_round_differently() -> None:
    """An MXFP8 scale-inverse stores a row per 32 tokens: te_paged rounds the rows up
    (``ceil(n / 32)``), Megatron floors (``num_tokens_tensor // 32``, a torch op before the
    launch, paged_stash.py:203): equal for whole blocks, one row short for a partial one."""
    pair = Pair(torch.uint8, pages=4)
    src = _random(torch.uint8, (3, H), 7, pair.device)  # 96 tokens' worth of scales
    whole = pair.stash(64, src_RH=src, tokens_per_row=32)  # 2 rows in both
    assert _rows(whole) == 2
    _assert_round_trip(whole, pair.pop(whole)[0])
    partial = pair.stash(33, src_RH=src, tokens_per_row=32, compare=False)
    assert _rows(partial) == 2, "te_paged keeps the partial block's scales"
    page = int(partial.rec_pages_M[0])
    assert int(partial.paged.page_record[0]) == page
    te_rows, mc_rows = pair.te.pool_NH[page * S :][:2], pair.mc.cuda_buffer[page * S :][:2]
    assert torch.equal(te_rows, src[:2]) and torch.equal(mc_rows[0], src[0])
    assert not torch.equal(mc_rows[1], src[1]), "Megatron drops the partial block's row"


def test_padding_rows_on_reload() -> None:
    """te_paged's pop zeroes the rows past the stored ones by default (``zero_padding``);
    Megatron leaves the reload buffer's previous contents there (it allocates it with
    ``torch.empty``, paged_stash.py:526)."""
    pair = Pair(torch.bfloat16, pages=4)
    a = pair.stash(S + 3)
    te_dst, mc_dst = pair.pop(a, zero_padding=True, compare=False)
    assert torch.equal(_bytes(te_dst[: S + 3]), _bytes(mc_dst[: S + 3]))
    assert not te_dst[S + 3 :].view(torch.int16).any()
    assert mc_dst[S + 3 :].view(torch.int16).any(), "Megatron's padding is the garbage it had"
    pair.check("pop")  # the pools and free lists agree all the same
