"""The jax extra: pinned in pyproject (and in the test extra, so CI runs the JAX tests), never
imported by ``import te_paged``; and ``te_paged.jax`` without PyTorch."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[3]


def test_import_te_paged_does_not_import_jax() -> None:
    code = textwrap.dedent(
        """
        import sys
        import te_paged, te_paged.tools.ab, te_paged.cli, te_paged.runtime.planner
        te_paged.cli._parser()  # ab --help: the jax engine's defaults, without JAX
        leaked = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
        assert not leaked, leaked
        print("ok")
        """
    )
    out = _python(code)
    assert out.stdout.strip() == "ok"


def test_the_jax_extra_spans_the_releases_the_tests_run_on() -> None:
    """The extra's range holds both environments' pins: the test extra's (Python 3.11, beside
    torch) and scripts/jax-constraints.txt's (Python 3.12, without torch); this one's
    installed release is the test extra's pin."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    ranges = {r.name: r.specifier for r in map(Requirement, extras["jax"])}
    assert set(ranges) == {"jax", "jaxlib"} and ranges["jax"] == ranges["jaxlib"]
    test_pins = {r.name: str(r.specifier) for r in map(Requirement, extras["test"])}
    lines = (ROOT / "scripts" / "jax-constraints.txt").read_text().splitlines()
    torch_free = {r.name: str(r.specifier) for r in map(Requirement, _requirements(lines))}
    for pins in (test_pins, torch_free):
        assert pins["jax"] == pins["jaxlib"], "jax and jaxlib are released together"
        assert ranges["jax"].contains(pins["jax"].removeprefix("=="))
    assert "torch" not in torch_free and "torch" not in ranges
    assert not [r for r in project["dependencies"] if Requirement(r).name == "torch"]
    pytest.importorskip("jax")
    for name in ("jax", "jaxlib"):
        assert "==" + metadata.version(name) == test_pins[name], f"{name} differs from the pin"


def _python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, which must exit 0."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return out


def _requirements(lines: list[str]) -> list[str]:
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip()]


def test_without_jax_the_port_and_the_engine_say_how_to_install_it() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["jax"] = None  # any import of jax now fails
        try:
            import te_paged.jax
        except ImportError as e:
            assert "pip install 'te_paged[jax]'" in str(e), e
        else:
            raise AssertionError("te_paged.jax imported without JAX")
        import importlib.util
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "jax" else real(name, *a)
        from te_paged import cli
        assert cli.main(["ab", "--engine", "jax"]) == 2
        print("ok")
        """
    )
    out = _python(code)
    assert out.stdout.strip() == "ok"
    assert "te-paged ab: error: --engine jax needs JAX: pip install 'te_paged[jax]'" in out.stderr


@pytest.mark.torch_free
@pytest.mark.torch_blocked
def test_te_paged_jax_imports_and_runs_without_torch() -> None:
    """Blocks torch where it is installed; the environment without torch runs this as well."""
    pytest.importorskip("jax")
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import jax.numpy as jnp
        import te_paged, te_paged.jax, te_paged.jax.moe
        from te_paged.jax import make_pool, pop, stash
        pool, rec = stash(make_pool(4, 2, 3), jnp.arange(12.0).reshape(4, 3), 3)
        pool, out = pop(pool, rec, 4)
        assert out.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [0, 0, 0]], out
        # the MoE stack, its runner, the planner that sizes its pool and the capacity model
        from te_paged.jax.moe import PagedStepRunner, RingMoEConfig, init_params, make_batch
        from te_paged.runtime.pool_plan import capacity_model_saving
        cfg = RingMoEConfig(layers=2, hidden=8, ffn=8, tokens=16, page_size=4)
        runner = PagedStepRunner(cfg)
        _, record = runner.step(init_params(cfg), make_batch(cfg, 0))
        assert record.attempt == 1 and record.enabled, record
        assert capacity_model_saving(4.0, 1.1, 10.0) > 0
        assert te_paged.__version__
        try:
            te_paged.MoEConfig
        except ImportError as e:
            assert "te_paged[torch]" in str(e) and "te_paged.jax needs no torch" in str(e), e
        else:
            raise AssertionError("te_paged.MoEConfig without torch")
        print("ok")
        """
    )
    out = _python(code)
    assert out.stdout.strip() == "ok"


def test_with_torch_installed_te_paged_jax_still_does_not_import_it() -> None:
    pytest.importorskip("jax")
    code = "import sys, te_paged.jax, te_paged.jax.moe; print('torch' in sys.modules)"
    out = _python(code)
    assert out.stdout.strip() == "False"


@pytest.mark.torch_free
@pytest.mark.torch_blocked
def test_the_cli_without_torch_plans_runs_the_jax_engine_and_names_the_extra(tmp_path) -> None:
    """``te-paged plan`` and ``te-paged ab --engine jax`` need no torch (blocked where it is
    installed); a torch-only command, or a torch-only package, says which extra in one line.
    Before: every command died in the parser with ``No module named 'torch'``."""
    pytest.importorskip("jax")
    record = tmp_path / "ab.json"
    code = textwrap.dedent(
        f"""
        import importlib.metadata, importlib.util, json, sys
        try:
            installed = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            installed = None
        sys.modules["torch"] = None  # any import of torch now fails
        real = importlib.util.find_spec
        importlib.util.find_spec = lambda name, *a: None if name == "torch" else real(name, *a)
        from te_paged import cli
        plan = ["plan", "--model", "deepseek-v3", "--ring-of-experts", "--pipeline-parallel", "2"]
        assert cli.main(plan) == 0
        ab = ["ab", "--engine", "jax", "--steps", "2", "--layers", "2", "--hidden", "16",
              "--ffn", "16", "--tokens", "32", "--page-size", "8", "--json", {str(record)!r}]
        assert cli.main(ab) == 0
        assert json.load(open({str(record)!r}))["torch_version"] == installed
        assert cli.main(["bench"]) == 2 and cli.main(["ab", "--engine", "megatron"]) == 2
        for name in ("te_paged.grouped", "te_paged.moe", "te_paged.integrations.megatron"):
            try:
                __import__(name)
            except ImportError as e:
                assert "pip install te_paged[torch]" in str(e), e
            else:
                raise AssertionError(name + " imported without torch")
        print("ok")
        """
    )
    out = _python(code)
    assert out.stdout.strip().endswith("ok") and "bitwise equal" in out.stdout, out.stdout[-2000:]
    needs = [line for line in out.stderr.splitlines() if "needs PyTorch" in line]
    assert needs == [
        "te-paged bench: error: te-paged bench needs PyTorch, which is not installed here: pip "
        "install 'te_paged[torch]' (te-paged plan and te-paged ab --engine jax run without it)",
        "te-paged ab: error: te-paged ab --engine megatron needs PyTorch, which is not installed "
        "here: pip install 'te_paged[torch]' (te-paged plan and te-paged ab --engine jax run "
        "without it)",
    ], out.stderr
