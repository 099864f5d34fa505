"""Helpers to run the real daemon (in-process or as a process) and talk raw protocol."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from everycycle import paths
from everycycle.client import ClientConnection, SyncClient
from everycycle.daemon.server import Daemon, DaemonConfig
from everycycle.errors import DaemonUnavailableError
from everycycle.protocol import Accepted, Error, ServerEvent, Tokens, is_terminal
from everycycle.sockets import wake_reader

TIMEOUT = 30
EC = [sys.executable, "-m", "everycycle"]


class accepted:
    """Equal to an ``Accepted`` with this request id and queue position, whatever its
    extensions say (``eta_ms``, and ``prompt_tokens``: set when the model was loaded at
    admission, which depends on what ran before)."""

    def __init__(self, request_id: str, queue_position: int) -> None:
        self.request_id, self.queue_position = request_id, queue_position

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Accepted) and (other.request_id, other.queue_position) == (
            self.request_id, self.queue_position)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"accepted({self.request_id!r}, {self.queue_position})"


def readme_block(heading: str, lang: str, page: str = "README.md") -> str:
    """The first ```LANG block of the section ``heading`` of ``page`` (README.md, or a
    docs/ page): the docs' commands run as written."""
    readme = (Path(__file__).resolve().parent.parent / page).read_text()
    section = readme[readme.index(heading):]
    start = section.index(f"```{lang}\n") + len(f"```{lang}\n")
    return section[start:section.index("```", start)]


def wait_until(check: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def answers(sock: Path | None = None) -> bool:
    try:
        with SyncClient(sock):
            return True
    except DaemonUnavailableError:
        return False


@contextlib.contextmanager
def daemon_process(*args: str, sock: Path | None = None, env: dict[str, str] | None = None,
                   stderr: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """``everycycle daemon ARGS`` as a process, answering on its socket; SIGINT at exit
    (stop now, as Ctrl-C: SIGTERM would drain, letting a test's leftover requests run).
    With ``stderr``, what it (and its engine processes) write there goes to that file."""
    cmd = [*EC, "daemon", *args] + (["--socket", str(sock)] if sock else [])
    err = stderr.open("ab") if stderr is not None else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
    if stderr is not None:
        err.close()  # type: ignore[union-attr]
    try:
        def up() -> bool:
            assert proc.poll() is None, f"the daemon exited with {proc.returncode}"
            return answers(sock)

        wait_until(up, "the daemon to answer")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(20)


@contextlib.asynccontextmanager
async def running_daemon(models_file: Path, **kw: object) -> AsyncIterator[Daemon]:
    """A real daemon on a real Unix socket; stopped by cancelling on exit."""
    config = DaemonConfig(socket=paths.socket_path(), models_file=models_file, **kw)  # type: ignore[arg-type]
    daemon = Daemon(config)
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        try:
            yield daemon
        finally:
            daemon.stop()  # a graceful stop, as SIGTERM does


class Raw:
    """A raw socket connection: send any bytes, read events routed by ClientConnection."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.conn = ClientConnection()
        self.buffer: list[ServerEvent] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, sock: Path | None = None) -> AsyncIterator[Raw]:
        stream = await anyio.connect_unix(sock or paths.socket_path())
        async with stream:
            try:
                yield cls(stream)
            finally:
                wake_reader(stream)

    async def send(self, line: bytes) -> None:
        await self.stream.send(line if line.endswith(b"\n") else line + b"\n")

    async def _receive(self) -> bool:
        """Read once into the buffer; False at end of stream."""
        try:
            data = await self.stream.receive(65536)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            data = b""
        self.buffer.extend(r.event for r in self.conn.receive_data(data))
        return bool(data)

    async def next(self) -> ServerEvent:
        with anyio.fail_after(TIMEOUT):
            while not self.buffer:
                assert await self._receive(), "the daemon closed the connection"
        return self.buffer.pop(0)

    async def next_for(self, rid: str) -> ServerEvent:
        """The next event of ``rid`` (others stay buffered in order)."""
        others: list[ServerEvent] = []
        with anyio.fail_after(TIMEOUT):
            while True:
                ev = await self.next()
                if getattr(ev, "request_id", None) == rid:
                    break
                others.append(ev)
        self.buffer[:0] = others
        return ev

    async def until_terminal(self, rid: str) -> list[ServerEvent]:
        """Events for ``rid`` up to its terminal one (others stay buffered in order)."""
        got: list[ServerEvent] = []
        others: list[ServerEvent] = []
        with anyio.fail_after(TIMEOUT):
            while True:
                ev = await self.next()
                if getattr(ev, "request_id", None) == rid:
                    got.append(ev)
                    if is_terminal(ev):
                        break
                else:
                    others.append(ev)
        self.buffer[:0] = others
        return got

    async def closed(self) -> bool:
        with anyio.fail_after(TIMEOUT):
            while await self._receive():
                pass
        return True


def greedy_ids(c: SyncClient, model: str, n: int = 24, prompt: str = "hello world") -> list[int]:
    """The ids of a greedy generation, asserting it ends without an Error."""
    ids: list[int] = []
    for event in c.generate(model, prompt, max_tokens=n, temperature=0.0):
        assert not isinstance(event, Error), event
        if isinstance(event, Tokens):
            ids.extend(event.chunk.ids)
    return ids


def cancel_mid_stream(c: SyncClient, model: str, request_id: str,
                      after: int = 3) -> ServerEvent | None:
    """Start a long sampled generation, cancel it after ``after`` chunks; the last event."""
    got = 0
    last = None
    for event in c.generate(model, "go", max_tokens=4000, temperature=1.0,
                            request_id=request_id):
        if isinstance(event, Tokens):
            got += 1
            if got == after:
                c.cancel(request_id)
        last = event
    return last


def require_executor(name: str, required_by: str, missing: str, skip: str) -> Any:
    """The executor ``name`` from discovery. Without it: fail when the environment
    variable ``required_by`` is 1 (the job that must run these tests), else skip."""
    import os

    import pytest

    from everycycle.hardware import executors as ex

    found = {e.name: e for e in ex.discover()}
    if name not in found:
        if os.environ.get(required_by) == "1":
            pytest.fail(f"{missing} (executors: {sorted(found)})")
        pytest.skip(skip)
    return found[name]
