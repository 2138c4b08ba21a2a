"""``te-paged``'s parsers: help on every option, one name per knob, Megatron aliases, --version,
``--device auto``, the progress lines, and the checks that refuse flags of the other mode."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import itertools
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from te_paged import cli
from te_paged._version import __version__
from te_paged.runtime.planner import min_profile_steps
from te_paged.tools import ab_command, bench_command, plan_command
from te_paged.tools.progress import Progress

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _benchmark_parser(name: str) -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location(f"benchmarks.{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module.parser()


def _walk(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.Action]]:
    """``(command, option)`` for every option of ``parser`` and of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk(sub, f"{name} {sub_name}")
        elif action.option_strings:
            yield name, action


def _says_nothing(action: argparse.Action) -> bool:
    """No help, or help that is only a parenthesis, e.g. ``"(%(default)s)"``."""
    text = action.help
    if text is None or text == argparse.SUPPRESS:
        return True
    return not re.search(r"[A-Za-z]{2,}", re.sub(r"\([^()]*\)", "", text))


def _undocumented(parser: argparse.ArgumentParser, name: str) -> list[str]:
    return [f"{cmd} {'/'.join(a.option_strings)}" for cmd, a in _walk(parser, name)
            if _says_nothing(a)]  # fmt: skip


def _all_parsers() -> list[tuple[argparse.ArgumentParser, str]]:
    return [
        (cli._parser(), "te-paged"),
        (_benchmark_parser("bench_stash"), "bench_stash.py"),
        (_benchmark_parser("bench_grouped_linear"), "bench_grouped_linear.py"),
    ]


def test_every_option_of_every_command_has_help() -> None:
    missing = [m for parser, name in _all_parsers() for m in _undocumented(parser, name)]
    assert not missing, missing
    # and the walk finds what it looks for: a bare option and an empty parenthesis are caught
    p = argparse.ArgumentParser(prog="x")
    sub = p.add_subparsers().add_parser("y")
    sub.add_argument("--bare")
    sub.add_argument("--only-default", default=1, help="(%(default)s)")
    sub.add_argument("--fine", help="a real sentence (%(default)s)")
    assert _undocumented(p, "x") == ["x y --bare", "x y --only-default"]


def test_one_name_per_knob_and_megatron_aliases() -> None:
    parser = cli._parser()
    spellings: dict[str, set[tuple[str, ...]]] = {}
    for cmd, action in _walk(parser, "te-paged"):
        if action.dest == "help":
            continue
        flag = action.option_strings[0]
        assert action.dest == flag[2:].replace("-", "_"), (cmd, action.option_strings)
        spellings.setdefault(action.dest, set()).add(tuple(action.option_strings))
    differing = {dest: s for dest, s in spellings.items() if len(s) > 1}
    assert not differing, differing  # a knob is spelled the same in ab, plan and bench
    for flag, aliases in cli.MEGATRON_ALIASES.items():
        assert spellings[flag[2:].replace("-", "_")] == {(flag, *aliases)}
    # the five names of one knob are one now: the CUDA pool factor, in every command
    for argv in (
        ["ab", "--moe-paged-stash-buffer-size-factor-cuda", "1.3"],
        ["bench", "--moe-paged-stash-buffer-size-factor-cuda", "1.3"],
        ["plan", "--model", "deepseek-v3", "--moe-paged-stash-buffer-size-factor-cuda", "1.3"],
        ["plan", "--model", "deepseek-v3", "--buffer-factor-cuda", "1.3"],
    ):
        assert parser.parse_args(argv).buffer_factor_cuda == 1.3, argv
    args = parser.parse_args(
        ["ab", "--moe-expert-rank-capacity-factor", "1.7", "--moe-paged-stash-page-size", "16",
         "--moe-paged-stash-buffer-size-factor-cpu", "0.5"]
    )  # fmt: skip
    cfg = ab_command.model_config(args)
    assert (cfg.capacity_factor, cfg.page_size, cfg.buffer_factor_cpu) == (1.7, 16, 0.5)
    assert cfg.buffer_factor_cuda == 1.10  # not given: the model's default
    # the pipeline layout by Megatron's names: Megatron-LM's flags, Megatron-core's fields
    model = ["plan", "--model", "deepseek-v3"]
    for argv in (
        ["--pipeline-parallel", "4", "--virtual-stages", "2", "--microbatches", "8",
         "--microbatch-group-size", "4"],
        ["--pipeline-model-parallel-size", "4", "--virtual-pipeline-model-parallel-size", "2",
         "--num-microbatches", "8", "--microbatch-group-size-per-virtual-pipeline-stage", "4"],
        ["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2",
         "--num-microbatches", "8", "--microbatch-group-size-per-virtual-pipeline-stage", "4"],
    ):  # fmt: skip
        args = parser.parse_args([*model, *argv])
        layout = (args.pipeline_parallel, args.virtual_stages, args.microbatches,
                  args.microbatch_group_size)  # fmt: skip
        assert layout == (4, 2, 8, 4), argv
    assert parser.parse_args(["ab", "--num-microbatches", "3"]).microbatches == 3


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"te_paged {__version__}\n"


