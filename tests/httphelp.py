"""Helpers for the HTTP dialects' tests: the daemon's URL, raw requests, the audit log, a
request that holds the only slot, a client that goes away mid-stream, a daemon to fuzz."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
from daemonhelp import EC, daemon_process, wait_until

from everycycle import paths
from everycycle.client import SyncClient


def fleet_http(sock: Path | None = None) -> str:
    """The HTTP base URL the daemon (on ``sock``) reports."""
    with SyncClient(sock) as c:
        url = c.describe_fleet().http
    assert url is not None
    return url


def hostport(url: str) -> tuple[str, int]:
    host, _, port = url.split("://", 1)[-1].rpartition(":")
    return host, int(port)


def audit() -> list[dict[str, object]]:
    """The audit log's request records, oldest first (not its load, eviction or auth
    events)."""
    if not paths.audit_file().exists():
        return []
    return [r for r in map(json.loads, paths.audit_file().read_text().splitlines())
            if "request_id" in r]


def raw(url: str, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request on its own connection: status, lower-cased headers, body."""
    conn = http.client.HTTPConnection(*hostport(url), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def blocker(models_file: Path) -> subprocess.Popen[bytes]:
    """A long request holding the only slot of model `tiny` (streaming when returned).
    Its end token is banned: sampled, the random model would end within ~270 tokens."""
    proc = subprocess.Popen([*EC, "run", "--models", str(models_file), "-n", "8000",
                             "--temperature", "1", "-o", 'logit_bias={"2": -100}', "x"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    proc.stdout.read(1)
    return proc


def idle() -> bool:
    with SyncClient() as c:
        return c.describe_fleet().active_requests == 0


def drop_mid_stream(url: str, path: str, body: dict[str, Any],
                    content_type: str | None = "application/json") -> None:
    """POST a long streamed ``body`` to ``path``, close the connection once the answer has
    begun, and check what a client going away must cost: its slot is free within 2 s and
    the request's audit record says Cancelled."""
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(data)}\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    sock = socket.create_connection(hostport(url))
    sock.sendall(head.encode() + b"\r\n" + data)
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    wait_until(idle, "the slot to be freed")  # (a request that went on: a hang here)
    wait_until(lambda: bool(audit()) and audit()[-1]["outcome"] == "Cancelled",
               "the audit record of the cancelled request")


@contextlib.contextmanager
def fuzzed_daemon(home: Path, tiny_gguf: Path) -> Iterator[str]:
    """A daemon of its own (state in ``home``, two slots of the tiny model) for a module of
    fuzzing; its HTTP URL. At the end it must still be alive, with nothing left running."""
    sock = Path(tempfile.mkdtemp(prefix="fz", dir="/tmp")) / "d.sock"
    models = home / "models.toml"
    models.write_text(f'default = "tiny"\n[models.tiny]\npath = "{tiny_gguf}"\ncontext = 256\n'
                      "parallel = 2\n")
    env = {**os.environ, "EVERYCYCLE_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    with daemon_process("--models", str(models), "--http", "127.0.0.1:0", sock=sock,
                        env=env) as proc:
        yield fleet_http(sock)
        assert proc.poll() is None, "the daemon died during fuzzing"
        with SyncClient(sock) as c:
            wait_until(lambda: c.describe_fleet().active_requests == 0, "idle", timeout=10)


class EventReader:
    """Reads ``GET /v1/events`` (SSE) on a thread: its events, as they come."""

    def __init__(self, url: str) -> None:
        self.events: list[dict[str, Any]] = []
        self.comments = 0
        self.closed = False
        self._client = httpx.Client(timeout=None)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    def _read(self, url: str) -> None:
        try:
            self._lines(url)
        except httpx.TransportError:
            if not self.closed:
                raise

    def _lines(self, url: str) -> None:
        with self._client.stream("GET", url) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            kind = None
            for line in r.iter_lines():
                if line.startswith(":"):
                    self.comments += 1
                    self._ready.set()
                elif line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    assert data["type"] == kind
                    self.events.append(data)

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events
                if e["type"] == kind and all(e.get(k) == v for k, v in match.items())]

    def close(self) -> None:
        self.closed = True
        self._client.close()
        self._thread.join(10)


# ---------------------------------------------------------------- one client per dialect


def openai_client(url: str, key: str = "unused", **kw: Any) -> openai.OpenAI:
    """The real ``openai`` client on a daemon's base URL, as a user configures it."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0,
                         **{"timeout": 60, **kw})


def anthropic_client(url: str, key: str = "unused", **kw: Any) -> anthropic.Anthropic:
    """The real ``anthropic`` client (it appends /v1 itself)."""
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0,
                               **{"timeout": 60, **kw})


def ollama_client(url: str, **kw: Any) -> ollama.Client:
    """The real ``ollama`` client (``host`` is the server's root)."""
    return ollama.Client(host=url, **{"timeout": 60, **kw})
