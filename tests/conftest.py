"""Shared fixtures: private paths for every test, and the tiny random-weight GGUF."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemonhelp import daemon_process
from tinymodel import write_tiny_gguf

SpawnDaemon = Callable[..., subprocess.Popen[bytes]]


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


@pytest.fixture
def anyio_backend() -> str:
    """The daemon runs on asyncio, as in production."""
    return "asyncio"


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


@pytest.fixture
def spawn_daemon(models_file: Path) -> Iterator[SpawnDaemon]:
    """Start ``everycycle daemon --models models_file ARGS`` processes (answering on their
    socket before this returns); each is stopped with SIGTERM after the test."""
    with contextlib.ExitStack() as stack:

        def spawn(*args: str, models: Path | None = None,
                  sock: Path | None = None) -> subprocess.Popen[bytes]:
            return stack.enter_context(
                daemon_process("--models", str(models or models_file), *args, sock=sock)
            )

        yield spawn


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
