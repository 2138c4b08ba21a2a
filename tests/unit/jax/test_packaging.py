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
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_jax_extra_is_pinned_to_what_the_tests_run_on() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    pins = {req.split("==")[0]: req.split("==")[1] for req in extras["jax"]}
    assert set(pins) == {"jax", "jaxlib"}
    assert pins["jax"] == pins["jaxlib"], "jax and jaxlib are released together"
    assert set(extras["jax"]) <= {r.split("#")[0].strip() for r in extras["test"]}
    pytest.importorskip("jax")
    for name, version in pins.items():
        assert metadata.version(name) == version, f"{name} installed differs from the pin"


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
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert "te-paged ab: error: --engine jax needs JAX: pip install 'te_paged[jax]'" in out.stderr


def test_te_paged_jax_imports_and_runs_without_torch() -> None:
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
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_with_torch_installed_te_paged_jax_still_does_not_import_it() -> None:
    pytest.importorskip("jax")
    code = "import sys, te_paged.jax, te_paged.jax.moe; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
