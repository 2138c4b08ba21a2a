"""Patches applied to a module right after it runs, and imports that one module may make of a
library that cannot load — the machinery of the CPU shims for code that is imported later
(Megatron-Bridge, :mod:`.cpu_bridge_shims`). For CPU runs only; nothing else imports it.

A shim that replaces ``module.name`` after ``module`` was imported misses every module that
already bound ``name`` with ``from module import name``. Bridge binds megatron-core's and its
own names that way, so its shims are applied where the name is made: :class:`ImportHooks`
(one finder on ``sys.meta_path``) lets each hooked module run, then patches it before any
importer can bind a name of it.

Stand-ins for an absent library are given to named importers only: such a module runs with an
``__import__`` of its own (its globals' ``__builtins__``) that answers an import of the
library, where the real one fails, with an :class:`AbsentModule`. Nothing else sees it: every
other module's ``try: import transformer_engine`` still fails, and ``sys.modules`` never holds
the stand-in. Worked example: Bridge's ``peft/lora_layers.py`` runs
``import transformer_engine.pytorch as te`` and annotates a method ``-> te.ops.Sequential``;
with the stand-in ``te.ops.Sequential`` is a class no object is an instance of, and
``te.ops.Linear(...)`` raises ``ImportError`` naming Transformer Engine: the module imports,
and only a LoRA layer that needs TE fails, as it would on a GPU without TE.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["AbsentModule", "ImportHooks"]


class _AbsentMeta(type):
    """Classes standing in for an absent library's names: any attribute is another one, and
    calling one raises ``ImportError``."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{cls.__qualname__}.{name}", cls._library)

    def __call__(cls, *args: object, **kwargs: object) -> Any:
        raise ImportError(
            f"{cls.__qualname__}: {cls._library} is not installed (te_paged's CPU shims stand "
            f"in for it only so that the modules importing it load)"
        )


def _absent(qualname: str, library: str) -> type:
    namespace = {"__qualname__": qualname, "__module__": library, "_library": library}
    return _AbsentMeta(qualname.rsplit(".", 1)[-1], (), namespace)


class AbsentModule(types.ModuleType):
    """A module of a library that cannot load: every attribute is an absent name."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _absent(f"{self.__name__}.{name}", self.__name__.split(".")[0])


def _import_with_stand_ins(absent: Sequence[str]) -> Callable[..., Any]:
    real = builtins.__import__

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".")[0] in absent:
            try:
                return real(name, globals, locals, fromlist, level)
            except ImportError:  # the library is missing, or fails to import
                return AbsentModule(name if fromlist else name.split(".")[0])
        return real(name, globals, locals, fromlist, level)

    return __import__


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, hooks: ImportHooks, name: str) -> None:
        self._loader, self._hooks, self._name = loader, hooks, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        absent = self._hooks.stand_ins.get(self._name)
        if absent:
            namespace = dict(vars(builtins))
            namespace["__import__"] = _import_with_stand_ins(absent)
            module.__dict__["__builtins__"] = namespace
        self._loader.exec_module(module)
        for patch in self._hooks.patches.get(self._name, ()):
            patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._loader, name)


class ImportHooks(importlib.abc.MetaPathFinder):
    """Run ``patches[name]`` on module ``name`` right after it ran; give ``stand_ins[name]``
    (top-level library names) to its imports where they cannot load. First on
    ``sys.meta_path`` once :meth:`install` ran; finds nothing itself."""

    def __init__(self) -> None:
        self.patches: dict[str, list[Callable[[types.ModuleType], None]]] = {}
        self.stand_ins: dict[str, tuple[str, ...]] = {}

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.patches and fullname not in self.stand_ins:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, self, fullname)
        return spec
