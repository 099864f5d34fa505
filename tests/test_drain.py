"""Taking a daemon out of service without losing a request: ``everycycle drain`` and
SIGTERM stop admitting (HTTP 503 with Retry-After, socket Rejected), let running and
queued work finish, then stop; ``/health`` answers 503 while draining and while the only
model loads, as llama-server's does; ``/livez`` is liveness alone."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, Raw, accepted, daemon_process, wait_until
from httphelp import fleet_http, openai_client, raw

from everycycle import paths
from everycycle.client import SyncClient
from everycycle.daemon.server import Daemon, DaemonConfig
from everycycle.errors import ErrorKind
from everycycle.protocol import Error, Generate, Shutdown, Tokens, encode

LONG = 3000
"""Tokens of a request that runs through a drain (the tiny model's end token banned)."""
NO_EOS = {"2": -100}


def _stream(url: str, out: dict[str, Any], first: threading.Event) -> None:
    """A streamed chat completion of LONG tokens; its text, finish reason and usage."""
    client = openai_client(url, timeout=120)
    text: list[str] = []
    for chunk in client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=LONG,
            temperature=1.0, logit_bias=NO_EOS, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            if text[-1]:
                first.set()
            if chunk.choices[0].finish_reason:
                out["finish"] = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            out["tokens"] = chunk.usage.completion_tokens
    out["text"] = "".join(text)


def _health(url: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    status, headers, body = raw(url, "GET", "/health")
    return status, headers, json.loads(body)


def test_drain_finishes_running_and_queued_work_refuses_new_and_stops(
    spawn_daemon: SpawnDaemon,
) -> None:
    proc = spawn_daemon("--http", "127.0.0.1:0")
    url = fleet_http()
    assert _health(url) == (200, _health(url)[1], {"status": "ok"})
    results: list[dict[str, Any]] = [{}, {}]
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(url, results[i], started[i]))
               for i in range(2)]
    threads[0].start()
    assert started[0].wait(60)
    threads[1].start()  # (one slot: it waits in the queue)
    with SyncClient() as c:
        wait_until(lambda: c.describe_fleet().active_requests == 2, "the queued request")
    drain = subprocess.Popen([*EC, "drain", "--grace", "120"], stderr=subprocess.PIPE,
                             stdout=subprocess.PIPE)

    def draining() -> bool:
        return _health(url)[0] == 503

    wait_until(draining, "/health to say 503")
    status, headers, body = _health(url)
    assert body["status"] == "draining" and body["error"]["type"] == "unavailable_error"
    assert 1 <= int(headers["retry-after"]) <= 5
    assert raw(url, "GET", "/livez")[0] == 200
    # New work is refused in every dialect's shape, retryable; lookups still answer.
    status, headers, answer = raw(url, "POST", "/v1/chat/completions", json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        {"content-type": "application/json"})
    assert status == 503 and "retry-after" in headers, answer
    assert "draining" in json.loads(answer)["error"]["message"]
    status, _, answer = raw(url, "POST", "/api/generate", json.dumps(
        {"model": "tiny", "prompt": "hi"}).encode())
    assert status == 503 and "draining" in json.loads(answer)["error"]
    assert raw(url, "POST", "/tokenize", json.dumps({"content": "hi"}).encode())[0] == 200
    with SyncClient() as c:
        assert c.describe_fleet().state == "draining"
    fleet = subprocess.run([*EC, "fleet"], check=False, capture_output=True, text=True, timeout=60)
    assert "draining" in fleet.stdout + fleet.stderr

    async def refused() -> Error:
        async with Raw.open() as c:
            await c.send(encode(Generate("late", "tiny", "hi", max_tokens=2)))
            event = await c.next()
            assert isinstance(event, Error)
            return event

    late = anyio.run(refused)
    assert late.kind is ErrorKind.REJECTED and "draining" in late.message
    # What ran and what waited both finish whole; then the daemon stops by itself.
    for t in threads:
        t.join(120)
    for result in results:
        assert result["finish"] == "length" and result["tokens"] == LONG, result.keys()
    out, err = drain.communicate(timeout=120)
    assert drain.returncode == 0, err
    assert b"draining" in err and b"drained and stopped" in err and out == b""
    assert proc.wait(30) == 0


