"""Check 13: ``te-paged ab``'s default model with every MoE block compiled (Inductor, and its
CUDA-graph mode), ON vs OFF."""

from __future__ import annotations

import functools
import statistics

import torch

from .common import RUN, STASH_KERNELS, TargetMissed, all_same, kernel_times, section, timed

#: The compiled modes: Inductor's default and its CUDA-graph mode (``reduce-overhead``).
BACKENDS = ("inductor", "reduce-overhead")
#: A smoke run's: ``aot_eager`` traces the same graphs (fullgraph, te_paged's ops opaque) and
#: runs them without Inductor's code generation, the seconds of a compile on the CPU.
SMOKE_BACKENDS = ("aot_eager",)

NAME = "the default ab model compiled (Inductor; reduce-overhead: CUDA graphs), one rank"
TARGET = (
    "compiled ON vs OFF bitwise, every gradient, Inductor and reduce-overhead; te_paged's "
    "stash and pop kernels in the compiled step's profile; step time ON/OFF compiled beside "
    "eager (figures)"
)


def _model_config():
    from te_paged.tools.model import ModelConfig

    if RUN.smoke:  # one layer, one compile per model: it pages (no immediate backward to skip)
        return ModelConfig(tokens=64, layers=1, hidden=64, ffn=128, kernel_backend=RUN.backend,
                           skip_immediate_backward=False)  # fmt: skip
    return ModelConfig(tokens=4096 if RUN.cuda else 256, kernel_backend=RUN.backend)


def _compiled_model(paged: bool, mode: str | None):
    """``te-paged ab``'s default model (one rank) with every MoE block compiled, fullgraph
    (``mode``: Inductor's mode, or ``aot_eager``; ``None`` eager), its runner, and its
    batches."""
    from te_paged.runtime.runner import PagedStashRunner
    from te_paged.tools.model import ToyMoEModel, make_batch

    cfg = _model_config()
    model = ToyMoEModel(cfg, paged=paged, group=None, device=RUN.device)
    if mode in ("aot_eager", "eager"):
        for layer in model.layers:
            layer.compile(backend=mode, fullgraph=True)
    elif mode is not None:
        for layer in model.layers:
            layer.compile(backend="inductor", mode=None if mode == "inductor" else mode,
                          fullgraph=True)  # fmt: skip
    runner = PagedStashRunner(model, model.manager, measure_fallback_memory=False)
    batches = [make_batch(cfg, step, 0, RUN.device) for step in range(2)]

    def step(i: int) -> list[torch.Tensor]:
        x, target = batches[i % 2]
        model.zero_grad(set_to_none=False)

        def fn() -> torch.Tensor:
            loss = model(x, target)
            loss.backward()
            return loss.detach()

        loss, record = runner.step(fn)
        if paged and record.attempt != 1:
            raise AssertionError(f"step {i} reran: {record}")
        return [loss, *(p.grad.clone() for p in model.parameters())]

    return model, step


def run() -> str:
    """Three modes (eager, Inductor, Inductor's ``reduce-overhead``), each ON and OFF: the
    capture step and one paged step bitwise; then, interleaved, step times after warm-up. A
    smoke run compiles with ``aot_eager`` instead."""
    torch._dynamo.reset()
    if RUN.smoke:
        warmup, repeats, backends = 0, 1, SMOKE_BACKENDS
    else:
        warmup, repeats, backends = (1, 2, BACKENDS) if RUN.dry else (3, 10, BACKENDS)
    runs, steps, equal = {}, {}, {}
    for mode in (None, *backends):
        label = mode or "eager"
        for paged in (False, True):
            model, step = _compiled_model(paged, mode)
            runs[(label, paged)] = [step(i) for i in range(2 + warmup)]
            steps[(label, paged)] = (model, step)
        equal[label] = all(all_same(a, b) for a, b in zip(runs[(label, True)],
                                                          runs[(label, False)]))  # fmt: skip
    times: dict[tuple[str, bool], list[float]] = {k: [] for k in steps}
    for i in range(repeats):
        for key, (_, step) in steps.items():
            times[key].append(timed(functools.partial(step, i))[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    profiled = backends[0]
    model, step = steps[(profiled, True)]
    kernels = kernel_times(functools.partial(step, 0))
    ours = {n: ms for n, ms in kernels.items() if n.startswith(STASH_KERNELS) or "te_paged" in n}
    stats = model.manager.stats()
    table = [
        f"`te-paged ab`'s default model, one rank, {_model_config().tokens} tokens, every MoE "
        f"block compiled with fullgraph=True; {repeats} timed steps each after the capture step "
        f"and {warmup} warm-up steps, interleaved.",
        "",
        "| mode | ON/OFF bitwise | OFF ms (median) | ON ms (median) | ON/OFF |",
        "| --- | :---: | ---: | ---: | ---: |",
    ]
    for label in equal:
        off, on = med[(label, False)], med[(label, True)]
        table.append(f"| {label} | {'yes' if equal[label] else 'NO'} | {1e3 * off:.2f} "
                     f"| {1e3 * on:.2f} | {on / off:.3f} |")  # fmt: skip
    name = "Inductor" if profiled == "inductor" else profiled
    table += ["", f"te_paged's kernels in one profiled compiled step ({name}, ON): "
              + (", ".join(f"`{n}` {ms:.3f} ms" for n, ms in sorted(ours.items())) or "none"),
              f"; the step's stashes/pops {stats.stashes}/{stats.pops}."]  # fmt: skip
    text = "\n".join(table)
    print(text)
    section(text)
    ratios = ", ".join(f"{k} {med[(k, True)] / med[(k, False)]:.3f}" for k in equal)
    same = ", ".join(f"{k} {v}" for k, v in equal.items())
    detail = (f"ON/OFF bitwise: {same}; step time ON/OFF: {ratios}; te_paged kernels in the "
              f"compiled profile: {len(ours)}")  # fmt: skip
    if not all(equal.values()) or not stats.stashes == stats.pops > 0:
        raise AssertionError(detail)
    if RUN.cuda and not any(n.startswith(STASH_KERNELS) for n in ours):
        raise TargetMissed(f"{detail}; te_paged's stash kernels are not in the profile")
    return detail
