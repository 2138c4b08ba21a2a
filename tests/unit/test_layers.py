"""te_paged's import graph: no cycle, and no import against the layer order of docs/design.md
("Layers"). Every import counts, at module level or inside a function."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "te_paged"
DESIGN = ROOT / "docs" / "design.md"


def _layers() -> dict[str, int]:
    """Package → rank, read from the design doc's "Layers" order line."""
    text = DESIGN.read_text()
    section = text[text.index("## Layers") :]
    line = next(ln for ln in section.split("\n\n") if "→" in ln)
    ranks = {}
    for rank, group in enumerate(line.split("→")):
        for name in re.findall(r"`(\w+)`", group):
            ranks[name] = rank
    return ranks


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every te_paged module ``path`` imports (resolving ``from pkg import submodule``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("te_paged")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                pkg = module.split(".")[
                    : len(module.split(".")) - node.level + (path.name == "__init__.py")
                ]
                base = ".".join([*pkg, base] if base else pkg)
            if not base.startswith("te_paged"):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if _exists(sub) else base)
    return found


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        graph[module] = {m for m in _imports(path, module) if m != module}
    return graph


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: te_paged itself


def test_no_import_against_the_layer_order() -> None:
    ranks = _layers()
    graph = _graph()
    packages = {_package(m) for m in graph} - {None, "__main__"}
    assert packages <= set(ranks), f"packages missing from docs/design.md: {packages - set(ranks)}"
    against = []
    for module, targets in graph.items():
        src = _package(module)
        if src in (None, "__main__"):
            continue  # the package root and `python -m te_paged` sit above everything
        for target in targets:
            dst = _package(target)
            if dst is None:
                against.append(f"{module} imports the package root {target}")
            elif dst != src and ranks[dst] > ranks[src]:
                against.append(f"{module} ({src}) imports {target} ({dst})")
    assert not against, "imports against the layer order:\n" + "\n".join(sorted(against))


def test_no_import_cycle() -> None:
    graph = _graph()
    # Tarjan's strongly connected components; any component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_walk_sees_imports_inside_functions() -> None:
    # The check above could not fail if function-level imports were skipped: one exists.
    graph = _graph()
    assert "te_paged.tools.megatron_ab" in graph["te_paged.tools.ab_command"]


def test_no_package_imports_another_packages_private_names() -> None:
    private = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("te_"):
                continue
            if _package(node.module) == _package(module):
                continue
            private += [f"{module}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and a.name != "__version__"]  # fmt: skip
    assert not private, "private names imported across packages:\n" + "\n".join(sorted(private))
