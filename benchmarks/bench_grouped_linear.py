"""GroupedLinear forward+backward: device-initiated path vs legacy path vs an F.linear loop.

Four ways to compute the same expert GEMMs on a static ``[rows, hidden]`` buffer whose first
``rows / capacity`` rows are real (skewed random routing over ``experts`` experts):

* ``device``: ``GroupedLinear(use_grouped_tensor=True, single_grouped_weight=True)`` —
  ``torch._grouped_mm`` with offsets on the device, padding rows zeroed with a mask, no host
  read; ``device-discrete`` is the same with ``weight{i}`` parameters, which it must
  ``torch.stack`` into ``[E, out, in]`` in forward and again in backward (a copy each);
* ``legacy``: ``GroupedLinear(use_grouped_tensor=False)`` — splits read on the host,
  ``torch.split`` and one ``F.linear`` per expert;
* ``loop``: the bare per-expert ``F.linear`` loop on leaf weights (no module), the floor of
  what host-split code can do.

Each timing is forward + backward (input and weight gradients) of one layer ``hidden -> ffn``:
``--warmup`` calls, then the median of ``--repeats`` calls timed by
``torch.utils.benchmark.Timer`` (each after the Timer's own two warm-up calls). Ratios are
``other / device`` (above 1.0: the device path is faster). Before timing, outputs and gradients
of the four are checked to be bitwise equal (the device path runs one ``mm`` per group on CPU).

    python benchmarks/bench_grouped_linear.py --out benchmarks/results/grouped_linear-<date>.md
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from te_paged.grouped import GroupedLinear
from te_paged.tools.bench import median_of, timer
from te_paged.tools.progress import Progress


@dataclasses.dataclass(frozen=True)
class Config:
    experts: int
    hidden: int
    ffn: int
    rows: int
    dtype: torch.dtype
    capacity: float = 1.25
    seed: int = 0

    @property
    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"E={self.experts} {self.hidden}->{self.ffn} rows={self.rows} {dtype}"


@dataclasses.dataclass
class Result:
    config: Config
    real_rows: int
    device_s: float
    discrete_s: float
    legacy_s: float
    loop_s: float

    @property
    def gflop(self) -> float:  # forward + dgrad + wgrad over the real rows
        return 6 * self.real_rows * self.config.hidden * self.config.ffn / 1e9


def _median_time(fn: Callable[[], None], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    t = timer(fn)
    return median_of([t.timeit(1) for _ in range(repeats)])


def _splits(cfg: Config) -> list[int]:
    g = torch.Generator().manual_seed(cfg.seed)
    real = int(cfg.rows / cfg.capacity)
    weights = torch.rand(cfg.experts, generator=g) ** 2 + 0.05  # skewed load
    counts = torch.multinomial(weights, real, replacement=True, generator=g)
    return torch.bincount(counts, minlength=cfg.experts).tolist()


def run_config(cfg: Config, warmup: int, repeats: int) -> Result:
    torch.manual_seed(cfg.seed)
    splits = _splits(cfg)
    n = sum(splits)
    shape = (cfg.experts, cfg.hidden, cfg.ffn)
    discrete = GroupedLinear(*shape, bias=False, params_dtype=cfg.dtype)
    device = GroupedLinear(*shape, bias=False, params_dtype=cfg.dtype, single_grouped_weight=True)
    legacy = GroupedLinear(*shape, bias=False, params_dtype=cfg.dtype, use_grouped_tensor=False)
    device.load_state_dict(discrete.state_dict())
    legacy.load_state_dict(discrete.state_dict())
    loop_w = [w.detach().clone().requires_grad_() for w in discrete.weight_params()]
    x = torch.randn(cfg.rows, cfg.hidden).to(cfg.dtype).requires_grad_()
    dy = torch.randn(cfg.rows, cfg.ffn).to(cfg.dtype)
    splits_dev = torch.tensor(splits)

    def step_device() -> None:
        device(x, splits_dev).backward(dy)

    def step_discrete() -> None:
        discrete(x, splits_dev).backward(dy)

    def step_legacy() -> None:
        legacy(x, splits).backward(dy)

    def step_loop() -> None:
        outs = [F.linear(x_g, w) for x_g, w in zip(torch.split(x[:n], splits), loop_w)]
        torch.cat([*outs, x.new_zeros(cfg.rows - n, cfg.ffn)]).backward(dy)

    variants = [
        (step_device, device.weight_params()),
        (step_discrete, discrete.weight_params()),
        (step_legacy, legacy.weight_params()),
        (step_loop, loop_w),
    ]
    grads = []
    for step, params in variants:
        x.grad = None
        for p in params:
            p.grad = None
        step()
        dw = torch.stack([p.grad for p in params]) if len(params) > 1 else params[0].grad
        grads.append((x.grad.clone(), dw))
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other)), cfg.label

    def timed(step: Callable[[], None], params: list[torch.Tensor]) -> float:
        def run() -> None:
            x.grad = None
            for p in params:
                p.grad = None
            step()

        return _median_time(run, warmup, repeats)

    return Result(cfg, n, *(timed(step, params) for step, params in variants))


def report(results: list[Result], argv: list[str], warmup: int, repeats: int) -> str:
    lines = [
        "# GroupedLinear forward+backward: device-initiated vs legacy vs F.linear loop",
        "",
        f"Command: `python benchmarks/bench_grouped_linear.py {' '.join(argv)}`  ",
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, CPU, torch "
        f"{torch.__version__}; no bias; capacity factor {results[0].config.capacity} (real "
        f"rows = rows / capacity, skewed routing); median of {repeats} "
        f"(torch.utils.benchmark.Timer) after {warmup} warm-up. "
        "Outputs and gradients of the four were checked bitwise equal first.",
        "",
        "| config | real rows | device ms | device-discrete ms | legacy ms | loop ms "
        "| GFLOP/s (device) | discrete / device | legacy / device | loop / device |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.config.label} | {r.real_rows} | {1e3 * r.device_s:.1f} | "
            f"{1e3 * r.discrete_s:.1f} | {1e3 * r.legacy_s:.1f} | {1e3 * r.loop_s:.1f} | "
            f"{r.gflop / r.device_s:.0f} | {r.discrete_s / r.device_s:.2f} | "
            f"{r.legacy_s / r.device_s:.2f} | {r.loop_s / r.device_s:.2f} |"
        )
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=8, help="experts (%(default)s)")
    p.add_argument("--shapes", nargs="+", default=["512x1024x4096", "1024x2048x8192"],
                   help="HIDDENxFFNxROWS, ROWS the static buffer (%(default)s)")  # fmt: skip
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   help="parameter and input dtypes (%(default)s)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed calls before timing (%(default)s)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=5,
                   help="timed calls, of which the median is reported (%(default)s)")  # fmt: skip
    p.add_argument("--out", help="write the Markdown report here too")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    results = []
    with Progress(len(args.shapes) * len(args.dtypes), "bench_grouped_linear") as progress:
        for shape in args.shapes:
            hidden, ffn, rows = (int(v) for v in shape.split("x"))
            for dtype in args.dtypes:
                cfg = Config(args.experts, hidden, ffn, rows, getattr(torch, dtype))
                results.append(run_config(cfg, args.warmup, args.repeats))
                progress(cfg.label)
    text = report(results, argv, args.warmup, args.repeats)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
