"""One engine process per model: a native fault ends that model's running requests with
one Internal error naming the cause; the daemon, its other models and the queue live on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from daemonhelp import Raw, daemon_process, wait_until
from modelshelp import Entry, models_toml

from everycycle import paths
from everycycle.client import SyncClient
from everycycle.errors import ErrorKind
from everycycle.protocol import (
    Accepted,
    Error,
    Generate,
    LoadedModel,
    Tokens,
    encode,
    is_terminal,
)


@pytest.fixture
def two_models(tmp_path: Path, tiny_gguf: Path) -> Path:
    return models_toml(tmp_path / "two.toml",
                       *(Entry(name, tiny_gguf, context=4096, parallel=4) for name in "ab"),
                       default="a")


@pytest.fixture
def daemon(two_models: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    log = tmp_path / "daemon.stderr"
    with daemon_process("--models", str(two_models), "--http", "127.0.0.1:0",
                        stderr=log) as proc:
        yield proc, log


def loaded(name: str) -> LoadedModel | None:
    with SyncClient() as c:
        snap = c.describe_fleet()
    return next((m for m in snap.loaded_models if m.name == name), None)


def engine_pid(name: str) -> int:
    m = loaded(name)
    assert m is not None and m.engine_pid is not None, m
    return m.engine_pid


def serving_again(name: str, old_pid: int) -> bool:
    m = loaded(name)
    return (m is not None and m.state is None and m.engine_pid is not None
            and m.engine_pid != old_pid)


def restarted_or_failed(name: str, old_pid: int) -> bool:
    m = loaded(name)
    return m is not None and (m.state == "failed" or serving_again(name, old_pid))


def generate(model: str, rid: str, n: int) -> Generate:
    return Generate(rid, model, f"hello {rid}", max_tokens=n, temperature=0.0)


async def streams(requests: list[Generate], kill: tuple[int, int] | None = None,
                  running: int | None = None) -> dict[str, list[object]]:
    """Run ``requests`` on one connection; with ``kill`` = (pid, signal), send it once
    every request of the first model (or the first ``running`` requests) has had
    tokens. Every event, by request id."""
    events: dict[str, list[object]] = {r.request_id: [] for r in requests}
    victims = {r.request_id for r in requests[:running] if r.model == requests[0].model}
    async with Raw.open() as c:
        for r in requests:
            await c.send(encode(r))
        ended: set[str] = set()
        killed = kill is None
        with anyio.fail_after(60):
            while len(ended) < len(requests):
                ev = await c.next()
                rid = getattr(ev, "request_id", "")
                assert rid not in ended, f"an event after the terminal one: {ev}"
                events[rid].append(ev)
                if is_terminal(ev):
                    ended.add(rid)
                if not killed and all(any(isinstance(e, Tokens) for e in events[v])
                                      for v in victims):
                    assert kill is not None
                    os.kill(*kill)
                    killed = True
    return events


def text(events: list[object]) -> str:
    return "".join(e.chunk.text for e in events if isinstance(e, Tokens))


def process_stats(pid: int) -> tuple[int, int, int]:
    """(open fds, threads, RSS bytes) of a process."""
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Threads:")))
    rss = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS:"))) * 1024
    return fds, threads, rss


@pytest.mark.parametrize("sig", [signal.SIGILL, signal.SIGSEGV, signal.SIGABRT, signal.SIGKILL],
                         ids=lambda s: s.name)
def test_a_dead_engine_costs_only_its_running_requests(
    daemon: tuple[subprocess.Popen[bytes], Path], sig: signal.Signals
) -> None:
    proc, log = daemon
    others = [generate("b", f"b{i}", 400) for i in range(4)]
    # What model b says when nothing goes wrong (greedy: the same every time).
    expected = {rid: text(evs) for rid, evs in anyio.run(streams, others).items()}
    assert all(expected.values())

    victims = [generate("a", f"a{i}", 4000) for i in range(4)]
    with SyncClient() as c:
        c.load("a")
    pid = engine_pid("a")
    events = anyio.run(streams, victims + others, (pid, sig))

    name = sig.name
    for r in victims:
        evs = events[r.request_id]
        assert isinstance(evs[0], Accepted)
        last = evs[-1]
        assert isinstance(last, Error) and last.kind is ErrorKind.INTERNAL, last
        assert last.message.startswith(f"engine for a died: {name} ("), last.message
        assert sum(is_terminal(e) for e in evs) == 1
    for r in others:
        evs = events[r.request_id]
        assert isinstance(evs[-1], Tokens) and evs[-1].finished, evs[-1]
        assert text(evs) == expected[r.request_id]

    # The next request to the crashed model succeeds, on a new engine process.
    wait_until(lambda: serving_again("a", pid), "model a's engine to restart")
    again = anyio.run(streams, [generate("a", "after", 20)])["after"]
    assert isinstance(again[-1], Tokens) and again[-1].finished
    m = loaded("a")
    assert m is not None and m.engine_restarts == 1 and m.engine_exit is not None
    assert m.engine_exit.startswith(name)
    assert m.engine_rss and m.engine_rss > 0

    with SyncClient() as c:
        http = c.describe_fleet().http
    assert http is not None
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert f'everycycle_engine_deaths_total{{cause="{name}",model="a"}} 1.0' in metrics
    assert proc.poll() is None
    assert "Traceback" not in log.read_text()


def test_queued_requests_wait_for_the_restarted_engine(
    daemon: tuple[subprocess.Popen[bytes], Path],
) -> None:
    # Four slots busy and two more queued: the kill ends the four; the two run after.
    requests = [generate("a", f"q{i}", 4000 if i < 4 else 16) for i in range(6)]
    with SyncClient() as c:
        c.load("a")
    events = anyio.run(streams, requests, (engine_pid("a"), signal.SIGKILL), 4)
    for r in requests[:4]:
        last = events[r.request_id][-1]
        assert isinstance(last, Error) and "SIGKILL" in last.message
    for r in requests[4:]:
        evs = events[r.request_id]
        assert isinstance(evs[-1], Tokens) and evs[-1].finished, evs
        assert [e.queue_position for e in evs if isinstance(e, Accepted)][-1] == 0
        assert isinstance(evs[-1], Tokens) and evs[-1].finished, evs[-1]


def test_a_crash_loop_marks_the_model_failed_until_load(
    daemon: tuple[subprocess.Popen[bytes], Path],
) -> None:
    proc, log = daemon
    with SyncClient() as c:
        c.load("a")
    for _ in range(3):
        pid = engine_pid("a")
        os.kill(pid, signal.SIGSEGV)
        wait_until(lambda p=pid: restarted_or_failed("a", p), "a restart or failure")
    m = loaded("a")
    assert m is not None and m.state == "failed" and m.engine_pid is None
    assert m.engine_exit is not None and m.engine_exit.startswith("SIGSEGV")
    with SyncClient() as c:
        events = list(c.generate("a", "hello", max_tokens=4, temperature=0.0))
        assert isinstance(events[-1], Error) and events[-1].kind is ErrorKind.INTERNAL
        assert "failed" in events[-1].message and "SIGSEGV" in events[-1].message
        assert "everycycle load a" in events[-1].message
        # model b never noticed
        assert isinstance(list(c.generate("b", "hello", max_tokens=4))[-1], Tokens)
        c.load("a")
        events = list(c.generate("a", "hello", max_tokens=4, temperature=0.0))
        assert isinstance(events[-1], Tokens) and events[-1].finished
    m = loaded("a")
    assert m is not None and m.state is None and m.engine_pid is not None
    assert "Traceback" not in log.read_text()
    assert proc.poll() is None


def test_fifty_crashes_leave_no_fds_threads_or_memory_behind(
    daemon: tuple[subprocess.Popen[bytes], Path],
) -> None:
    proc, log = daemon

    def cycle() -> None:
        pid = engine_pid("a")
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: restarted_or_failed("a", pid), "a restart or failure")
        m = loaded("a")
        if m is not None and m.state == "failed":
            with SyncClient() as c:
                c.load("a")
        with SyncClient() as c:
            assert isinstance(list(c.generate("a", "hi", max_tokens=2))[-1], Tokens)

    with SyncClient() as c:
        c.load("a")
    for _ in range(5):  # warm up: worker threads, allocator arenas
        cycle()
    time.sleep(0.5)
    fds0, threads0, rss0 = process_stats(proc.pid)
    for _ in range(50):
        cycle()
    time.sleep(0.5)
    fds, threads, rss = process_stats(proc.pid)
    assert fds <= fds0, (fds0, fds)
    assert threads <= threads0 + 2, (threads0, threads)
    assert rss < rss0 + 16 * 2**20, (rss0, rss)
    assert proc.poll() is None
    assert "Traceback" not in log.read_text()


def test_the_supervisor_module_does_not_import_llama_cpp() -> None:
    code = ("import sys, everycycle.daemon.supervisor, everycycle.engine.host.process; "
            "print('llama_cpp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_unload_ends_the_engine_process(daemon: tuple[subprocess.Popen[bytes], Path]) -> None:
    with SyncClient() as c:
        c.load("b")
        pid = engine_pid("b")
        c.unload("b")
    wait_until(lambda: not Path(f"/proc/{pid}").exists()
               or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], "the engine to end")
    assert paths.socket_path().exists()
