"""No two modules of a package import each other, even by way of others: every import
counts (at the top, inside functions, under ``TYPE_CHECKING``), since a circle made of
"only for typing" and "only at call time" edges is still a circle a reader must hold
in their head (the engine's twelve-module circle was made of exactly those)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import everycycle

ROOT = Path(everycycle.__file__).parent
PACKAGES = sorted({p.parent for p in ROOT.rglob("*.py")})


def imports(path: Path, package: Path) -> set[str]:
    """The modules of ``package`` that ``path`` (one of them) imports, anywhere in it."""
    own = {p.stem for p in package.glob("*.py")} | {p.name for p in package.iterdir()
                                                     if (p / "__init__.py").exists()}
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [
                a.name for a in node.names]
            found |= {n for n in names if n in own}
    return found - {path.stem, "__init__"}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_no_import_circle_in_a_package(package: Path) -> None:
    graph = {p.stem: imports(p, package) for p in package.glob("*.py")}
    assert circles(graph) == []


def test_the_check_sees_a_circle_made_of_typing_and_call_time_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from .b import g\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                   "if TYPE_CHECKING:\n    from .a import f\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    graph = {p.stem: imports(p, tmp_path) for p in tmp_path.glob("*.py")}
    assert circles(graph) == [["a", "b"]]
