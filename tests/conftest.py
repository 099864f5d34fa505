"""Shared fixtures: private paths for every test, and the tiny random-weight GGUF."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemonhelp import daemon_process
from httphelp import blocker, fleet_http
from modelshelp import Entry, models_toml
from nativeguard import DeathWatch, obey_the_verdict, watching
from tinymodel import write_tiny_gguf

from everycycle import paths
from everycycle.hardware import cpukernels

SpawnDaemon = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture(scope="session")
def cpu_verdict() -> bytes:
    """This machine's CPU-kernel verdict, probed for real once per session (a child
    process decodes through the CPU's extra buffer types, as the daemon's first load
    does) and given to every test's private state dir: what a user's daemon finds in
    its cache after the first start, without a probe per test."""
    with tempfile.TemporaryDirectory(prefix="ecprobe", dir="/tmp") as d:
        old = os.environ.get("EVERYCYCLE_HOME")
        os.environ["EVERYCYCLE_HOME"] = d
        try:
            verdict = cpukernels.decide(paths.state_dir())
            assert verdict.source in ("probe", "override"), verdict
            found = paths.state_dir() / cpukernels.CACHE_NAME
            return found.read_bytes() if found.exists() else b""
        finally:
            if old is None:
                del os.environ["EVERYCYCLE_HOME"]
            else:
                os.environ["EVERYCYCLE_HOME"] = old


@pytest.fixture(autouse=True)
def _private_paths(monkeypatch: pytest.MonkeyPatch, cpu_verdict: bytes) -> Iterator[Path]:
    """Point every everycycle location at a short temp dir (AF_UNIX paths are short)."""
    with tempfile.TemporaryDirectory(prefix="ec", dir="/tmp") as d:
        home = Path(d)
        monkeypatch.setenv("EVERYCYCLE_HOME", str(home))
        monkeypatch.delenv("EVERYCYCLE_SOCKET", raising=False)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setenv("HF_HOME", str(home / "hf"))
        if cpu_verdict:
            state = paths.state_dir()
            state.mkdir(mode=0o700, parents=True, exist_ok=True)
            (state / cpukernels.CACHE_NAME).write_bytes(cpu_verdict)
        yield home


@pytest.fixture
def anyio_backend() -> str:
    """The daemon runs on asyncio, as in production."""
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF with random weights and a byte-level vocabulary."""
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_batches_exact(tiny_gguf: Path) -> bool:
    """The engine's own load-time verdict (``batch_probe``) on the tiny GGUF: whether a
    multi-row batch gives bit-identical logits to rows decoded one at a time on this
    CPU. llama.cpp does not promise it, so a test that compares a batched or cached
    computation with another for equality relies on this verdict and says so."""
    from enginehelp import Collector

    from everycycle.engine.worker.runner import Runner

    runner = Runner(tiny_gguf, context=256, parallel=1, notify=Collector())
    try:
        return runner.lookup_exact
    finally:
        runner.close()


@pytest.fixture
def models_file(tmp_path: Path, tiny_gguf: Path) -> Path:
    """A models.toml with the tiny model as default: one slot, and a four-slot copy."""
    return models_toml(tmp_path / "models.toml",
                       Entry("tiny", tiny_gguf, context=8192, parallel=1),
                       Entry("tiny4", tiny_gguf, context=512, parallel=4),
                       Entry("missing", "nowhere.gguf"), default="tiny")


@pytest.fixture
def spawn_daemon(models_file: Path) -> Iterator[SpawnDaemon]:
    """Start ``everycycle daemon --models models_file ARGS`` processes (answering on their
    socket before this returns); each is stopped with SIGINT after the test."""
    with contextlib.ExitStack() as stack:

        def spawn(*args: str, models: Path | None = None,
                  sock: Path | None = None) -> subprocess.Popen[bytes]:
            return stack.enter_context(
                daemon_process("--models", str(models or models_file), *args, sock=sock)
            )

        yield spawn


@pytest.fixture
def url(spawn_daemon: SpawnDaemon) -> str:
    """A daemon with HTTP on a free port; its base URL."""
    spawn_daemon("--http", "127.0.0.1:0")
    return fleet_http()


@pytest.fixture
def busy(models_file: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A long request holding the only slot of model `tiny` for the test."""
    proc = blocker(models_file)
    yield proc
    proc.kill()
    proc.communicate()


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # llama.cpp loads in this process take the CPU-kernel verdict, as engines do; a
    # test that kills the process anyway is named last (nativeguard.py).
    obey_the_verdict()
    if watching():
        watch = DeathWatch()
        config.pluginmanager.register(watch, "everycycle-deathwatch")
        config.add_cleanup(watch.close)
    # Tests press Ctrl-C (SIGINT) on the CLI as a terminal would. A shell that started
    # the suite in the background (`cmd &`) left SIGINT ignored, and children inherit
    # that: give them the terminal's default instead.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
