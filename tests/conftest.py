"""Shared fixtures: private paths for every test, and the tiny random-weight GGUF."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tinymodel import write_tiny_gguf


@pytest.fixture(autouse=True)
def _private_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point every everycycle location at a short temp dir (AF_UNIX paths are short)."""
    with tempfile.TemporaryDirectory(prefix="ec", dir="/tmp") as d:
        home = Path(d)
        monkeypatch.setenv("EVERYCYCLE_HOME", str(home))
        monkeypatch.delenv("EVERYCYCLE_SOCKET", raising=False)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HOME", str(home / "hf"))
        yield home


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF with random weights and a byte-level vocabulary."""
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture
def models_file(tmp_path: Path, tiny_gguf: Path) -> Path:
    """A models.toml with the tiny model as default: one slot, and a four-slot copy."""
    f = tmp_path / "models.toml"
    f.write_text(
        'default = "tiny"\n'
        "[models.tiny]\n"
        f'path = "{tiny_gguf}"\n'
        "context = 8192\nparallel = 1\n"
        "[models.tiny4]\n"
        f'path = "{tiny_gguf}"\n'
        "context = 512\nparallel = 4\n"
        "[models.missing]\n"
        'path = "nowhere.gguf"\n'
    )
    return f


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
