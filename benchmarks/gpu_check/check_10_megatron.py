"""Check 10: te_paged's stash+pop Triton kernels against megatron-core 0.19.2's paged-stash
kernels at every width a DeepSeek-V3 expert layer stashes, bf16 and MXFP8, with the registers and
occupancy of both sides' kernels.

A DeepSeek-V3 expert layer (``te_paged.runtime.pool_plan.expert_mlp_saved_tensors(7168, 2048)``)
stashes its FC1 input (hidden 7168) and FC2 input (FFN 2048) as bf16, or under MXFP8 as e4m3
data plus e8m0 scales — one scale per 32 elements, width/32 bytes a token, in the layout
te_paged stashes: per 32 tokens of a column, ``[tokens / 32, width]`` (``tokens_per_row=32``,
one scale row per 32 tokens) — and its activation input (2 × 2048 = 4096) as bf16 under either
recipe. Not timed: the routing probabilities (4 bytes a token). Each side stashes MXFP8 as its
manager does: te_paged two ``stash_copy`` calls into two pools (keys ``float8_e4m3fn`` and
``float8_e8m0fnu`` × width), Megatron two ``PagedTensor``s in two ``uint8`` buffers, the
scales' with ``is_columnwise_scale_inv`` (its manager's ``grouped_tensor_scale_inv``), so that
its kernels move ``num_tokens // 32`` rows of them. The real token count is a multiple of 32
under MXFP8 (as Megatron's FP8 padding makes it): Megatron rounds the scale rows down,
te_paged up.

Registers and occupancy: each side's launches for the case (4096 tokens, page 64, the fresh free
list) are recorded with the launch stubbed (``te_paged.tools.launches``) and compiled for the
device's arch (sm_90 in a dry run, where the kernels run interpreted) by Triton's own compiler in
a process of its own (``te_paged.tools.occupancy.CompileJob``, through
``te_paged.tools.kernel_table.compile_kernel``, as ``te-paged bench --only kernels`` compiles
them) — beside the timing in a dry run, before it on a GPU, whose host launch path is part of
the measurement. Their cubins give the registers a thread, threads a block and shared memory,
and from those the blocks and warps resident on one SM.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import traceback

import torch

from .common import RUN, TargetMissed, Unavailable, random_bits, same, section, timed

TARGET_RATIO = 1.0

NAME = (
    "Megatron-core 0.19.2's paged-stash kernels vs te_paged's Triton kernels (bf16 and MXFP8, "
    "hidden 7168, 4096, 2048)"
)
TARGET = (
    f"te_paged / Megatron stash+pop time (medians) <= {TARGET_RATIO} at every width, format, "
    "size and free list; both take the same pages"
)


@dataclasses.dataclass(frozen=True)
class Member:
    """One tensor a format stashes for one layer input."""

    name: str
    dtype: torch.dtype
    tokens_per_row: int  # 32: an MXFP8 scale-inverse, one row per 32 tokens


FORMATS = {
    "bf16": (Member("data", torch.bfloat16, 1),),
    "MXFP8": (Member("data", torch.float8_e4m3fn, 1), Member("scales", torch.float8_e8m0fnu, 32)),
}
CASES = (("bf16", 7168), ("bf16", 4096), ("bf16", 2048), ("MXFP8", 7168), ("MXFP8", 2048))
SMOKE_CASES = (("bf16", 2048), ("MXFP8", 2048))
PAGE = 64
REGISTER_TOKENS = 4096  # the launches compiled for registers: the case's smaller size
DRY_ARCH = 90  # the H100 and H200 the check is written for


def _plan():
    """(cases, token counts, page size, free lists, warm-up rounds, timed rounds)."""
    from te_paged.tools.free_lists import FreeList

    if RUN.cuda:
        return CASES, [4096, 16384], PAGE, list(FreeList), 3, 20
    if RUN.smoke:
        return SMOKE_CASES, [32], 8, [FreeList.FRESH], 0, 1
    return CASES, [64], 8, list(FreeList), 0, 1


@dataclasses.dataclass(frozen=True)
class _Trip:
    """One stash+pop of ``fmt``: a ``tokens``-token buffer ``width`` wide, pages of ``page``
    taken from the ``kind`` free list."""

    fmt: str
    width: int
    tokens: int
    page: int
    kind: object  # te_paged.tools.free_lists.FreeList

    @property
    def real(self) -> int:
        """3/4 of the tokens and a partial last page; under MXFP8 a multiple of 32."""
        per_row = max(m.tokens_per_row for m in FORMATS[self.fmt])
        n = self.tokens * 3 // 4 + 5
        return min(self.tokens, -(-n // per_row) * per_row)

    def __str__(self) -> str:
        return f"{self.fmt}x{self.width} {self.tokens} {self.kind.value}"


@dataclasses.dataclass
class _Pair:
    """One stashed tensor on both sides: its source, a destination per side, Megatron's
    ``PagedTensor`` and ``PagedStashBuffer``, te_paged's pool and record; both pools' free
    lists prepared alike, so that both stashes take the same pages."""

    member: Member
    used: int  # rows stashed: the real tokens / tokens a row
    prep: object  # the PreparedFreeList both pools start from
    src: torch.Tensor
    dst: dict[str, torch.Tensor]
    paged: object  # Megatron's PagedTensor
    mbuf: object  # Megatron's PagedStashBuffer
    tbuf: object  # te_paged's PagedStashBuffer
    rec: tuple[torch.Tensor, torch.Tensor]  # te_paged's record: pages, meta

    @property
    def bits(self) -> torch.dtype:
        from te_paged.stash import storage_dtype

        return storage_dtype(self.member.dtype)


def _pair(mc, trip: _Trip, member: Member, num: torch.Tensor, mflags, fill) -> _Pair:
    """``member`` of ``trip`` on both sides; Megatron's buffer with its manager's shared
    ``mflags`` (overflow, host spill); the source random bits from the generator ``fill`` (None:
    left empty, for launches that do not run)."""
    from te_paged.kernels import META_LEN, State
    from te_paged.stash import PagedStashBuffer, StashKey
    from te_paged.tools.free_lists import prepare_free_list

    dev, per_row, width, page = RUN.device, member.tokens_per_row, trip.width, trip.page
    if per_row not in (1, mc.SCALE_INV_BLOCK_SIZE):
        raise ValueError(f"Megatron stashes 1 or {mc.SCALE_INV_BLOCK_SIZE} tokens a row")
    rows, used = trip.tokens // per_row, trip.real // per_row
    prep = prepare_free_list(trip.kind, used, page)
    src = (torch.empty(rows, width, dtype=member.dtype, device=dev) if fill is None
           else random_bits(rows, width, member.dtype, fill))  # fmt: skip
    # Megatron's manager keeps one-byte types in uint8 buffers (allocate_stash_buffers).
    buf_dtype = torch.uint8 if src.element_size() == 1 else member.dtype
    mbuf = mc.PagedStashBuffer(prep.num_pages * page, width, page, dev, *mflags, buf_dtype)
    mbuf.free_list_cuda.copy_(torch.tensor(prep.free_P))
    mbuf.free_list_head[0], mbuf.free_list_tail[0] = prep.head, prep.tail
    paged = mc.PagedTensor(src, num_tokens_tensor=num, max_num_tokens=trip.tokens,
                           hidden_size=width, page_size=page,
                           is_columnwise_scale_inv=per_row > 1)  # fmt: skip
    tbuf = PagedStashBuffer(StashKey(member.dtype, width), prep.num_pages, page, dev)
    tbuf.free_P.copy_(torch.tensor(prep.free_P))
    tbuf.state[State.HEAD], tbuf.state[State.TAIL] = prep.head, prep.tail
    rec = (torch.empty(-(-rows // page), dtype=torch.int32, device=dev),
           torch.empty(META_LEN, dtype=torch.int64, device=dev))  # fmt: skip
    dst = {side: torch.empty_like(src) for side in ("mc", "te")}
    return _Pair(member, used, prep, src, dst, paged, mbuf, tbuf, rec)


def _round_trip(mc, trip: _Trip, fill: torch.Generator | None):
    """Both sides' stash+pop of ``trip``: every member stashed, then every member popped
    (padding left, as Megatron leaves it), as each manager does; ``({"mc": fn, "te": fn},
    pairs)``. A stash+pop leaves the free lists as it found them: every round takes the same
    pages."""
    from te_paged.kernels import FLAGS_LEN, stash_copy, stash_pop

    dev, page = RUN.device, trip.page
    num = torch.tensor([trip.real], device=dev)
    # Megatron's overflow and host-spill flags are shared by its buffers, te_paged's flags by
    # its pools: one set per side, as in each manager.
    mflags = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(2)]
    tflags = torch.zeros(FLAGS_LEN, dtype=torch.int64, device=dev)
    pairs = [_pair(mc, trip, m, num, mflags, fill) for m in FORMATS[trip.fmt]]

    def megatron() -> None:
        for p in pairs:
            p.paged._tensor = p.src  # offload_to_stash drops it; reload fills what is set here
            p.paged.offload_to_stash(p.mbuf)
        for p in pairs:
            p.paged._tensor = p.dst["mc"]
            p.paged.reload_from_stash(p.mbuf)

    def te() -> None:
        for p in pairs:
            stash_copy("triton", p.src.view(p.bits), num, p.member.tokens_per_row, page,
                       *p.tbuf.kernel_args(), tflags, *p.rec)  # fmt: skip
        for p in pairs:
            stash_pop("triton", p.dst["te"].view(p.bits), page, *p.tbuf.kernel_args(), tflags,
                      *p.rec, False)  # fmt: skip

    return {"mc": megatron, "te": te}, pairs


def _verify(pairs: list[_Pair], page: int, what: str) -> None:
    """After one round trip: both sides took the prepared pages, and popped what they stashed."""
    for p in pairs:
        need = -(-p.used // page)
        pages = {"mc": p.paged.page_record[:need].tolist(), "te": p.rec[0][:need].tolist()}
        if pages["mc"] != pages["te"] or tuple(pages["te"]) != p.prep.pages:
            raise AssertionError(f"{what} {p.member.name}: pages differ: {pages}")
        if not all(same(d[: p.used], p.src[: p.used]) for d in p.dst.values()):
            raise AssertionError(f"{what} {p.member.name}: popped rows differ from the stashed")


def run() -> str:
    """Both round trips from the same free list, interleaved rounds, medians; the launches'
    registers and occupancy beside them, compiled in a process of their own.
    tests/unit/integrations/test_megatron_stash_kernels.py checks Megatron's bytes on CPU."""
    try:
        from megatron.core.transformer.moe import paged_stash as mc
    except ImportError as e:
        print(f"[gpu_check] megatron-core 0.19.2 is not importable: {e}", file=sys.stderr)
        raise Unavailable(f"megatron-core 0.19.2 is not importable ({e})") from e
    cases, sizes, page, kinds, warmup, repeats = _plan()
    compiles = _Compiles(mc, cases)
    if RUN.cuda:  # no compiles beside the measurement: the host's launch path is part of it
        compiles.resources()
    # Source bits from a generator of the check's own: the dry-run test runs another check on
    # another thread, which seeds torch's.
    bits = torch.Generator(device=RUN.device).manual_seed(0)
    table = ["| format | width | tokens | free list | page runs | Megatron ms | te_paged ms "
             "| te_paged / Megatron |",
             "| --- | ---: | ---: | --- | --- | ---: | ---: | ---: |"]  # fmt: skip
    ratios: list[tuple[float, str]] = []
    worst: dict[tuple[str, int], float] = {}
    for (fmt, width), tokens, kind in itertools.product(cases, sizes, kinds):
        trip = _Trip(fmt, width, tokens, page, kind)
        fns, pairs = _round_trip(mc, trip, bits)
        for fn in fns.values():  # compiles
            fn()
        _verify(pairs, page, str(trip))
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeats):  # interleaved: drift in clocks or load hits both alike
            for k, fn in fns.items():
                times[k].append(timed(fn)[0])
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["te"] / med["mc"]
        ratios.append((ratio, str(trip)))
        worst[(fmt, width)] = max(ratio, worst.get((fmt, width), 0.0))
        runs = " + ".join(str(p.prep.runs) for p in pairs)
        ms = {k: f"{1e3 * v:.3f}" for k, v in med.items()}
        table.append(f"| {fmt} | {width} | {tokens} | {kind.value} | {runs} | {ms['mc']} "
                     f"| {ms['te']} | {ratio:.2f} |")  # fmt: skip
    clock = "CUDA events" if RUN.cuda else "both interpreted on the CPU: not a measurement"
    text = [f"Page {page}; 3/4 of the tokens and 5 real, under MXFP8 rounded up to a multiple "
            f"of 32 ({clock}); "
            f"medians of {repeats} interleaved rounds after {warmup} warm-up. MXFP8: e4m3 data "
            "and e8m0 scales (one row per 32 tokens) stashed and popped together; page runs: "
            "data + scales.", "", *table, "", *compiles.table()]  # fmt: skip
    print("\n".join(text))
    section("\n".join(text))
    parts = [f"{fmt}x{width} {worst[(fmt, width)]:.2f}{compiles.summary(fmt, width)}"
             for fmt, width in cases]  # fmt: skip
    detail = "te_paged / Megatron stash+pop time, worst per format and width: " + "; ".join(parts)
    top = max(ratios)
    verdict = f"worst {top[0]:.2f} at {top[1]}, target <= {TARGET_RATIO}"
    if RUN.cuda and top[0] > TARGET_RATIO:
        raise TargetMissed(f"{detail}; MISSED: {verdict}")
    return f"{detail}; {'met: ' + verdict if RUN.cuda else 'not a measurement on CPU'}"


