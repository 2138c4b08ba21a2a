"""Routing drift: the pool sized once (the old sizing) against the pool that sizes itself.

    python benchmarks/drift.py [--steps 200] [--nproc 4] --out benchmarks/results/X.md
    python benchmarks/drift.py --wire [--steps 200] --out benchmarks/results/wire-X.md

Trains ``te-paged ab``'s default model (8 MoE layers, 8 experts, top-2, hidden 256, 512 tokens
per rank) on ``--nproc`` gloo ranks (expert parallel over all of them) with SGD, so the routers
learn, while a skew drifts: a logit added on every rank to the two experts of one "hot" rank,

* phase 1 (first quarter of the steps): no skew, only the routers' own learning;
* phase 2: the skew ramps from 0 to ``--ramp`` towards rank 1's experts (a gradual drift);
* phase 3: the hot rank moves to rank 2 at the same strength (the need moves, not its size);
* phase 4: the skew jumps to ``--jump`` towards rank 3's experts (a sudden drift).

The same run twice, from the same seeds: ``fixed`` (``grow_pool=False``: the pool as the
capture step and the factor size it, Megatron's behaviour) and ``self-sizing`` (the runner's
default: the pool keeps the largest need seen x ``grow_headroom``, agreed across the expert-
parallel group). Both keep ``max_consecutive_fallbacks`` out of the way, so the fixed pool's
fallbacks are counted rather than stopped. A rerun gives the result of a run that never
overflowed, so both runs train identically (checked: every step's loss bitwise equal) and see
the same routing; only their pools and fallbacks differ.

Reported per run and phase: stash-overflow fallbacks, over-budget reruns (the capacity factor,
the same for both), pool growths; then the pool held at the end against the largest need of
any step (``pool_demand_pages``) and against the planner's figure (``te-paged plan``'s buffer
factor for a 0 % and a 1 % rerun rate, from the routing the run recorded), and the saving: one
more step after training, measured (torch's MemTracker) with the stash on (plus the pool) and
off (the same model and batch, the static buffers saved whole). Both runs keep the wire at the
expert factor (``a2a_capacity_factor=2.0``), so that its reruns do not enter the pool's figures.

With ``--wire`` the same schedule runs once per wire setting instead (the pool self-sizing in
each): the wire fixed at the expert factor (the old wire), and the auto wire (sized once its
first steps' demand stops rising, then raised as routing needs) at several
``capacity_headroom``s. Reported per run and phase: over-budget reruns and wire changes; over
the run: the bytes sent against a dropless exchange of the same routing (the reruns' bytes
included), the wire factor at step 2 and at the end, the pool and the peaks of one more step.
The bytes and the reruns do not depend on the machine; the default ``capacity_headroom`` is
chosen from them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from te_paged.runtime import PagedStashRunner
from te_paged.runtime.memory import measure_peak
from te_paged.runtime.planner import RoutingProfile, recommend
from te_paged.tools.launch import rendezvous_url, spawn_ranks
from te_paged.tools.model import ModelConfig, ToyMoEModel, make_batch

RUNS = {"fixed": False, "self-sizing": True}  # name -> grow_pool
# --wire: name -> (a2a_capacity_factor, grow_capacity, capacity_headroom)
WIRE_RUNS = {
    "wire at the expert factor": (2.0, False, 1.05),
    "auto, headroom 1.05": (None, True, 1.05),
    "auto, headroom 1.10": (None, True, 1.10),
    "auto, headroom 1.25": (None, True, 1.25),
}
PHASES = ("routers learn", "skew ramps (rank 1)", "hot rank moves (rank 2)", "skew jumps (rank 3)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="training steps (%(default)s)")
    p.add_argument("--nproc", type=int, default=4, help="gloo ranks (%(default)s)")
    p.add_argument("--ramp", type=float, default=0.04,
                   help="skew reached by the end of phase 2, a logit (%(default)s)")  # fmt: skip
    p.add_argument("--jump", type=float, default=0.08,
                   help="skew of phase 4, from its first step (%(default)s)")  # fmt: skip
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (%(default)s)")
    p.add_argument("--timeout", type=float, default=600, help="per-rank stall limit, seconds")
    p.add_argument("--wire", action="store_true", help="compare wire settings, not pool sizings")
    p.add_argument("--out", help="write the Markdown report here (and the figures as .json)")
    return p


def phase_of(step: int, steps: int) -> int:
    return min(3, 4 * step // steps)


def skew_at(step: int, steps: int, args: argparse.Namespace, world: int) -> tuple[int, float]:
    """``(hot rank, logit)`` of ``step``: see the module docstring."""
    quarter = steps / 4
    phase = phase_of(step, steps)
    if phase == 0:
        return 0, 0.0
    if phase == 1:
        return 1 % world, args.ramp * (step - quarter + 1) / quarter
    if phase == 2:
        return 2 % world, args.ramp
    return 3 % world, args.jump


def _train(cfg: ModelConfig, grow: bool, args, rank: int, world: int, watchdog, name: str,
           **runner_kw):  # fmt: skip
    group = dist.group.WORLD
    model = ToyMoEModel(cfg, paged=True, group=group)
    experts_per_rank = cfg.experts // world
    runner = PagedStashRunner(
        model,
        model.manager,
        group=group,
        grow_pool=grow,
        max_consecutive_fallbacks=10**9,  # count the fixed pool's fallbacks, do not stop them
        measure_fallback_memory=False,
        record_routing=not args.wire,  # one all_gather per step: the routing the planner reads
        **runner_kw,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    records, losses, dropless, skew = [], [], [], None
    for step in range(args.steps):
        hot, strength = skew_at(step, args.steps, args, world)
        if (hot, strength) != skew:
            first = hot * experts_per_rank
            for layer in model.layers:
                layer.router.set_skew(list(range(first, first + experts_per_rank)), strength)
            skew = (hot, strength)
        x, target = make_batch(cfg, step, rank)
        optimizer.zero_grad(set_to_none=False)

        def step_fn(x=x, target=target):
            loss = model(x, target)
            loss.backward()
            return loss.detach()

        loss, record = runner.step(step_fn, step=step)
        optimizer.step()
        losses.append(float(loss))
        records.append(dataclasses.asdict(record))
        dropless.append(sum(int(d.dropless_bytes) for d in runner.dispatchers))
        watchdog.progress(f"{name} step {step + 1}/{args.steps}")
    # The saving, on one more step from the trained state: stash on (plus the pool), then off.
    x, target = make_batch(cfg, args.steps, rank)
    manager = model.manager
    manager.reset()  # a pending growth allocates here, outside the measurement

    def measured_step() -> None:
        model.zero_grad(set_to_none=False)
        model(x, target).backward()

    on = measure_peak(measured_step, torch.device("cpu"))[1].peak_bytes
    stats = manager.stats()
    manager.reset()
    with manager.disabled():
        off = measure_peak(measured_step, torch.device("cpu"))[1].peak_bytes
    if args.wire:
        return {"records": records, "losses": losses, "dropless_bytes": dropless,
                "peak_on": on, "peak_off": off, "pool_bytes": stats.pool_bytes}  # fmt: skip
    key_pages = {str(k): manager.capture_peaks(k) for k in manager.keys}
    page_bytes = {str(k): manager.page_size * k.row_bytes for k in manager.keys}
    profile = runner.routing_profile() if rank == 0 else None
    return {
        "records": records,
        "losses": losses,
        "peak_on": on,
        "peak_off": off,
        "pool_bytes": stats.pool_bytes,
        "overflowed_at_end": stats.overflow,
        "capture_peaks": key_pages,  # key -> (balanced, observed, static) pages
        "page_bytes": page_bytes,
        "profile": None if profile is None else dataclasses.asdict(profile),
    }


def _rank(rank: int, world: int, watchdog, args: argparse.Namespace):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        "gloo",
        init_method=rendezvous_url(watchdog),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=args.timeout),
    )
    try:
        cfg = ModelConfig(steps=args.steps, a2a_capacity_factor=2.0)
        runs = {name: (cfg, grow, {}) for name, grow in RUNS.items()}
        if args.wire:
            runs = {
                name: (
                    dataclasses.replace(cfg, a2a_capacity_factor=a2a),
                    True,
                    {"grow_capacity": grow, "capacity_headroom": headroom},
                )
                for name, (a2a, grow, headroom) in WIRE_RUNS.items()
            }
        out = {}
        for name, (run_cfg, grow, kw) in runs.items():
            start = time.perf_counter()
            out[name] = _train(run_cfg, grow, args, rank, world, watchdog, name, **kw)
            out[name]["seconds"] = time.perf_counter() - start
        every = [None] * world
        dist.all_gather_object(every, out)
        dist.barrier()
        return every if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def summarize(ranks: list[dict], args: argparse.Namespace) -> dict:
    """Per run: per-phase counts and the end-of-run figures (max over ranks where per rank)."""
    out = {}
    for name in RUNS:
        runs = [r[name] for r in ranks]
        records = runs[0]["records"]  # the reduced figures are the same on every rank
        phases = []
        for p in range(4):
            mine = [r for r in records if phase_of(r["step"], args.steps) == p]
            growth_steps = sorted(
                {rec["step"] for run in runs for rec in run["records"] if rec["pool_growth"]
                 and phase_of(rec["step"], args.steps) == p}
            )  # fmt: skip
            phases.append({
                "name": PHASES[p],
                "steps": len(mine),
                "stash_fallbacks": sum(r["stash_overflow_ranks"] > 0 for r in mine),
                "overbudget_reruns": sum(r["overbudget_ranks"] > 0 for r in mine),
                "growth_steps": growth_steps,
            })  # fmt: skip
        balanced = {k: v[0] for k, v in runs[0]["capture_peaks"].items()}
        static = {k: max(r["capture_peaks"][k][2] for r in runs) for k in balanced}
        page_bytes = runs[0]["page_bytes"]
        need = {k: max(r["pool_demand_pages"].get(k, 0) for r in records) for k in balanced}
        final = {k: records[-1]["pool_pages"][k] for k in balanced}
        for run in runs:  # a growth after the last step is what the next step would hold
            for k, g in run["records"][-1]["pool_growth"].items():
                final[k] = max(final[k], g["to"])
        profile = RoutingProfile(**ranks[0][name]["profile"])
        out[name] = {
            "phases": phases,
            "seconds": max(r["seconds"] for r in runs),
            "need_pages": need,
            "final_pool_pages": final,
            "balanced_pages": balanced,
            "static_pages": static,
            "need_bytes": sum(need[k] * page_bytes[k] for k in need),
            "final_pool_bytes": sum(final[k] * page_bytes[k] for k in final),
            "static_bytes": sum(static[k] * page_bytes[k] for k in static),
            "pool_factor": max(final[k] / balanced[k] for k in final),
            "need_factor": max(need[k] / balanced[k] for k in need),
            "planner_factor_0": recommend(profile, 0.0).buffer_size_factor_cuda,
            "planner_factor_1": recommend(profile, 0.01).buffer_size_factor_cuda,
            "peak_on": max(r["peak_on"] + r["pool_bytes"] for r in runs),
            "measured_step_fits": not any(r["overflowed_at_end"] for r in runs),
            "steps_with_stash": sum(r["enabled"] for r in records[1:]),
            "peak_off": max(r["peak_off"] for r in runs),
            "losses": runs[0]["losses"],
        }
    fixed, grown = out["fixed"]["losses"], out["self-sizing"]["losses"]
    out["losses_bitwise_equal"] = fixed == grown
    return out


def summarize_wire(ranks: list[dict], args: argparse.Namespace) -> dict:
    """Per wire setting: per-phase reruns and growths; bytes over the run (max over ranks of
    each rank's sum) against the dropless reference; the wire at the end."""
    out = {}
    for name in WIRE_RUNS:
        runs = [r[name] for r in ranks]
        records = runs[0]["records"]
        phases = []
        for p in range(4):
            mine = [r for r in records if phase_of(r["step"], args.steps) == p]
            phases.append({
                "name": PHASES[p],
                "steps": len(mine),
                "overbudget_reruns": sum(r["overbudget_ranks"] > 0 for r in mine),
                "stash_fallbacks": sum(r["stash_overflow_ranks"] > 0 for r in mine),
                "wire_changes": [r["step"] for r in mine if r["capacity_growth"]],
            })  # fmt: skip
        sent = max(sum(rec["bytes_sent"] for rec in run["records"]) for run in runs)
        reference = max(sum(run["dropless_bytes"]) for run in runs)
        last = records[-1]
        final = last["capacity_growth"].get("to", last["a2a_capacity_factor"])
        out[name] = {
            "phases": phases,
            "bytes_sent": sent,
            "dropless_bytes": reference,
            "ratio": sent / reference,
            "reruns": sum(r["attempt"] == 2 for r in records),
            "final_factor": final,
            "first_factor": records[2]["a2a_capacity_factor"],  # ab's last default step
            "pool_bytes": max(run["pool_bytes"] for run in runs),
            "peak_on": max(run["peak_on"] + run["pool_bytes"] for run in runs),
            "peak_off": max(run["peak_off"] for run in runs),
            "seconds": max(run["seconds"] for run in runs),
            "losses": runs[0]["losses"],
        }
    losses = [out[name]["losses"] for name in WIRE_RUNS]
    out["losses_bitwise_equal"] = all(x == losses[0] for x in losses)
    return out


def _header(title: str, command: str, setup: str) -> list[str]:
    """A report's title, command and machine line (``setup``: the run's own words)."""
    return [
        f"# {title} ({datetime.date.today()})",
        "",
        f"Command: `{command}`  ",
        f"Machine: {platform.machine()}, {os.cpu_count()} threads, CPU, torch "
        f"{torch.__version__}; {setup}",
        "",
    ]


def report_wire(summary: dict, args: argparse.Namespace, command: str) -> str:
    lines = [
        *_header(
            "The wire under routing drift",
            command,
            f"{args.nproc} gloo ranks; {args.steps} steps of SGD (lr {args.lr}) on `te-paged "
            "ab`'s default model (capacity factor 2.0, the pool self-sizing); skew ramp to "
            f"{args.ramp}, jump to {args.jump} (benchmarks/drift.py).",
        ),
        "Every run trains identically (every step's loss bitwise equal across the settings: "
        f"**{'yes' if summary['losses_bitwise_equal'] else 'NO'}**); they differ in their wire.",
        "",
        "## Over-budget reruns per phase (wire changes at steps)",
        "",
        "| phase | steps | " + " | ".join(WIRE_RUNS) + " |",
        "| --- | ---: | " + " | ".join("---" for _ in WIRE_RUNS) + " |",
    ]
    for p in range(4):
        cells = []
        for name in WIRE_RUNS:
            ph = summary[name]["phases"][p]
            at = ", ".join(map(str, ph["wire_changes"])) or "none"
            cells.append(f"{ph['overbudget_reruns']} ({at})")
        first = summary[next(iter(WIRE_RUNS))]["phases"][p]
        lines.append(f"| {first['name']} | {first['steps']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Bytes over the run",
        "",
        "*Sent*: every all-to-all a rank handed gloo in the run (dispatch, combine, both "
        "backwards, metadata, the reruns' attempts included), max over ranks. *Dropless*: what "
        "an exchange of only the routed rows would have sent for the kept attempts. *Reruns*: "
        "steps run twice (each costs about one more step of compute). *Pool*: the stash "
        "pool at the end (self-sizing in every run). *Peak*: one more step after training, "
        "torch MemTracker peak with the stash on (plus the pool) and off, max over ranks (the "
        "wire's send and receive buffers are part of it).",
        "",
        "| run | wire at step 2 | wire at the end | reruns | sent MiB | dropless MiB "
        "| sent / dropless | pool MiB | peak on MiB | peak off MiB | total s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in WIRE_RUNS:
        s = summary[name]
        lines.append(
            f"| {name} | {s['first_factor']:g} | {s['final_factor']:g} | {s['reruns']} "
            f"| {_mib(s['bytes_sent'])} | {_mib(s['dropless_bytes'])} | {s['ratio']:.2f} "
            f"| {_mib(s['pool_bytes'])} | {_mib(s['peak_on'])} | {_mib(s['peak_off'])} "
            f"| {s['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def report(summary: dict, args: argparse.Namespace, command: str) -> str:
    lines = [
        *_header(
            "Pool sizing under routing drift",
            command,
            f"{args.nproc} gloo ranks, expert parallel over all of them; {args.steps} steps of "
            f"SGD (lr {args.lr}) on `te-paged ab`'s default model (8 MoE layers, 8 experts, "
            "top-2, hidden 256, FFN 512, 512 tokens per rank, capacity factor 2.0, buffer "
            f"factor 1.10, page size 64); skew ramp to {args.ramp}, jump to {args.jump} "
            "(benchmarks/drift.py's docstring has the schedule).",
        ),
        "Both runs train identically (every step's loss bitwise equal: "
        f"**{'yes' if summary['losses_bitwise_equal'] else 'NO'}**); they differ in their pools.",
        "",
        "## Fallbacks and growths per phase",
        "",
        "| phase | steps | fixed: stash fallbacks | self-sizing: stash fallbacks | pool growths "
        "(self-sizing, at steps) | over-budget reruns (both) |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for fixed, grown in zip(summary["fixed"]["phases"], summary["self-sizing"]["phases"]):
        steps = ", ".join(map(str, grown["growth_steps"])) or "none"
        lines.append(
            f"| {fixed['name']} | {fixed['steps']} | {fixed['stash_fallbacks']} "
            f"| {grown['stash_fallbacks']} | {len(grown['growth_steps'])} ({steps}) "
            f"| {fixed['overbudget_reruns']} |"
        )
    lines += [
        "",
        "## Pool, need and saving at the end",
        "",
        "Factors are pages over the capture step's balanced pages (max over pool keys). *Need*: "
        "the most pages any step needed (`pool_demand_pages`, max over ranks and steps). "
        "*Planner*: `te-paged plan`'s buffer factor from the routing the run recorded, for a "
        "0 % and a 1 % rerun rate. *Static*: a pool as large as the static buffers (the "
        "saving is gone). *Steps kept with the stash*: after the capture step, the steps that "
        "did not fall back (a fallback step runs at the peak off). Memory: one more step "
        "after training, torch MemTracker peak with the stash on (plus the pool) and off, max "
        "over ranks.",
        "",
        "| run | steps kept with the stash | pool MiB | factor | need MiB | factor | planner 0 % "
        "| 1 % | pool / (planner 0 % x 1.10) | static MiB | peak on MiB | peak off MiB "
        "| saving MiB | measured step fits the pool | total s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | :---: | ---: |",
    ]
    for name in RUNS:
        s = summary[name]
        within = s["pool_factor"] / (s["planner_factor_0"] * 1.10)
        lines.append(
            f"| {name} | {s['steps_with_stash']} of {args.steps - 1} "
            f"| {_mib(s['final_pool_bytes'])} | {s['pool_factor']:.2f} "
            f"| {_mib(s['need_bytes'])} | {s['need_factor']:.2f} | {s['planner_factor_0']:.2f} "
            f"| {s['planner_factor_1']:.2f} | {within:.2f} | {_mib(s['static_bytes'])} "
            f"| {_mib(s['peak_on'])} | {_mib(s['peak_off'])} "
            f"| {_mib(s['peak_off'] - s['peak_on'])} "
            f"| {'yes' if s['measured_step_fits'] else 'no: it would rerun at peak off'} "
            f"| {s['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.steps < 8 or args.nproc < 1:
        print("drift.py: --steps must be >= 8 (four phases) and --nproc >= 1", file=sys.stderr)
        return 2
    command = "python benchmarks/drift.py " + " ".join(argv if argv is not None else sys.argv[1:])
    ranks = spawn_ranks(_rank, args.nproc, args.timeout, args, tracebacks=True)
    summary = (summarize_wire if args.wire else summarize)(ranks, args)
    text = (report_wire if args.wire else report)(summary, args, command)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        figures = {k: v for k, v in summary.items()}
        Path(args.out).with_suffix(".json").write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if summary["losses_bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