def test_a_drain_notice_admits_work_while_health_says_503_then_refuses(
    spawn_daemon: SpawnDaemon,
) -> None:
    """``--drain-notice``: for that long a draining daemon still admits new requests
    while /health answers 503 (a router's checks take it out of rotation meanwhile),
    then refuses them, and stops once they are done."""
    proc = spawn_daemon("--http", "127.0.0.1:0", "--drain-notice", "20")
    url = fleet_http()
    body = json.dumps({"model": "tiny", "max_tokens": 4,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = {"content-type": "application/json"}
    assert raw(url, "POST", "/v1/chat/completions", body, headers)[0] == 200
    started = time.monotonic()
    drain = subprocess.Popen([*EC, "drain", "--grace", "60"], stderr=subprocess.DEVNULL)
    wait_until(lambda: _health(url)[0] == 503, "/health to say 503")
    status, _, answer = raw(url, "POST", "/v1/chat/completions", body, headers)
    assert status == 200, answer  # (admitted: within the notice)
    wait_until(lambda: raw(url, "POST", "/v1/chat/completions", body, headers)[0] == 503,
               "the notice to end")
    assert time.monotonic() - started >= 20  # (refused only once the notice is over)
    assert drain.wait(60) == 0 and proc.wait(30) == 0


def test_sigterm_drains_then_stops(models_file: Path) -> None:
    with daemon_process("--models", str(models_file)) as proc:
        async def go() -> tuple[list[object], Error]:
            async with Raw.open() as c:
                await c.send(encode(Generate("run", "tiny", "x", max_tokens=LONG,
                                             temperature=1.0, seed=3)))
                assert await c.next() == accepted("run", 0)
                proc.send_signal(signal.SIGTERM)
                with SyncClient() as probe:
                    await anyio.to_thread.run_sync(wait_until, lambda: (
                        probe.describe_fleet().state == "draining"), "draining")
                async with Raw.open() as late:
                    await late.send(encode(Generate("late", "tiny", "x", max_tokens=2)))
                    refused = await late.next()
                assert isinstance(refused, Error)
                return await c.until_terminal("run"), refused

        events, refused = anyio.run(go)
        assert refused.kind is ErrorKind.REJECTED
        end = events[-1]
        assert isinstance(end, Tokens) and end.finished, end
        assert sum(len(e.chunk.ids) for e in events if isinstance(e, Tokens)) > 1
        assert proc.wait(30) == 0


def test_a_drain_past_its_grace_cancels_what_is_left(
    daemon_proc_busy: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]],
) -> None:
    daemon, blocker = daemon_proc_busy
    drain = subprocess.run([*EC, "drain", "--grace", "0.5"], check=False, capture_output=True,
                           timeout=60)
    assert drain.returncode == 0, drain.stderr
    assert daemon.wait(30) == 0
    _, err = blocker.communicate(timeout=30)
    assert b"daemon shutting down" in err


@pytest.fixture
def daemon_proc_busy(spawn_daemon: SpawnDaemon, models_file: Path
                     ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]:
    daemon = spawn_daemon()
    blocker = subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "8000",
                                "--temperature", "1", "-o", 'logit_bias={"2": -100}', "x"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert blocker.stdout is not None and blocker.stdout.read(1)
    return daemon, blocker


def test_only_the_daemons_own_user_or_token_may_stop_it(spawn_daemon: SpawnDaemon) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_daemon("--tcp", f"127.0.0.1:{port}")
    add = subprocess.run([*EC, "keys", "add", "alice"], check=False, capture_output=True,
                         text=True, timeout=60)
    assert add.returncode == 0, add.stderr
    key = add.stdout.strip().splitlines()[-1]
    alice = subprocess.run([*EC, "drain", "--host", f"127.0.0.1:{port}", "--token", key],
                           check=False, capture_output=True, text=True, timeout=60)
    assert alice.returncode != 0 and "only the daemon's own user" in alice.stderr
    with SyncClient() as c:
        assert c.describe_fleet().state == "ready"


