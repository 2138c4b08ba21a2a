"""Check 8: peak allocated memory ON vs OFF against te_paged's capacity model."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from . import deepseek
from .common import RUN, TargetMissed, section

TARGET_RATIO = 0.95

NAME = "peak allocated memory ON vs OFF (CUDA allocator) vs the capacity model"
TARGET = f"saving >= {TARGET_RATIO} of the reload-adjusted model (cf - bf - R cf/L) x S"


def peak(fn: Callable[[], object]) -> int:
    """Peak bytes ``fn`` allocates above what was allocated before it: the CUDA caching
    allocator's ``max_memory_allocated`` after ``reset_peak_memory_stats`` (on CPU, torch's
    MemTracker through ``te_paged.runtime.memory``)."""
    if not RUN.cuda:
        from te_paged.runtime.memory import measure_peak

        return measure_peak(fn, RUN.device)[1].peak_bytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run() -> str:
    """Peak memory of one step after the capture step, per variant; ON adds its pool (allocated
    at the step boundary, before the measurement). S: the balanced-case bytes of the paged
    tensors; the model less the reloads live at the peak (R layers: 1, or 1 + the look-ahead
    with stream overlap), as ``te-paged ab`` reports it."""
    from te_paged.runtime.memory import capacity_model_saving, reload_adjusted_saving
    from te_paged.tools.ab import pool_and_s_bytes

    layers = deepseek.sizes()["layers"]
    models = deepseek.models()
    x0, x1 = deepseek.batch(0), deepseek.batch(1)
    figures: dict[str, tuple[int, int, int]] = {}  # label -> (peak incl. pool, pool, S)
    reloads: dict[str, int] = {}  # label -> R
    for label, model in models.items():
        deepseek.train_step(model, x0)  # the capture step; allocates the gradients
        managers = [] if model.manager is None else [model.manager]
        for m in managers:
            m.reset()  # allocates the pools: outside the measurement, added below
        top = peak(functools.partial(deepseek.train_step, model, x1))
        deepseek.check_clean({label: model})
        pool, s_bytes = pool_and_s_bytes(managers)
        figures[label] = (top + pool, pool, s_bytes)
        reloads[label] = max((m.reload_layers for m in managers), default=1)
    mib = 2**20
    off = figures["OFF"][0]
    table = [
        f"{deepseek.describe()}; peak of the step after the capture step, "
        f"{'CUDA caching allocator max_memory_allocated' if RUN.cuda else 'torch MemTracker'}.",
        "",
        "| variant | peak (incl. pool) MiB | pool MiB | S MiB | saving MiB | (cf − bf) × S MiB "
        "| saving / that | (cf − bf − R·cf/L) × S MiB | saving / that |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| OFF | {off / mib:.1f} | – | – | – | – | – | – | – |",
    ]
    ratios = {}
    for label, (top, pool, s_bytes) in figures.items():
        if label == "OFF":
            continue
        saving = off - top
        cf, bf = deepseek.CAPACITY, deepseek.BUFFER
        predicted = capacity_model_saving(cf, bf, s_bytes)
        adjusted = reload_adjusted_saving(cf, bf, s_bytes, layers, reloads[label])
        ratios[label] = saving / adjusted if adjusted > 0 else float("nan")
        table.append(
            f"| {label} | {top / mib:.1f} | {pool / mib:.1f} | {s_bytes / mib:.1f} "
            f"| {saving / mib:.1f} | {predicted / mib:.1f} | {saving / predicted:.3f} "
            f"| {adjusted / mib:.1f} (L {layers}, R {reloads[label]}) | {ratios[label]:.3f} |"
        )
    text = "\n".join(table)
    print(text)
    section(text)
    target_label = list(figures)[-1]  # overlap on, else the manager's default
    parts = [f"{k}: saving {(off - figures[k][0]) / mib:.1f} MiB = {r:.3f} of the model"
             for k, r in ratios.items()]  # fmt: skip
    detail = f"OFF peak {off / mib:.1f} MiB; " + "; ".join(parts)
    ratio = ratios[target_label]
    verdict = f"{target_label} {ratio:.3f}, target >= {TARGET_RATIO}"
    if not ratio >= TARGET_RATIO:
        raise TargetMissed(f"{detail}; MISSED: {verdict}")
    return f"{detail}; met: {verdict}"