@pytest.mark.parametrize(
    ("available", "count", "world", "torchrun", "expected"),
    [
        (False, 0, 1, False, "cpu"),
        (True, 4, 4, False, "cuda"),
        (True, 2, 4, False, "cpu"),  # not a GPU for every spawned rank
        (True, 1, 4, True, "cuda"),  # under torchrun the launcher places the ranks
    ],
)
def test_device_auto_takes_cuda_when_every_rank_has_a_gpu(
    monkeypatch, available, count, world, torchrun, expected
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert ab_command._resolve_device("auto", world, torchrun) == expected
    assert ab_command._resolve_device("cpu", world, torchrun) == "cpu"  # explicit: kept


def test_device_auto_is_the_default_and_resolved_by_the_checks(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = cli._parser()
    args = parser.parse_args(["ab"])
    assert args.device == "auto"
    assert ab_command.check_ab_args(args) is None and args.device == "cpu"
    args = parser.parse_args(["bench", "--out-dir", "/nonexistent-te-paged-bench"])
    assert args.device == "auto"
    bench_command.check_bench_args(args)
    assert args.device == "cpu"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fp8", "mxfp8"], "--fp8: not available with --engine torchtitan"),
        (["--tokens", "64"], "--tokens: not available with --engine torchtitan"),
        (["--ep", "3"], "--ep 3 does not divide the 4 ranks"),
        (["--experts", "6", "--ep", "4"], "6 experts do not split evenly over --ep 4"),
        (["--steps", "1"], "--steps 1"),
        (["--hidden", "30"], "not a multiple of the model's 4 heads"),
    ],
)
def test_ab_engine_torchtitan_refuses_what_it_cannot_run(monkeypatch, argv, message) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli._parser().parse_args(["ab", "--engine", "torchtitan", *argv])
    assert message in (ab_command.check_ab_args(args) or "")


def test_ab_engine_torchtitan_takes_the_wire_factor(monkeypatch) -> None:
    # te_paged's dispatcher inside torchtitan has the wire too (the trainer's te_paged section).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli._parser().parse_args(
        ["ab", "--engine", "torchtitan", "--a2a-capacity-factor", "1.5"]
    )
    assert ab_command.check_ab_args(args) is None
    assert ab_command.model_config(args).a2a_capacity_factor == 1.5
    args = cli._parser().parse_args(["ab", "--engine", "jax", "--a2a-capacity-factor", "1.5"])
    assert "--a2a-capacity-factor" in (ab_command.check_ab_args(args) or "")


@pytest.mark.parametrize("engine", ["default", "megatron", "jax"])
def test_activation_checkpoint_is_torchtitans_flag_only(monkeypatch, engine) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = cli._parser().parse_args(["ab", "--engine", engine, "--activation-checkpoint", "full"])
    assert "--activation-checkpoint" in (ab_command.check_ab_args(args) or "")


