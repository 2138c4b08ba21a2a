"""XLA programs compiled once: several tests build the same step functions (the ``ab``
engine's model, forced skew and not; the runner's ON and OFF steps), and each compilation takes
seconds of the suite's CPU. JAX's persistent cache lives in the session's temporary folder, so
a run starts from an empty one, unless ``TE_PAGED_TEST_XLA_CACHE`` names a folder: the test
scripts name one outside the repository, as inductor's cache is, so the torch lanes find what
the main command compiled (65 s of these tests' CPU became 23 s). JAX keys each program by its
HLO, the compile options, and the jax, jaxlib and backend versions; with a size cap it locks
its entries against the other processes that share the folder."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def xla_compilation_cache(tmp_path_factory):
    if importlib.util.find_spec("jax") is None:
        yield None
        return
    import jax

    shared = os.environ.get("TE_PAGED_TEST_XLA_CACHE")
    folder = Path(shared) if shared else tmp_path_factory.mktemp("xla_compilation_cache")
    settings = {
        "jax_compilation_cache_dir": str(folder),
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    if shared:  # a cap turns on JAX's file lock (the filelock package) and bounds the folder
        settings["jax_compilation_cache_max_size"] = 1 << 30
    saved = {name: getattr(jax.config, name) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
    yield folder
    for name, value in saved.items():
        jax.config.update(name, value)
