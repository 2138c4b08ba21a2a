"""How many blocks of a compiled Triton kernel one SM holds at once: its registers a thread,
threads a block and shared memory (read from the cubin Triton compiles for the launch,
:mod:`te_paged.tools.kernel_table`, no GPU needed) against the SM's limits, by the rules of CUDA's
occupancy calculator (``cuda_occupancy.h``, ``cudaOccupancyMaxActiveBlocksPerMultiprocessor``).

Registers are allocated per warp in units of 256, from each of the SM's four sub-partitions
(16,384 registers each). Worked example, sm_90, 4 warps a block: 90 registers a thread are 2,880
a warp, allocated 3,072; a sub-partition holds 5 such warps, the SM 20, so 5 blocks: 20 of 64
warps resident (31 %), limited by registers. At 40 registers: 1,280 a warp, 12 a sub-partition,
48 an SM, 12 blocks (75 %). At 32 or fewer: 16 a sub-partition, 64 an SM, 16 blocks (100 %),
where the limit of 64 warps an SM binds as well.

Shared memory counts each block's static shared memory plus the 1 KiB the runtime reserves per
block (sm_80 and later), in 128-byte units, against the SM's largest carve-out (the driver picks
one that fits). No dynamic shared memory: te_paged's and Megatron's stash kernels use none.

:func:`compiled_resources` compiles recorded launches (:mod:`te_paged.tools.launches`) in a
process of its own (``python -m te_paged.tools.occupancy``): Triton compiles nothing in a process
that has interpreted a kernel (``TRITON_INTERPRET=1``; the interpreter leaves ``triton.language``
patched), so a dry run on the CPU reads its registers there. A launch travels as a spec — the
kernel's source file and name, its arguments' values or, for tensors, their dtype and 16-byte
alignment (all that Triton specialises a tensor on) — and the kernel is compiled from its file,
loaded under a name of its own (so a kernel module whose package is slow to import, Megatron's,
costs only its own import).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile

__all__ = [
    "SM_LIMITS",
    "CompileJob",
    "KernelResources",
    "Occupancy",
    "SmLimits",
    "compiled_resources",
    "launch_resources",
    "launch_spec",
    "main",
    "occupancy",
]

_REGISTER_UNIT = 256  # registers are allocated to a warp in units of this many
_SUB_PARTITIONS = 4  # an SM's register file is split four ways (sm_70 and later)
_SHARED_UNIT = 128  # bytes: shared memory is allocated in units of this many (sm_70 and later)
_RESERVED_SHARED = 1024  # bytes the runtime reserves per block (sm_80 and later)
_WARP = 32


@dataclasses.dataclass(frozen=True)
class SmLimits:
    """One SM's limits (CUDA C++ Programming Guide, technical specifications per compute
    capability)."""

    arch: int  # compute capability x 10: 90 for sm_90
    max_warps: int
    max_blocks: int
    registers: int  # 32-bit registers
    shared_bytes: int  # the largest shared-memory carve-out


SM_LIMITS = {
    limits.arch: limits
    for limits in (
        SmLimits(80, max_warps=64, max_blocks=32, registers=65536, shared_bytes=164 * 1024),
        SmLimits(86, max_warps=48, max_blocks=16, registers=65536, shared_bytes=100 * 1024),
        SmLimits(89, max_warps=48, max_blocks=24, registers=65536, shared_bytes=100 * 1024),
        SmLimits(90, max_warps=64, max_blocks=32, registers=65536, shared_bytes=228 * 1024),
        SmLimits(100, max_warps=64, max_blocks=32, registers=65536, shared_bytes=228 * 1024),
    )
}


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What one compiled launch asks of an SM."""

    kernel: str
    arch: int
    registers: int  # a thread
    threads: int  # a block: num_warps x 32
    shared_bytes: int  # a block, static, as the cubin declares it
    spill_bytes: int  # a thread: stack frame and local memory


@dataclasses.dataclass(frozen=True)
class Occupancy:
    """Blocks (and their warps) of one kernel resident on an SM at once, and what limits them."""

    blocks: int
    warps: int
    max_warps: int
    limited_by: str  # "registers", "warps", "blocks" or "shared memory" (ties: all, joined)

    @property
    def fraction(self) -> float:
        return self.warps / self.max_warps


