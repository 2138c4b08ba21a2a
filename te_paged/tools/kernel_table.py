"""Every Triton kernel te_paged launches, compiled for Hopper (sm_90) and Blackwell (sm_100) by
Triton's own compiler — no GPU needed — and what each cubin says: registers, spills, shared
memory, the width of the row copy's global loads and stores, SASS instructions per byte moved;
side by side with megatron-core 0.19.2's two paged-stash kernels compiled the same way.

The launches are te_paged's own: the stash ops are called with the launch stubbed
(:func:`~te_paged.tools.launches.recorded_launches`) on the pools DeepSeek-V3's expert layers
stash into (the planner's list of saved tensors under bf16, MXFP8 and NVFP4; page size 64,
4096-token buffers, a host tier on the bf16 hidden-size pool), and each launch is compiled with
the specialisation Triton would give it on a GPU (the CUDA backend's binder over the real
arguments: divisibility, constants, the compile-time constants). A Triton compile error therefore
fails here, without a GPU, where ``TRITON_INTERPRET=1`` would have run the kernel regardless.

The *row copy* is read from the SASS: the innermost loops that both load and store global
memory before the kernel's first atomic (te_paged's kernels end with their ticket; what follows
is bookkeeping). Its *bytes* per iteration and thread are those of its buffer-side accesses
(the loads of a stash, the stores of a pop), its *instructions per byte* the loop's instructions
over them. A row *allows* 128-bit accesses when its bytes are a multiple of 16.

The row copy's stores are known by their source lines (the cubin's line info), read from the
sources imported here (:func:`source_roots`): Triton's cache may hand back a cubin another
checkout compiled, whose line info names that checkout's files.

Run in a process without ``TRITON_INTERPRET=1`` (the kernels must be ``JITFunction`` objects):
``te-paged bench --only kernels`` starts one, or ``python -m te_paged.tools.kernel_table --json
F``. :func:`compile_kernel` and :func:`resource_usage` serve one launch at a time (the GPU
check's registers and occupancy: :mod:`te_paged.tools.occupancy`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from te_paged.tools.launches import Launch, megatron_available, recorded_launches

__all__ = [
    "ARCHS",
    "KernelRow",
    "compile_kernel",
    "compile_launch",
    "kernel_report",
    "kernel_rows",
    "main",
    "resource_usage",
    "source_roots",
]

ARCHS = (90, 100)  # Hopper, Blackwell
_TOKENS, _PAGE_SIZE = 4096, 64
_POOL_PAGES = 37  # not a multiple of 16: the specialisation a pool's page count usually gets
_MODEL = "deepseek-v3"


@dataclasses.dataclass(frozen=True)
class Case:
    """One launch to compile: whose, which op, on which pool."""

    owner: str  # "te_paged" or "megatron-core"
    op: str  # "stash", "pop" (zero padding), "pop, padding left"
    tensor: str  # the pool's key, "bfloat16x7168"
    row_bytes: int
    host_tier: bool
    launch: Launch

    @property
    def direction(self) -> str:
        return "load" if self.op == "stash" else "store"


@dataclasses.dataclass(frozen=True)
class KernelRow:
    """What one compiled launch's cubin says."""

    owner: str
    kernel: str
    arch: int
    op: str
    tensor: str
    row_bytes: int
    host_tier: bool
    registers: int
    spill_bytes: int  # stack frame and local memory (at least 4 per STL/LDL instruction)
    shared_bytes: int  # as the cubin declares it (sm_90+ reserve 1 KiB once a kernel uses any)
    copy_load_bits: list[int]  # widths of the row copy's global loads, sorted, distinct
    copy_store_bits: list[int]
    sass_instructions: int
    loop_instructions: int  # in the row copy's loop
    loop_bytes: int  # bytes the loop moves per iteration and thread (buffer side)

    @property
    def allows_128(self) -> bool:
        return self.row_bytes % 16 == 0

    @property
    def instructions_per_byte(self) -> float:
        return self.loop_instructions / self.loop_bytes if self.loop_bytes else float("nan")

    @property
    def full_width(self) -> bool:
        """Every access of the row copy 128-bit or wider."""
        bits = self.copy_load_bits + self.copy_store_bits
        return bool(bits) and min(bits) >= 128


