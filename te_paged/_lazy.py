"""Package attributes imported on first use (PEP 562), so that importing a package imports
none of its torch modules: ``import te_paged.jax`` runs ``te_paged/__init__.py`` first, and a
JAX user may not have PyTorch installed at all (docs/jax.md)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, modules: Mapping[str, list[str]], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of ``package``, whose public names
    ``modules`` lists under the module that defines them. A name is imported at its first
    access and kept in ``namespace`` (the package's globals). Without torch, a torch name
    raises an ImportError that says which extra to install."""
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            raise ImportError(
                f"{package}.{name} is part of te_paged's PyTorch API, which needs torch: "
                "install it (`pip install te_paged[torch]`; pin the torch build you want "
                "first). te_paged.jax needs no torch."
            ) from e
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__, sorted(exports)


def torch_installed() -> bool:
    """Whether torch can be imported here (found, not imported)."""
    return importlib.util.find_spec("torch") is not None


def require_torch(package: str) -> None:
    """At the import of ``package`` (a part of te_paged's PyTorch API): where torch is not
    installed, an ImportError that says which extra to install, instead of a bare
    ``No module named 'torch'`` from deep inside it."""
    if not torch_installed():
        raise ModuleNotFoundError(
            f"{package} is part of te_paged's PyTorch API, which needs torch: install it "
            "(`pip install te_paged[torch]`; pin the torch build you want first). "
            "te_paged.jax needs no torch.",
            name="torch",
        )
