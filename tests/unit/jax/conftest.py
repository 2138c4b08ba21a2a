"""XLA programs compiled once per test session: several tests build the same step functions
(the ``ab`` engine's model, forced skew and not; the runner's ON and OFF steps), and each
compilation takes seconds of the suite's CPU. The persistent cache lives in the session's
temporary folder, so every run starts from an empty one."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session", autouse=True)
def xla_compilation_cache(tmp_path_factory):
    if importlib.util.find_spec("jax") is None:
        yield None
        return
    import jax

    folder = tmp_path_factory.mktemp("xla_compilation_cache")
    saved = {
        name: getattr(jax.config, name)
        for name in (
            "jax_compilation_cache_dir",
            "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes",
        )
    }
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    yield folder
    for name, value in saved.items():
        jax.config.update(name, value)