@pytest.mark.parametrize(
    ("engine", "framework", "imported"),
    [
        ("megatron", "megatron.core", ["megatron.core.models.gpt.gpt_model"]),
        ("torchtitan", "torchtitan", ["te_paged.integrations.torchtitan.trainer"]),
    ],
)
def test_cpu_ranks_fork_from_a_server_that_imported_the_framework(
    engine, framework, imported
) -> None:
    # ``ab`` forks its ranks from a forkserver; on the CPU it imports the engine's framework
    # there, once, instead of in every rank. The forkserver skips a preload module whose
    # import fails, silently: so each must import here, and bring the framework with it.
    pytest.importorskip(framework)
    cpu = ab_command.preload_modules(argparse.Namespace(engine=engine, device="cpu"))
    assert cpu[:3] == ("torch", "torch.distributed", ab_command.__name__)
    # torch's MemTracker, which measures a CPU rank's memory, then the framework
    tracker, preload = cpu[3:]
    assert tracker == "torch.distributed._tools.mem_tracker"
    for name in (tracker, preload):
        importlib.import_module(name)
    assert all(name in sys.modules for name in imported)
    # Never for CUDA ranks: an import that initialises CUDA would leave them unable to use it.
    cuda = ab_command.preload_modules(argparse.Namespace(engine=engine, device="cuda"))
    assert cuda == cpu[:3]
    default = ab_command.preload_modules(argparse.Namespace(engine="default", device="cpu"))
    assert default == (*cuda, tracker)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_line_per_step_in_a_pipe_and_a_bar_on_a_terminal() -> None:
    piped = io.StringIO()
    with Progress(4, "te-paged ab (2 ranks, cpu)", file=piped) as progress:
        for run in ("OFF", "ON "):
            for step in (1, 2):
                progress(f"{run} step {step}/2")
    lines = piped.getvalue().splitlines()
    assert "\r" not in piped.getvalue() and len(lines) == 5, lines
    assert lines[0].startswith("te-paged ab (2 ranks, cpu) 0/4 [")
    assert lines[1].startswith("te-paged ab (2 ranks, cpu) 1/4 [")
    assert lines[1].endswith(", OFF step 1/2]") and lines[4].endswith(", ON  step 2/2]")
    terminal = _Terminal()
    with Progress(4, "te-paged ab", file=terminal) as progress:
        for _ in range(4):
            progress("OFF step 1/2")
    drawn = terminal.getvalue()
    assert drawn.startswith("\r") and "4/4" in drawn and drawn.endswith("\n")


def test_min_profile_steps() -> None:
    assert min_profile_steps(0.01) == 100  # 1/0.01 is 100.0 exactly: not 101
    assert min_profile_steps(0.3) == 4
    assert min_profile_steps(0.5) == 2
    with pytest.raises(ValueError, match="target_rerun_rate"):
        min_profile_steps(0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--profile", "p.json", "--seq-length", "8"], "--seq-length: only with --model"),
        (
            ["--profile", "p.json", "--ep", "2", "--layers", "3"],
            "--ep, --layers: only with --model",
        ),
        (["--model", "deepseek-v3", "--hidden", "8"], "--hidden: only with --profile"),
        (
            ["--model", "deepseek-v3", "--target-rerun-rate", "0.1"],
            "--target-rerun-rate: only with --profile",
        ),
        (
            ["--profile", "p.json", "--pipeline-parallel", "2", "--microbatches", "4"],
            "--pipeline-parallel, --microbatches: only with --model",
        ),
        (["--profile", "p.json", "--page-size", "16"], "--page-size: only with --model"),
    ],
)
def test_plan_refuses_the_other_sources_flags(argv, message) -> None:
    args = cli._parser().parse_args(["plan", *argv])
    assert plan_command.check_plan_args(args) == message


