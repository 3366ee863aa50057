"""Imports only point down the floors, and no modules import each other in a circle.

Floors, bottom to top (README, "Architecture"): ``data.errors`` (the ground floor: UserError, cli, atomic writes,
instantiate) → ``models`` (target, layers, heads, formats) → ``data`` (conversations, chat template, features,
datamodule) → ``train`` → ``eval``. A module may import its own floor or a lower one. Every import statement
counts, also those inside functions (a lazy import still ties two modules together).
"""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGES = ("data", "models", "train", "eval")
FLOORS = ["data.errors", "models", "data", "train", "eval"]  # bottom to top; the most specific prefix wins


def modules() -> dict[str, Path]:
    """Every module of the four packages: dotted name → file."""
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` counts as pkg.mod when that is a module)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import models.heads.eagle3.X` → the module that exists
                t = t.rpartition(".")[0]
            if t and t.split(".")[0] in PACKAGES and t != name:
                found.add(t)
    return found


def floor(name: str) -> int:
    best = max((f for f in FLOORS if name == f or name.startswith(f + ".")), key=len)
    return FLOORS.index(best)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_imports_point_down():
    up = [f"{a} ({FLOORS[floor(a)]}) imports {b} ({FLOORS[floor(b)]})"
          for a, deps in graph().items() for b in sorted(deps) if floor(b) > floor(a)]
    assert not up, "imports of a higher floor:\n" + "\n".join(up)


def test_no_import_cycles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_floors_cover_every_module():
    assert all(floor(m) >= 0 for m in modules())
    assert floor("data.errors") == 0 and floor("data.features") == 2 and floor("models.formats.speculators") == 1
