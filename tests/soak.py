"""A soak: hostile clients mixed into normal ones against one running daemon.

Four normal clients stream greedy generations over and over and check every answer
against the first; meanwhile slow readers, never-readers, endless HTTP headers,
mid-stream disconnects and dead-end grammars come and go, each bounded in count and
time, all on loopback. Used by tests/test_soak.py (short) and bench/soak.py (long).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from everycycle.client import SyncClient
from everycycle.protocol import Generate, Tokens, encode

NORMAL_MODEL = "tiny4"
PROMPTS = [f"hello world {i}" for i in range(4)]


@dataclass
class SoakResult:
    seconds: float
    normal_answers: int = 0
    normal_mismatches: int = 0
    hostile: dict[str, int] = field(default_factory=dict)
    rss_start: int = 0
    rss_peak: int = 0
    rss_end: int = 0
    errors: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        mib = 2**20
        start, peak, end = self.rss_start / mib, self.rss_peak / mib, self.rss_end / mib
        answers = (f"soak: {self.seconds:.0f} s, {self.normal_answers} normal answers, "
                   f"{self.normal_mismatches} differing from the first")
        hostile = ", ".join(f"{k} {v}" for k, v in sorted(self.hostile.items()))
        memory = (f"daemon RSS: start {start:.0f} MiB, peak {peak:.0f} MiB "
                  f"(+{peak - start:.0f}), end {end:.0f} MiB (+{end - start:.0f})")
        return [answers, f"hostile clients: {hostile}", memory]


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines()
                    if ln.startswith("VmRSS:"))) * 1024


def greedy_text(sock: Path, prompt: str, n: int = 48) -> str:
    with SyncClient(sock) as c:
        events = list(c.generate(NORMAL_MODEL, prompt, max_tokens=n, temperature=0.0))
    assert isinstance(events[-1], Tokens), events[-1]
    return "".join(e.chunk.text for e in events if isinstance(e, Tokens))


def _unix(sock: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock))
    return s


def _slow_reader(sock: Path, http: tuple[str, int]) -> None:
    with _unix(sock) as s:
        s.sendall(encode(Generate("slow", NORMAL_MODEL, "go", max_tokens=400,
                                  temperature=1.0)))
        for _ in range(20):
            s.recv(16)
            time.sleep(0.05)


def _never_reader(sock: Path, http: tuple[str, int]) -> None:
    with _unix(sock) as s:
        s.setblocking(False)
        s.sendall(encode(Generate("never", NORMAL_MODEL, "go", max_tokens=4000,
                                  temperature=1.0)))
        line = b'{"DescribeFleet":{"request_id":"f"}}\n' * 500
        end = time.monotonic() + 2
        while time.monotonic() < end:
            with contextlib.suppress(BlockingIOError):
                s.send(line)
            time.sleep(0.01)


def _endless_header(sock: Path, http: tuple[str, int]) -> None:
    with socket.create_connection(http, timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Long: ")
        with contextlib.suppress(OSError):
            for _ in range(64):
                s.sendall(b"a" * 65536)


def _mid_stream_disconnect(sock: Path, http: tuple[str, int]) -> None:
    with _unix(sock) as s:
        s.sendall(encode(Generate("gone", NORMAL_MODEL, "go", max_tokens=2000,
                                  temperature=1.0)))
        s.recv(4096)


def _dead_end_grammar(sock: Path, http: tuple[str, int]) -> None:
    with SyncClient(sock) as c:
        list(c.generate(NORMAL_MODEL, "go", max_tokens=16, temperature=0.8,
                        grammar="root ::= x\nx ::= root"))


def _http_dead_end(sock: Path, http: tuple[str, int]) -> None:
    body = json.dumps({"model": NORMAL_MODEL, "prompt": "x", "max_tokens": 8,
                       "temperature": 0.9, "response_format": {
                           "type": "json_schema",
                           "json_schema": {"schema": {"type": "string",
                                                      "pattern": "^[\\u0000]+$"}}}})
    with socket.create_connection(http, timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                  b"application/json\r\nConnection: close\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body.encode())
        while s.recv(65536):
            pass


HOSTILE: dict[str, Callable[[Path, tuple[str, int]], None]] = {
    "slow readers": _slow_reader,
    "never-readers": _never_reader,
    "endless headers": _endless_header,
    "mid-stream disconnects": _mid_stream_disconnect,
    "dead-end grammars": _dead_end_grammar,
    "dead-end schemas over HTTP": _http_dead_end,
}


def soak(sock: Path, http: tuple[str, int], pid: int, seconds: float) -> SoakResult:
    """Run the soak against the daemon ``pid`` serving ``sock`` and ``http``."""
    expected = {p: greedy_text(sock, p) for p in PROMPTS}
    result = SoakResult(seconds, rss_start=rss(pid))
    result.rss_peak = result.rss_start
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def normal(prompt: str) -> None:
        while time.monotonic() < stop:
            try:
                got = greedy_text(sock, prompt)
            except Exception as exc:  # noqa: BLE001 - reported in the result
                with lock:
                    result.errors.append(f"normal: {type(exc).__name__}: {exc}")
                return
            with lock:
                result.normal_answers += 1
                result.normal_mismatches += got != expected[prompt]

    def hostile(name: str, attack: Callable[[Path, tuple[str, int]], None]) -> None:
        while time.monotonic() < stop:
            with contextlib.suppress(OSError, TimeoutError):
                attack(sock, http)
            with lock:
                result.hostile[name] = result.hostile.get(name, 0) + 1

    threads = [threading.Thread(target=normal, args=(p,)) for p in PROMPTS]
    threads += [threading.Thread(target=hostile, args=item) for item in HOSTILE.items()]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        result.rss_peak = max(result.rss_peak, rss(pid))
        time.sleep(0.2)
    time.sleep(1.0)  # let the last hostile connections' state go
    result.rss_end = rss(pid)
    return result