def _plan_check(argv: list[str]) -> tuple[argparse.Namespace, str | None]:
    args = cli._parser().parse_args(["plan", "--model", "deepseek-v3", *argv])
    return args, plan_command.check_plan_args(args)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--virtual-stages", "2"], "--virtual-stages 2 needs --pipeline-parallel > 1"),
        (["--pipeline-parallel", "2", "--microbatch-group-size", "2"],
         "--microbatch-group-size: only with --virtual-stages"),
        (["--pipeline-parallel", "2", "--virtual-stages", "2", "--microbatches", "3"],
         "--microbatches 3: Megatron-core's interleaved schedule needs a multiple of the "
         "microbatch group size (2) or a remainder >= --pipeline-parallel (2), not 1"),
        (["--pipeline-parallel", "4", "--virtual-stages", "2", "--microbatches", "2",
          "--layers", "8"],
         "needs --pipeline-parallel (4) <= microbatch group size (4, by default the pipeline "
         "size) <= --microbatches"),
        (["--pipeline-parallel", "4"], "deepseek-v3 has 58 MoE layers, not divisible by "
         "--pipeline-parallel 4 x 1 model chunks = 4: give --layers"),
        (["--pipeline-parallel", "2", "--virtual-stages", "2", "--layers", "6"],
         "--layers 6 MoE layers, not divisible by --pipeline-parallel 2 x 2 model chunks = 4"),
    ],
)  # fmt: skip
def test_plan_refuses_what_megatron_refuses(argv, message) -> None:
    problem = _plan_check(argv)[1]
    assert problem is not None and message in problem, problem


def test_plan_microbatches_default_to_the_pipeline_size() -> None:
    args, problem = _plan_check(["--pipeline-parallel", "2", "--virtual-stages", "2",
                                 "--layers", "56"])  # fmt: skip
    assert problem is None and args.microbatches == 2
    args, problem = _plan_check([])
    assert problem is None and (args.pipeline_parallel, args.microbatches) == (1, 1)


def test_plan_and_the_library_refuse_the_same_layouts() -> None:
    from te_paged.runtime.schedules import PipelineConfig

    checked = 0
    for p, v, m, g, layers in itertools.product(
        (1, 2, 3, 4), (None, 1, 2, 3), range(1, 10), (None, 2, 3, 5), (12, 24, 30)
    ):
        argv = ["--pipeline-parallel", str(p), "--microbatches", str(m), "--layers", str(layers)]
        argv += [] if v is None else ["--virtual-stages", str(v)]
        argv += [] if g is None else ["--microbatch-group-size", str(g)]
        try:
            PipelineConfig(p, m, v, g).check_layers(layers)
            library = None
        except ValueError as e:
            library = str(e)
        assert (_plan_check(argv)[1] is None) == (library is None), (argv, library)
        checked += library is None
    assert checked > 100  # and many layouts pass both


def test_the_pipeline_example_of_choosing_factors_is_what_plan_prints(capsys) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "choosing-factors.md").read_text()
    section = doc.split("## A pipeline stage's pool")[1]
    command, printed = re.findall(r"```(?:bash)?\n(.*?)```", section, re.S)[:2]
    argv = command.split()
    assert argv[:2] == ["te-paged", "plan"] and "--pipeline-parallel" in argv
    assert cli.main(argv[1:]) == 0
    out = capsys.readouterr().out
    for line in printed.splitlines():
        assert line in out.splitlines(), line


def test_the_parsers_torch_free_choices_are_the_registries_built_ins() -> None:
    # Without torch the parser offers these (te-paged plan and ab --engine jax need no torch);
    # with it, the registries: the two must not drift apart.
    from te_paged.grouped.activations import ACTIVATIONS
    from te_paged.kernels import backend_choices

    # Built-ins first, in their registration order; a test may have registered more after them.
    gated = [name for name, spec in ACTIVATIONS.items() if spec.gated]
    assert gated[: len(cli.BUILTIN_GATED_ACTIVATIONS)] == list(cli.BUILTIN_GATED_ACTIVATIONS)
    assert cli.gated_activations() == gated
    assert set(cli.BUILTIN_BACKENDS) <= set(backend_choices()) == set(cli.kernel_backends())
    assert {"auto", "torch", "triton"} == set(cli.BUILTIN_BACKENDS)