_SIDES = {"te": "te_paged", "mc": "Megatron"}


class _Compiles:
    """Registers and occupancy of both sides' kernels, per case: each side's launches for one
    round trip (``REGISTER_TOKENS`` tokens, page ``PAGE``, the fresh free list) recorded with
    the launch stubbed, then compiled for the device's arch (sm_90 in a dry run) in a process
    of their own (``te_paged.tools.occupancy.CompileJob``). Figures beside the target: a
    failure is reported in them, not raised."""

    def __init__(self, mc, cases) -> None:
        from te_paged.tools.free_lists import FreeList
        from te_paged.tools.launches import recorded_launches
        from te_paged.tools.occupancy import SM_LIMITS, CompileJob

        self.arch = _arch()
        self.limits = SM_LIMITS.get(self.arch)
        self.rows: list[tuple[str, int, str, str]] = []  # (format, width, side, tensor)
        self._resources: list | None = None
        self.error = ""
        try:
            launches = []
            for fmt, width in cases:
                trip = _Trip(fmt, width, REGISTER_TOKENS, PAGE, FreeList.FRESH)
                fns, pairs = _round_trip(mc, trip, None)
                tensors = [p.member.name for p in pairs] * 2  # every stash, then every pop
                for side in ("te", "mc"):
                    with recorded_launches() as rec:
                        fns[side]()
                    got, want = len(rec.launches), len(tensors)
                    if got != want:
                        raise AssertionError(f"{_SIDES[side]}: {got} launches, not {want}")
                    launches += rec.launches
                    self.rows += [(fmt, width, side, t) for t in tensors]
            self.job = CompileJob(launches, self.arch)
        except Exception as e:
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        traceback.print_exc()
        self.job, self.error = None, f"{type(e).__name__}: {e}"

    def resources(self) -> list:
        """The compiled launches' resources, in ``rows``' order (waits for the compiles)."""
        if self._resources is None and self.job is not None:
            try:
                self._resources = self.job.result()
            except Exception as e:
                self._failed(e)
        return self._resources or []

    def table(self) -> list[str]:
        """The registers and occupancy table (Markdown lines)."""
        from te_paged.tools.occupancy import occupancy

        where = "" if RUN.cuda else ", the kernels' own cubins, no GPU"
        lines = [f"Registers and occupancy: each side's launches for {REGISTER_TOKENS} tokens, "
                 f"page {PAGE}, compiled for sm_{self.arch} by Triton{where}; resident blocks "
                 "and warps per SM from registers, threads and shared memory against the SM's "
                 "limits (te_paged/tools/occupancy.py).", "",
                 "| format | width | side | kernel | tensor | registers | spills B "
                 "| threads/block | shared B | blocks/SM | warps/SM | limited by |",
                 "| --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
                 "| --- |"]  # fmt: skip
        for (fmt, width, side, tensor), res in zip(self.rows, self.resources()):
            blocks, warps, limit = "n/a", "n/a", f"no limits for sm_{self.arch}"
            if self.limits:
                occ = occupancy(res, self.limits)
                blocks, warps, limit = occ.blocks, f"{occ.warps} of {occ.max_warps}", occ.limited_by
            lines.append(f"| {fmt} | {width} | {_SIDES[side]} | {res.kernel} | {tensor} "
                         f"| {res.registers} | {res.spill_bytes} | {res.threads} "
                         f"| {res.shared_bytes} | {blocks} | {warps} | {limit} |")  # fmt: skip
        if self.error:
            lines.append(f"(registers not read: {self.error})")
        return lines

    def summary(self, fmt: str, width: int) -> str:
        """`` (registers stash/pop te_paged 90/93 vs Megatron 40/31, warps/SM 20/20 vs 48/64)``:
        the most registers and the fewest warps where a format's tensors compile apart."""
        from te_paged.tools.occupancy import occupancy

        if self.error or not self.resources():
            return f" (registers not read: {self.error.split(':')[0] or 'nothing compiled'})"
        seen: dict[str, dict[str, list[tuple[int, int]]]] = {"te": {}, "mc": {}}
        for (f, w, side, _), res in zip(self.rows, self.resources()):
            if (f, w) == (fmt, width):
                warps = occupancy(res, self.limits).warps if self.limits else 0
                seen[side].setdefault(res.kernel, []).append((res.registers, warps))

        def column(owner: str, i: int, pick) -> str:
            return "/".join(str(pick(v[i] for v in runs)) for runs in seen[owner].values())

        regs = f"{column('te', 0, max)} vs Megatron {column('mc', 0, max)}"
        warps = f"{column('te', 1, min)} vs {column('mc', 1, min)}" if self.limits else "n/a"
        return f" (registers stash/pop te_paged {regs}, warps/SM {warps})"


def _arch() -> int:
    if RUN.cuda:
        major, minor = torch.cuda.get_device_capability(RUN.device)
        return 10 * major + minor
    return DRY_ARCH