def _deepseek_pools() -> list[tuple[str, torch.dtype, int, int]]:
    """``(key, storage dtype, width, tokens per row)`` of every pool DeepSeek-V3's expert layers
    stash into under bf16, MXFP8 and NVFP4 storage, in first-seen order."""
    from te_paged.runtime.planner import NAMED_CONFIGS
    from te_paged.runtime.pool_plan import expert_mlp_saved_tensors
    from te_paged.stash import storage_dtype

    cfg = NAMED_CONFIGS[_MODEL]
    seen: dict[str, tuple[str, torch.dtype, int, int]] = {}
    for fp8 in (None, "mxfp8", "nvfp4"):
        for t in expert_mlp_saved_tensors(cfg.hidden, cfg.ffn, fp8=fp8):
            name, width = t.key.rsplit("x", 1)
            dtype = storage_dtype(getattr(torch, name))
            seen.setdefault(t.key, (t.key, dtype, int(width), t.tokens_per_row))
    return list(seen.values())


def te_paged_cases() -> list[Case]:
    """te_paged's launches: a stash and a pop (zero padding, the default) per pool; on the
    first (bf16 hidden-size) pool also the pop that leaves the padding, and all three with a
    host tier. (Pools of one row width and element size compile alike for the pop: Triton's
    cache then hands back the same cubin.)"""
    from te_paged.kernels import FLAGS_LEN, META_LEN
    from te_paged.kernels.triton_stash import triton_stash_copy, triton_stash_pop
    from te_paged.stash import PagedStashBuffer, StashKey

    cases = []
    for i, (key, dtype, width, per_row) in enumerate(_deepseek_pools()):
        for host in (False, True) if i == 0 else (False,):
            rows = _TOKENS // per_row
            buf = PagedStashBuffer(StashKey(dtype, width), _POOL_PAGES, _PAGE_SIZE, "cpu",
                                   host_num_pages=_POOL_PAGES if host else 0)  # fmt: skip
            data = torch.empty(rows, width, dtype=dtype)
            flags = torch.zeros(FLAGS_LEN, dtype=torch.int64)
            pages = torch.empty(-(-rows // _PAGE_SIZE), dtype=torch.int32)
            meta = torch.empty(META_LEN, dtype=torch.int64)
            args = (*buf.kernel_args(), flags, pages, meta)
            ops = ["stash", "pop"] + (["pop, padding left"] if i == 0 else [])
            with recorded_launches() as run:
                triton_stash_copy(data, torch.tensor([rows * per_row // 2]), per_row,
                                  _PAGE_SIZE, *args)  # fmt: skip
                triton_stash_pop(data, _PAGE_SIZE, *args, True)
                if i == 0:
                    triton_stash_pop(data, _PAGE_SIZE, *args, False)
            row_bytes = width * data.element_size()
            for op, launch in zip(ops, run.launches):
                cases.append(Case("te_paged", op, key, row_bytes, host, launch))
    return cases


def megatron_cases(widths: tuple[int, ...] = (7168,)) -> list[Case]:
    """megatron-core 0.19.2's copy and pop kernels as its ``PagedTensor`` launches them, bf16."""
    from megatron.core.transformer.moe import paged_stash as mc

    cases = []
    for width in widths:
        flag, spill = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        buf = mc.PagedStashBuffer(_POOL_PAGES * _PAGE_SIZE, width, _PAGE_SIZE, "cpu", flag,
                                  spill, torch.bfloat16)  # fmt: skip
        data = torch.empty(_TOKENS, width, dtype=torch.bfloat16)
        tensor = mc.PagedTensor(
            data, num_tokens_tensor=torch.tensor([_TOKENS // 2]), max_num_tokens=_TOKENS,
            hidden_size=width, page_size=_PAGE_SIZE,
        )  # fmt: skip
        with recorded_launches() as run:
            tensor.offload_to_stash(buf)
            tensor._tensor = data
            tensor.reload_from_stash(buf)
        for op, launch in zip(("stash", "pop"), run.launches):
            cases.append(Case("megatron-core", op, f"bfloat16x{width}", 2 * width, False, launch))
    return cases


def compile_kernel(launch: Launch, arch: int):
    """``launch`` compiled for ``sm_<arch>`` with the specialisation a launch on that GPU would
    get (its arguments' divisibility, the constants): Triton's ``CompiledKernel`` (``asm``,
    ``metadata.num_warps``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = launch.kernel
    if not isinstance(fn, JITFunction):
        raise RuntimeError(
            f"{launch.name} is a {type(fn).__name__}: the kernels are interpreted in this "
            "process (TRITON_INTERPRET=1); compile them in one without it "
            "(te_paged.tools.occupancy.compiled_resources does)"
        )
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def source_roots(launches: list[Launch]) -> dict[str, Path]:
    """Each launched kernel's top-level package (``te_paged``, ``megatron``) and the folder it is
    imported from here."""
    roots = {}
    for launch in launches:
        names = launch.kernel.fn.__module__.split(".")
        path = Path(inspect.getsourcefile(launch.kernel.fn) or "")
        # (by the module's own file: a namespace package, as megatron is, has none)
        roots[names[0]] = path.parents[len(names) - (1 if path.stem == "__init__" else 2)]
    return roots


def _here(recorded: str, roots: dict[str, Path]) -> str:
    """The file a cubin's line info names, among the sources imported here. Triton keys a
    compiled kernel by its source text and the first lines of it and of every function it calls,
    not by their files' paths: a cached cubin may name another checkout's files (gone, or edited
    since), at the lines this checkout's have."""
    parts = Path(recorded).parts
    for i in range(len(parts) - 1, -1, -1):  # the innermost folder named as a package
        if parts[i] in roots:
            here = roots[parts[i]].joinpath(*parts[i + 1 :])
            if here.exists():
                return str(here)
    return recorded


def compile_launch(launch: Launch, arch: int) -> dict[str, object]:
    """:func:`compile_kernel`'s ``asm`` (``ptx``, ``cubin``, ...)."""
    return compile_kernel(launch, arch).asm


def _tool(name: str) -> str:
    """A CUDA binary utility: the one in Triton's wheel, else from PATH."""
    import triton.backends.nvidia as nvidia

    shipped = Path(nvidia.__file__).parent / "bin" / name
    found = str(shipped) if shipped.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not in Triton's wheel nor on PATH")
    return found


# An instruction line of ``nvdisasm -c -gi``, and the source position comment before it.
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")
_WHERE = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
# The row copy's stores: on source lines that store a row's columns — te_paged's kernels
# address them through ``pool_off``/``buf_off``, Megatron's through ``hidden_offsets``. (Line
# info is exact for stores; the compiler moves loads about, and their lines with them.)
_ROW_STORE = re.compile(r"tl\.store\(.*\b(pool_off|buf_off|hidden_offsets)\b")
_REG = re.compile(r"\bR(\d+)\b")
# Instructions that pass a value on unchanged (or pick one of two): followed back to the load.
_MOVES = ("MOV", "IMAD.MOV", "SEL", "PRMT", "FSEL")


@dataclasses.dataclass
class _Instr:
    address: int
    opcode: str
    operands: str
    row_store: bool  # a store of the row copy (by its source line)
    row_load: bool = False  # a load whose value a row store writes (by data flow)

    def regs(self, first: int, count: int = 1) -> set[int]:
        """Registers ``first`` .. ``first + count - 1`` named by operand ``first`` on."""
        found = [int(r) for r in _REG.findall(self.operands)]
        return {found[first] + i for i in range(count)} if len(found) > first else set()

    @property
    def width_regs(self) -> int:
        return max(1, _bits(self.opcode) // 32)


def _value_regs(store: _Instr) -> set[int]:
    """The registers a ``STG`` writes out: its last register operand and the vector after it."""
    found = [int(r) for r in _REG.findall(store.operands.split("]")[-1])]
    return {found[0] + i for i in range(store.width_regs)} if found else set()


def _mark_row_loads(instrs: list[_Instr]) -> None:
    """Follow each row store's value back, through moves and selects, to the loads it came
    from (the nearest earlier writer of each register)."""
    for i, ins in enumerate(instrs):
        if not ins.row_store:
            continue
        todo, seen = [(r, i) for r in _value_regs(ins)], set()
        while todo:
            reg, before = todo.pop()
            if (reg, before) in seen:
                continue
            seen.add((reg, before))
            for j in range(before - 1, -1, -1):
                w = instrs[j]
                if w.opcode.startswith(("ST", "BRA", "EXIT", "RED", "BAR")):
                    continue
                if w.opcode.startswith("LDG"):
                    if reg in w.regs(0, w.width_regs):
                        w.row_load = True
                        break
                    continue
                if reg in w.regs(0):
                    if w.opcode.startswith(_MOVES):  # its register sources, after the dest
                        todo += [(int(r), j) for r in _REG.findall(w.operands)[1:]]
                    break


@contextlib.contextmanager
def _on_disk(cubin: bytes) -> Iterator[Path]:
    """``cubin`` in a temporary file, for the CUDA binary utilities."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        yield path


def _sass(cubin: bytes, roots: dict[str, Path]) -> tuple[list[_Instr], dict[str, int]]:
    """The SASS instructions, the row copy's marked (its sources read under ``roots``:
    :func:`source_roots`), and the resource usage."""
    import linecache

    with _on_disk(cubin) as path:
        dump = subprocess.run([_tool("nvdisasm"), "-c", "-gi", str(path)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    instrs, source, labels, pending = [], "", {}, []
    for line in dump.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:  # a branch target: the next instruction's address
            pending.append(label.group(1))
            continue
        where = _WHERE.match(line)
        if where:
            path = _here(where.group(1), roots)
            if not os.path.exists(path):
                raise RuntimeError(
                    f"the cubin's line info names {path}, which is not among the sources "
                    f"imported here ({', '.join(map(str, roots.values()))})"
                )
            source = linecache.getline(path, int(where.group(2)))
            continue
        m = _INSTR.match(line)
        if m:
            op = m.group(3)
            store = op.startswith("STG") and bool(_ROW_STORE.search(source))
            instrs.append(_Instr(int(m.group(1), 16), op, m.group(4), store))
            labels.update(dict.fromkeys(pending, instrs[-1].address))
            pending.clear()
    for ins in instrs:  # branch targets as addresses, as cuobjdump prints them
        ins.operands = re.sub(r"`\((\.L_x_\d+)\)", lambda m: hex(labels.get(m.group(1), -1)),
                              ins.operands)  # fmt: skip
    _mark_row_loads(instrs)
    return instrs, resource_usage(cubin)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """What ``cuobjdump -res-usage`` says of ``cubin``: ``REG`` (registers a thread), ``SHARED``
    (bytes of shared memory a block), ``LOCAL`` and ``STACK`` (bytes a thread)."""
    with _on_disk(cubin) as path:
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(path)],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    return {k: int(v) for k, v in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", usage)}


def _bits(opcode: str) -> int:
    """Width of a global load or store: ``LDG.E.128`` 128, ``STG.E.U16`` 16, ``LDG.E`` 32."""
    for part in opcode.split(".")[1:]:
        m = re.fullmatch(r"[US]?(\d+)", part)
        if m:
            return int(m.group(1))
    return 32


def _loops(instrs: list[_Instr]) -> list[tuple[int, int]]:
    """``(first, last)`` index of each loop: a branch back to an earlier address."""
    index = {ins.address: i for i, ins in enumerate(instrs)}
    loops = []
    for i, ins in enumerate(instrs):
        m = re.search(r"0x([0-9a-f]+)\s*$", ins.operands)
        if ins.opcode.startswith("BRA") and m and int(m.group(1), 16) < ins.address:
            start = index.get(int(m.group(1), 16))
            if start is not None:
                loops.append((start, i))
    return loops


def analyse(case: Case, arch: int, sass: tuple[list[_Instr], dict[str, int]]) -> KernelRow:
    """The row of the table for ``case`` compiled for ``arch`` (its :func:`_sass`)."""
    instrs, res = sass
    loads = [i for i in instrs if i.row_load]
    stores = [i for i in instrs if i.row_store]
    # The copy loop: the innermost loop holding row stores; what it moves per iteration, the
    # buffer side's accesses (a stash's loads, a pop's stores).
    loops = [(a, b) for a, b in _loops(instrs) if any(i.row_store for i in instrs[a : b + 1])]
    loop_instr = loop_bytes = 0
    if loops:
        a, b = min(loops, key=lambda ab: ab[1] - ab[0])
        body = instrs[a : b + 1]
        loop_instr = len(body)
        side = [i for i in body if (i.row_load if case.direction == "load" else i.row_store)]
        loop_bytes = sum(_bits(i.opcode) for i in side) // 8
    local = sum(i.opcode.startswith(("STL", "LDL")) for i in instrs)  # spill traffic
    return KernelRow(
        owner=case.owner, kernel=case.launch.name, arch=arch, op=case.op, tensor=case.tensor,
        row_bytes=case.row_bytes, host_tier=case.host_tier, registers=res.get("REG", 0),
        spill_bytes=max(res.get("STACK", 0) + res.get("LOCAL", 0), 4 * local),
        shared_bytes=res.get("SHARED", 0),
        copy_load_bits=sorted({_bits(i.opcode) for i in loads}),
        copy_store_bits=sorted({_bits(i.opcode) for i in stores}),
        sass_instructions=len(instrs), loop_instructions=loop_instr, loop_bytes=loop_bytes,
    )  # fmt: skip


def kernel_rows(archs: tuple[int, ...] = ARCHS) -> tuple[list[KernelRow], str | None]:
    """Every case compiled for every arch; and why Megatron's kernels are missing (None:
    they are there)."""
    cases = te_paged_cases()
    ok, why_not = megatron_available()
    if ok:
        cases += megatron_cases()
    builds = [(case, arch, compile_launch(case.launch, arch)["cubin"]) for arch in archs
              for case in cases]  # fmt: skip
    roots = source_roots([case.launch for case in cases])
    # Disassembly is most of the time (~0.5 s a call, mostly nvdisasm's start): once per
    # distinct cubin, on every core.
    distinct = list(dict.fromkeys(cubin for _, _, cubin in builds))
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        sass = dict(zip(distinct, pool.map(lambda cubin: _sass(cubin, roots), distinct)))
    rows = [analyse(case, arch, sass[cubin]) for case, arch, cubin in builds]
    return rows, None if ok else why_not


def _widths(bits: list[int]) -> str:
    return "/".join(map(str, bits)) or "–"


def kernel_report(rows: list[KernelRow], why_not: str | None = None, *, command: str = "") -> str:
    """The Markdown table of :func:`kernel_rows`."""
    import triton

    lines = [
        f"# Triton kernels compiled for sm_90 and sm_100, te_paged and megatron-core "
        f"({datetime.date.today()})",
        "",
        f"Command: `{command}`  ",
        f"Triton {triton.__version__} (its own compiler and cuobjdump; no GPU), torch "
        f"{torch.__version__}. Launches as te_paged makes them for {_MODEL}'s pools (bf16, "
        f"MXFP8, NVFP4 storage; page size {_PAGE_SIZE}; {_TOKENS}-token buffers; "
        "`te_paged/tools/kernel_table.py` says how each figure is read from the SASS).",
        "",
        "*Row copy*: the innermost loops that load and store global memory before the first "
        "atomic; its load/store widths in bits; *instr/B*: its SASS instructions per byte one "
        "thread moves per iteration (buffer side). *Allows 128*: the row's bytes are a multiple "
        "of 16. Shared memory as the cubin declares it (sm_90 and later reserve 1 KiB once a "
        "kernel uses any; te_paged's use 8 bytes, for the ticket).",
        "",
        "| owner | kernel | sm | op | pool | row B | host tier | regs | spills B | shared B "
        "| row copy loads | stores | allows 128 | SASS instr | loop instr | loop B | instr/B |",
        "| --- | --- | ---: | --- | --- | ---: | :---: | ---: | ---: | ---: | --- | --- "
        "| :---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.owner} | {r.kernel} | {r.arch} | {r.op} | {r.tensor} | {r.row_bytes} "
            f"| {'yes' if r.host_tier else ''} | {r.registers} | {r.spill_bytes} "
            f"| {r.shared_bytes} | {_widths(r.copy_load_bits)} | {_widths(r.copy_store_bits)} "
            f"| {'yes' if r.allows_128 else 'no'} | {r.sass_instructions} "
            f"| {r.loop_instructions} | {r.loop_bytes} | {r.instructions_per_byte:.2f} |"
        )
    mine = [r for r in rows if r.owner == "te_paged"]
    spilling = [r for r in mine if r.spill_bytes]
    narrow = [r for r in mine if r.allows_128 and not r.full_width]
    lines += [
        "",
        f"te_paged: {len(mine)} compiled launches, {len(spilling)} spilling, {len(narrow)} "
        "with a row copy narrower than 128 bits where the row allows it.",
    ]
    if why_not:
        lines.append(f"megatron-core not compiled: {why_not}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the rows here as JSON too")
    p.add_argument("--out", type=Path, help="write the Markdown table here too")
    p.add_argument("--command", default="python -m te_paged.tools.kernel_table",
                   help="the command the report names")  # fmt: skip
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("kernel_table: unset TRITON_INTERPRET (the kernels must compile)", file=sys.stderr)
        return 2
    rows, why_not = kernel_rows()
    report = kernel_report(rows, why_not, command=args.command)
    print(report)
    if args.out:
        args.out.write_text(report)
    if args.json:
        payload = {"rows": [dataclasses.asdict(r) | {"allows_128": r.allows_128,
                                                      "full_width": r.full_width}
                            for r in rows], "megatron_missing": why_not}  # fmt: skip
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
