"""No two modules of a package import each other, even by way of others: every import
counts (at the top, inside functions, under ``TYPE_CHECKING``), since a circle made of
"only for typing" and "only at call time" edges is still a circle a reader must hold
in their head (the engine's twelve-module circle was made of exactly those)."""

from __future__ import annotations

import ast
import subprocess
import sys
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


ENGINE = ROOT / "engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute_imports(path: Path) -> set[str]:
    """Every everycycle module ``path`` imports, anywhere in it, by absolute name (``from
    ..kvcache import kvdisk`` names the module ``kvdisk``, not its package)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if (ROOT.parent / (sub.replace(".", "/") + ".py")).exists()
                          else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m == "everycycle" or m.startswith(("everycycle.", "llama_cpp"))}


def test_no_import_circle_across_the_engines_parts() -> None:
    """Counting imports between the engine's subpackages too: a module of ``worker/``
    and one of ``spec/`` may not import each other by way of any others."""
    modules = {module_name(p): p for p in ENGINE.rglob("*.py") if p.name != "__init__.py"}
    graph = {m: {t for t in absolute_imports(p) if t in modules} for m, p in modules.items()}
    assert circles(graph) == []


def test_the_engines_core_imports_no_other_part_and_no_llama_cpp() -> None:
    """``engine/core`` (jobs, slots, the scheduler and its plan, step costs) imports no
    other part of the engine, and nothing it reaches imports llama.cpp, even inside a
    function; and it imports with llama_cpp unavailable."""
    everything = {module_name(p): p for p in ROOT.rglob("*.py")}
    core = [m for m in everything if m.startswith("everycycle.engine.core.")]
    seen, todo = set(core), list(core)
    while todo:
        for target in absolute_imports(everything[todo.pop()]):
            assert not target.startswith("llama_cpp"), f"{target} reached from the core"
            if target in everything and target not in seen:
                seen.add(target)
                todo.append(target)
    others = sorted(m for m in seen if m.startswith("everycycle.engine.")
                    and not m.startswith("everycycle.engine.core"))
    assert others == [], others
    code = ("import importlib, sys; sys.modules['llama_cpp'] = None; "
            f"[importlib.import_module(m) for m in {sorted(core)!r}]; "
            "assert not any(m.startswith('everycycle.engine.') and '.core' not in m "
            "for m in sys.modules), sorted(sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr


def test_only_the_list_of_methods_knows_their_names() -> None:
    """A speculative method's name (``forced``, ``lookup``, ``mtp``, ``model``) is
    written once, where ``spec/methods.py`` lists the methods: nothing else in the
    engine branches on one."""
    listing = ENGINE / "spec" / "methods.py"
    names = {node.args[0].value for node in ast.walk(ast.parse(listing.read_text()))
             if isinstance(node, ast.Call) and node.args
             and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)}
    assert names == {"forced", "lookup", "mtp", "model"}
    uses = [f"{p.relative_to(ROOT)}:{n.lineno} {n.value!r}" for p in ENGINE.rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, ast.Constant) and n.value in names and p != listing]
    assert uses == [], uses