@pytest.mark.anyio
async def test_health_says_503_while_the_only_model_loads(models_file: Path) -> None:
    gate = threading.Event()
    config = DaemonConfig(socket=paths.socket_path(), models_file=models_file,
                          http=("127.0.0.1", 0), load=("tiny",))
    daemon = Daemon(config)
    residency = daemon.supervisor.residency
    real = residency.spawn

    def slow(spec: Any, path: Path, options: Any) -> Any:
        gate.wait(60)  # the load takes as long as the test says
        return real(spec, path, options)

    residency.spawn = slow  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.run)
        url = f"http://127.0.0.1:{daemon.http_port}"

        def get(path: str) -> httpx.Response:
            return httpx.get(url + path, timeout=30)

        try:
            loading = await anyio.to_thread.run_sync(get, "/health")
            assert daemon.supervisor.snapshot().state == "loading"
            alive = await anyio.to_thread.run_sync(get, "/livez")
        finally:
            gate.set()
        assert loading.status_code == 503, loading.text
        assert loading.json()["error"] == {"code": 503, "message": "Loading model",
                                           "type": "unavailable_error"}
        assert alive.status_code == 200
        await anyio.to_thread.run_sync(wait_until, lambda: get("/health").status_code == 200,
                                       "the model to load")
        assert [m.name for m in daemon.supervisor.snapshot().loaded_models] == ["tiny"]
        assert daemon.supervisor.snapshot().state == "ready"
        daemon.stop()


def test_a_shutdown_line_without_drain_is_the_seeds() -> None:
    assert encode(Shutdown("s1")) == b'{"Shutdown":{"request_id":"s1"}}\n'
    assert encode(Shutdown("s1", 500)) == b'{"Shutdown":{"request_id":"s1","drain_ms":500}}\n'


def test_http_connections_send_without_nagle() -> None:
    """Every connection the HTTP listener accepts has Nagle off (TCP_NODELAY, inherited
    from the listening socket): with it on, a keep-alive request's body waited for the
    client's delayed ACK of its head, 40 ms a request."""
    from everycycle.daemon.httpserver import bind

    listener = bind("127.0.0.1", 0)
    try:
        with socket.create_connection(listener.getsockname()) as client:
            listener.setblocking(True)
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            del client
    finally:
        listener.close()


def test_fleet_over_several_daemons_shows_each_ones_state(
    spawn_daemon: SpawnDaemon, tmp_path: Path,
) -> None:
    """``fleet --host …``: a table of each daemon's state — ready, draining (a drain
    in its notice), unreachable — before their sections; exit 69 for the one down."""
    draining, ready = tmp_path / "a.sock", tmp_path / "b.sock"
    spawn_daemon("--drain-notice", "60", sock=draining)
    spawn_daemon(sock=ready)
    drain = subprocess.Popen([*EC, "drain", "--socket", str(draining)],
                             stderr=subprocess.DEVNULL)
    try:
        with SyncClient(draining) as c:
            wait_until(lambda: c.describe_fleet().state == "draining", "the drain")
        shown = subprocess.run([*EC, "fleet", "--host", str(draining), "--host", str(ready),
                                "--host", str(tmp_path / "gone.sock")], capture_output=True,
                               text=True, timeout=60, check=False, env={
                                   **os.environ, "COLUMNS": "200"})
    finally:
        drain.kill()
        drain.wait()
    assert shown.returncode == 69, shown.stderr
    table = shown.stderr.split(f" ({socket.gethostname()}, ")[0]  # (before the sections)
    rows = {line.split("│")[1].strip(): line.split("│")[3].strip()
            for line in table.splitlines() if line.startswith("│")}
    assert rows == {str(draining): "draining", str(ready): "ready",
                    str(tmp_path / "gone.sock"): "unreachable"}, shown.stderr


def test_load_at_start_of_a_model_the_registry_lacks_is_one_sentence(
        models_file: Path, tmp_path: Path) -> None:
    out = subprocess.run([*EC, "daemon", "--models", str(models_file), "--load", "nosuch",
                          "--socket", str(tmp_path / "s.sock")], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode != 0 and out.stderr.count("\n") == 1, out.stderr
    assert "--load nosuch: the registry has no model 'nosuch'" in out.stderr