def _ceil_to(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def occupancy(res: KernelResources, limits: SmLimits) -> Occupancy:
    """``res``'s resident blocks and warps on one SM of ``limits`` (module docstring)."""
    if res.threads < 1 or res.registers < 0 or res.shared_bytes < 0:
        raise ValueError(f"not a launch: {res}")
    warps_per_block = -(-res.threads // _WARP)
    per_warp = _ceil_to(res.registers * _WARP, _REGISTER_UNIT)
    by = {"blocks": limits.max_blocks, "warps": limits.max_warps // warps_per_block}
    if per_warp:
        per_partition = limits.registers // _SUB_PARTITIONS // per_warp
        by["registers"] = per_partition * _SUB_PARTITIONS // warps_per_block
    shared = _ceil_to(res.shared_bytes + _RESERVED_SHARED, _SHARED_UNIT)
    by["shared memory"] = limits.shared_bytes // shared
    blocks = min(by.values())
    limited_by = ", ".join(k for k, v in by.items() if v == blocks)
    return Occupancy(blocks, blocks * warps_per_block, limits.max_warps, limited_by)


def launch_resources(launch, arch: int) -> KernelResources:
    """What ``launch`` (a :class:`~te_paged.tools.launches.Launch`) asks of an SM once compiled
    for ``sm_<arch>`` (:func:`~te_paged.tools.kernel_table.compile_kernel`; ``cuobjdump`` from
    Triton's wheel reads the registers)."""
    from te_paged.tools.kernel_table import compile_kernel, resource_usage

    compiled = compile_kernel(launch, arch)
    usage = resource_usage(compiled.asm["cubin"])
    return KernelResources(
        kernel=launch.name,
        arch=arch,
        registers=usage.get("REG", 0),
        threads=compiled.metadata.num_warps * _WARP,
        shared_bytes=usage.get("SHARED", 0),
        spill_bytes=usage.get("STACK", 0) + usage.get("LOCAL", 0),
    )


def launch_spec(launch) -> dict:
    """``launch`` as JSON: what compiling it elsewhere needs (module docstring)."""
    import torch

    def arg(value: object) -> dict:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).removeprefix("torch.")
            return {"tensor": dtype, "aligned": value.data_ptr() % 16 == 0}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        raise TypeError(f"{launch.name}: cannot send an argument of type {type(value).__name__}")

    fn = launch.kernel.fn
    return {"file": inspect.getsourcefile(fn), "kernel": fn.__name__,
            "args": [arg(a) for a in launch.args],
            "kwargs": {k: arg(v) for k, v in launch.kwargs.items()}}  # fmt: skip


def _launch(spec: dict, modules: dict[str, object]):
    """The :class:`~te_paged.tools.launches.Launch` of ``spec``, its kernel loaded from its
    file (each file once, in ``modules``)."""
    import torch

    from te_paged.tools.launches import Launch

    path = spec["file"]
    if path not in modules:
        name = f"_te_paged_occupancy_{len(modules)}"
        loader = importlib.util.spec_from_file_location(name, path)
        module = modules[path] = importlib.util.module_from_spec(loader)
        sys.modules[name] = module  # where its dataclasses look themselves up
        loader.loader.exec_module(module)

    def arg(a: dict) -> object:
        if "value" in a:
            return a["value"]
        dtype = getattr(torch, a["tensor"])
        # CPU allocations are 64-byte aligned; one element in, a misaligned pointer.
        return torch.empty(16, dtype=dtype) if a["aligned"] else torch.empty(17, dtype=dtype)[1:]

    kernel = getattr(modules[path], spec["kernel"])
    args = tuple(arg(a) for a in spec["args"])
    return Launch(kernel, (1,), args, {k: arg(v) for k, v in spec["kwargs"].items()})


class CompileJob:
    """:func:`compiled_resources` started: the compiles run in their process while the caller
    goes on; :meth:`result` waits for them."""

    def __init__(self, launches: list, arch: int, timeout_s: float = 600.0) -> None:
        self._dir = tempfile.TemporaryDirectory()
        self._out = os.path.join(self._dir.name, "resources.json")
        specs = os.path.join(self._dir.name, "launches.json")
        with open(specs, "w") as f:
            json.dump([launch_spec(launch) for launch in launches], f)
        cmd = [sys.executable, "-m", __name__, "--arch", str(arch), specs, self._out]
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        self._proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)  # fmt: skip
        self._timeout_s = timeout_s

    def result(self) -> list[KernelResources]:
        """Each launch's resources, in order; ``RuntimeError`` with the process's error."""
        try:
            _, err = self._proc.communicate(timeout=self._timeout_s)
            if self._proc.returncode:
                raise RuntimeError(f"compiling the launches failed:\n{err[-3000:]}")
            with open(self._out) as f:
                return [KernelResources(**r) for r in json.load(f)]
        finally:
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            self._dir.cleanup()


def compiled_resources(launches: list, arch: int) -> list[KernelResources]:
    """What each of ``launches`` asks of an SM of ``sm_<arch>``, compiled in a process of its
    own (module docstring), in order."""
    return CompileJob(launches, arch).result()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Compile recorded launches (JSON specs, from "
                                "launch_spec) and write their resources as JSON.")  # fmt: skip
    p.add_argument("--arch", type=int, required=True, help="compute capability x 10 (90)")
    p.add_argument("specs", help="the launches: a JSON list of launch_spec()s")
    p.add_argument("out", help="write the KernelResources here, a JSON list in their order")
    args = p.parse_args(argv)
    with open(args.specs) as f:
        specs = json.load(f)
    modules: dict[str, object] = {}
    rows = [launch_resources(_launch(spec, modules), args.arch) for spec in specs]
    with open(args.out, "w") as f:
        json.dump([dataclasses.asdict(r) for r in rows], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
