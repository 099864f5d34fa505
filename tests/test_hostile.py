"""Hostile and careless input, from outside, against the real daemon and CLI: nothing
kills or bloats the daemon, no limit fails open, every bad input gets a 4xx or Invalid."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, daemon_process
from httphelp import fleet_http, hostport

from everycycle import paths
from everycycle.client import SyncClient
from everycycle.daemon.keys import KeyLimits, KeyStore
from everycycle.errors import ErrorKind
from everycycle.protocol import Error, Generate, Tokens, encode


def http_address() -> tuple[str, int]:
    return hostport(fleet_http())


def post(path: str, body: object, headers: dict[str, bytes] | None = None
         ) -> tuple[int, dict[str, object]]:
    conn = http.client.HTTPConnection(*http_address(), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"content-type": b"application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def daemon_alive(proc: subprocess.Popen[bytes]) -> None:
    assert proc.poll() is None, f"the daemon died: {proc.returncode}"
    with SyncClient() as c:
        assert c.describe_fleet().hostname


# ---------------------------------------------------------------------- the key file


def test_a_broken_key_file_under_a_live_daemon_keeps_the_last_good_limits(
        models_file: Path, tmp_path: Path) -> None:
    store = KeyStore()
    store.set_limits("local", KeyLimits(requests_per_minute=2))
    log = tmp_path / "daemon.log"
    with daemon_process("--models", str(models_file), stderr=log) as proc:
        with SyncClient() as c:
            assert isinstance(list(c.generate("tiny", "a", max_tokens=1))[-1], Tokens)
        good = json.loads(store.path.read_text())
        for broken in ({**good, "keys": {"local": {**good["keys"]["local"], "created": "abc"}}},
                       "not json at all", "[" * 100_000 + "]" * 100_000):
            store.path.write_text(broken if isinstance(broken, str) else json.dumps(broken))
            os.utime(store.path, ns=(time.time_ns(), time.time_ns()))
            daemon_alive(proc)  # a new connection reads the file: no crash
        # The limit of 2 requests a minute still holds: the second passes, the third not.
        with SyncClient() as c:
            assert isinstance(list(c.generate("tiny", "b", max_tokens=1))[-1], Tokens)
            last = list(c.generate("tiny", "c", max_tokens=1))[-1]
            assert isinstance(last, Error) and last.kind is ErrorKind.REJECTED, last
        daemon_alive(proc)
    text = log.read_text()
    assert "Traceback" not in text
    lines = [ln for ln in text.splitlines() if str(store.path) in ln]
    assert 1 <= len(lines) <= 3 and all("keeping the 1 keys and limits" in ln for ln in lines)


@pytest.mark.parametrize("content", [
    '{"keys": {"alice": {"sha256": "' + "0" * 64 + '", "created": "abc"}}}',
    '{"keys": {"alice": {"sha256": 5}}}',
    '{"keys": {"local": {"limits": {"requests_per_minute": NaN}}}}',
    '{"keys": {"local": {"limits": {"concurrent": [1]}}}}',
    '{"keys": {"bad name\\n": {"sha256": "' + "0" * 64 + '"}}}',
    "[" * 100_000 + "]" * 100_000,
], ids=["created", "sha256", "nan", "list", "name", "deep"])
def test_a_broken_key_file_at_start_up_is_one_line_and_exit_2(
        models_file: Path, content: str) -> None:
    path = KeyStore().path
    paths.ensure_private_dir(path.parent)
    path.write_text(content)
    os.chmod(path, 0o600)
    for cmd in (["keys", "list"], ["daemon", "--models", str(models_file)]):
        out = subprocess.run([*EC, *cmd], capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 2, (cmd, out.stderr)
        assert "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert str(path) in out.stderr


def test_keys_add_that_cannot_write_is_one_line_and_changes_nothing() -> None:
    KeyStore().add("alice", KeyLimits())
    before = KeyStore().path.read_bytes()

    def small_files() -> None:  # what a full disk does to a write: it fails midway
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    out = subprocess.run([*EC, "keys", "add", "bob"], capture_output=True, text=True,
                         timeout=60, check=False, preexec_fn=small_files)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "cannot write key file" in out.stderr and "nothing was changed" in out.stderr
    assert out.stdout == ""  # no secret shown for a key that was not made
    assert KeyStore().path.read_bytes() == before


# ---------------------------------------------------------------------- HTTP 4xx


@pytest.mark.parametrize("role", [[], {}, 3, None, "robot"])
def test_a_bad_role_is_a_400_in_openai_shape(spawn_daemon: SpawnDaemon, role: object) -> None:
    proc = spawn_daemon("--http", "127.0.0.1:0")
    status, body = post("/v1/chat/completions",
                        {"model": "tiny", "messages": [{"role": role, "content": "x"}]})
    assert status == 400, body
    error = body["error"]
    assert isinstance(error, dict) and "messages[0].role" in error["message"]
    daemon_alive(proc)


@pytest.mark.parametrize("value", ["²", "١٢", "-5", "1e3", "9" * 40, ""])
def test_a_bad_deadline_header_is_a_400(spawn_daemon: SpawnDaemon, value: str) -> None:
    proc = spawn_daemon("--http", "127.0.0.1:0")
    status, body = post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
                        {"x-deadline-ms": value.encode()})
    assert status == 400, body
    assert "x-deadline-ms" in body["error"]["message"]  # type: ignore[index]
    daemon_alive(proc)


# ---------------------------------------------------------------------- dead-end grammars

DEAD_END = "root ::= x\nx ::= root"
"""Rules that never reach a character: no text matches (the constraint engine sees it
when it compiles the grammar for the vocabulary)."""


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_a_grammar_with_no_way_forward_is_invalid_and_the_engine_lives(
        spawn_daemon: SpawnDaemon, temperature: float) -> None:
    proc = spawn_daemon()
    with SyncClient() as c:
        c.load("tiny4")
        pid = next(m.engine_pid for m in c.describe_fleet().loaded_models)
        for seed in range(3):
            events = list(c.generate("tiny4", "hello", max_tokens=16,
                                     temperature=temperature, seed=seed, grammar=DEAD_END))
            assert len(events) == 1  # refused before anything was queued
            assert isinstance(events[0], Error) and events[0].kind is ErrorKind.INVALID
            assert "matches no text at all" in events[0].message
        schema = json.dumps({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"})
        last = list(c.generate("tiny4", "hello", max_tokens=16, temperature=temperature,
                               json_schema=schema))[-1]
        assert isinstance(last, Error) and last.kind is ErrorKind.INVALID, last
        m = c.describe_fleet().loaded_models[0]
        assert m.engine_pid == pid and m.engine_restarts is None  # never died
        ok = list(c.generate("tiny4", "hello", max_tokens=4, temperature=temperature,
                             grammar='root ::= "yes" | "no"'))
        assert isinstance(ok[-1], Tokens) and "".join(
            e.chunk.text for e in ok if isinstance(e, Tokens)) in ("yes", "no")
    daemon_alive(proc)


def test_a_dead_end_grammar_in_process_exits_2(models_file: Path, tmp_path: Path) -> None:
    grammar = tmp_path / "dead.gbnf"
    grammar.write_text(DEAD_END + "\n")
    out = subprocess.run([*EC, "run", "--models", str(models_file), "--no-daemon",
                          "--temperature", "0.8", "--grammar", str(grammar), "-n", "8", "hi"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "matches no text at all" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


# ---------------------------------------------------------------------- the socket


def raw_socket() -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(str(paths.socket_path()))
    return s


def read_all(s: socket.socket) -> list[dict[str, object]]:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return [json.loads(line) for line in data.splitlines()]


@pytest.mark.parametrize("terminated", [True, False], ids=["line", "unterminated"])
def test_a_half_closed_client_gets_its_answers_then_eof(
        spawn_daemon: SpawnDaemon, terminated: bool) -> None:
    proc = spawn_daemon()
    with raw_socket() as s:  # what `socat` and `nc -N` do: send, shut the sending side
        line = encode(Generate("g", "tiny", "hello", max_tokens=5, temperature=0.0))
        s.sendall(b'{"DescribeFleet":{"request_id":"f"}}\n'
                  + (line if terminated else line.rstrip(b"\n")))
        s.shutdown(socket.SHUT_WR)
        events = read_all(s)  # ends: the daemon closes once it has answered
    kinds = [next(iter(e)) for e in events]
    # (the two requests' events may interleave; each request's come in order)
    assert kinds.count("FleetDescription") == 1, kinds
    assert next(k for k in kinds if k != "FleetDescription") == "Accepted", kinds
    assert events[-1]["Tokens"]["finished"] is True  # type: ignore[index]
    daemon_alive(proc)


def test_a_client_that_never_reads_stops_being_read(spawn_daemon: SpawnDaemon) -> None:
    proc = spawn_daemon()
    pid = proc.pid
    rss0 = rss(pid)
    line = b'{"DescribeFleet":{"request_id":"f"}}\n'
    with raw_socket() as s:
        s.setblocking(False)
        sent = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the daemon stops taking them
            try:
                sent += s.send(line * 1000)
            except BlockingIOError:
                time.sleep(0.2)
                try:
                    sent += s.send(line * 1000)
                except BlockingIOError:
                    break
        assert time.monotonic() < deadline, "the daemon read everything a non-reader sent"
        grown = rss(pid) - rss0
        daemon_alive(proc)
    # Answers for a few thousand lines at most were queued: the rest waited in the
    # socket's buffers, on the client's side.
    assert sent < 200_000 * len(line)
    assert grown < 40 * 2**20, grown
    daemon_alive(proc)


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines()
                    if ln.startswith("VmRSS:"))) * 1024


# ---------------------------------------------------------------------- HTTP bounds


def http_raw(data: bytes, *, pause: float = 0.0, read: bool = True) -> bytes:
    with socket.create_connection(http_address(), timeout=60) as s:
        s.sendall(data)
        if pause:
            time.sleep(pause)
        return s.recv(65536) if read else b""


def test_an_endless_header_is_431_and_costs_nothing(spawn_daemon: SpawnDaemon) -> None:
    proc = spawn_daemon("--http", "127.0.0.1:0")
    rss0 = rss(proc.pid)
    with socket.create_connection(http_address(), timeout=60) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Long: ")
        sent = 0
        with contextlib.suppress(OSError):  # the daemon answers and closes meanwhile
            while sent < 64 * 2**20:
                s.sendall(b"a" * 65536)
                sent += 65536
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    assert sent < 8 * 2**20
    assert rss(proc.pid) - rss0 < 16 * 2**20
    many = b"".join(b"X-%d: y\r\n" % i for i in range(200))
    assert http_raw(b"GET /health HTTP/1.1\r\nHost: localhost\r\n" + many + b"\r\n").startswith(
        b"HTTP/1.1 431 ")
    ok = http_raw(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200 ")
    daemon_alive(proc)


def test_half_sent_requests_time_out(spawn_daemon: SpawnDaemon) -> None:
    from everycycle.daemon import httpserver

    assert (httpserver.HEADER_TIMEOUT_S, httpserver.BODY_TIMEOUT_S) == (10.0, 30.0)
    proc = spawn_daemon("--http", "127.0.0.1:0")
    started = time.monotonic()
    with socket.create_connection(http_address(), timeout=60) as half, \
            socket.create_connection(http_address(), timeout=60) as silent:
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # and no more
        # (silent sends nothing at all)
        for s in (half, silent):
            answer = s.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
            assert s.recv(65536) == b""  # closed
    assert time.monotonic() - started > 9  # (not before its time; a hang: recv's timeout)
    daemon_alive(proc)


# ---------------------------------------------------------------------- grammar sizes


def _deep(n: int) -> str:
    """An object nested ``n`` deep, as JSON text (past what Python's own json nests)."""
    return ('{"type": "object", "required": ["a"], "properties": {"a": ' * n
            + '{"type": "integer"}' + "}}" * n)


HOSTILE = {
    # Counts llguidance never expands: they constrain, lazily, and the answer is cut by
    # max_tokens as a prefix the matcher accepted.
    "minItems": ({"json_schema": {"type": "array", "items": {"type": "integer"},
                                  "minItems": 10_000_000}}, None),
    "maxLength": ({"json_schema": {"type": "string", "maxLength": 10**9}}, None),
    "description": ({"json_schema": {"type": "string", "description": "x" * 60_000}},
                    None),  # (the socket's limit on a schema is 64 KiB)
    # Refused before anything is queued, naming why.
    "deep": ({"json_schema": _deep(400)}, "recursion limit exceeded"),
    "properties": ({"json_schema": {"type": "object", "properties": {
        f"p{i}": {} for i in range(4_000)}}}, "too large"),
    "enum": ({"json_schema": {"enum": [f"v{i}" for i in range(6_000)]}}, "too large"),
    "cycle": ({"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"},
                                         "b": {"$ref": "#/$defs/a"}},
                               "$ref": "#/$defs/a"}}, "matches no text"),
    # Past the parser's budget for one token: the request ends with a clear error.
    "count": ({"grammar": 'root ::= "a"{10000000}'}, "Too many items"),
    "pattern": ({"json_schema": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                "lexer"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_schemas_and_grammars_end_quickly_and_the_engine_lives(
        spawn_daemon: SpawnDaemon, case: str) -> None:
    options, error = HOSTILE[case]
    request = {k: v if isinstance(v, str) else json.dumps(v) for k, v in options.items()}
    proc = spawn_daemon()
    with SyncClient() as c:
        c.load("tiny")
        pid = next(m.engine_pid for m in c.describe_fleet().loaded_models)
        rss0 = rss(pid)
        started = time.monotonic()
        events = list(c.generate("tiny", "x", max_tokens=8, temperature=0.0,
                                 **request))  # type: ignore[arg-type]
        took = time.monotonic() - started
        last = events[-1]
        if error is None:
            assert isinstance(last, Tokens) and last.finished, last
        else:
            assert isinstance(last, Error) and last.kind is ErrorKind.INVALID, last
            assert error in last.message, last.message
            assert "Traceback" not in last.message
        # The parser's budget is counted (the lexer's fuel, the items a rule may
        # repeat), not timed: the error above says which ran out. A second or two here
        # on a 2-core machine; only a hang (no budget at all) comes near this bound.
        assert took < 120, took
        m = c.describe_fleet().loaded_models[0]
        assert m.engine_pid == pid and m.engine_restarts is None  # the engine lives
        assert rss(pid) - rss0 < 64 * 2**20
        ok = list(c.generate("tiny", "x", max_tokens=4, grammar='root ::= "yes" | "no"'))
        assert isinstance(ok[-1], Tokens)  # and serves the next request
    daemon_alive(proc)


# ---------------------------------------------------------------------- names and paths


@pytest.mark.parametrize("url", [
    "hf://o/r/../../x.gguf", "hf://o/r/a/../../../etc/passwd.gguf", "hf://o/r//x.gguf",
    "hf://../r/x.gguf", "hf://o/r/./x.gguf", "hf://o/r/x.gguf@../../main",
])
def test_pull_and_models_add_refuse_paths_out_of_the_repo(url: str) -> None:
    for cmd in (["pull", url], ["models", "add", "m", url]):
        out = subprocess.run([*EC, *cmd], capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 2, (cmd, out.returncode, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not list(Path(os.environ["HF_HOME"]).rglob("*.gguf"))


@pytest.mark.parametrize("name", ["", "two\nlines", "x" * 300, "tab\there"],
                         ids=["empty", "newline", "long", "tab"])
def test_registry_names_follow_the_protocol_rule(name: str, tmp_path: Path) -> None:
    out = subprocess.run([*EC, "models", "add", name, "hf://o/r/x.gguf"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and "model" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    f = tmp_path / "models.toml"
    f.write_text(f'[models.{json.dumps(name)}]\npath = "x.gguf"\n'
                 '[models.fine]\npath = "x.gguf"\n')
    out = subprocess.run([*EC, "models", "--models", str(f)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 2 and "model name" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    traversal = tmp_path / "hub.toml"
    traversal.write_text('[models.m]\nhf_repo = "o/r"\nhf_file = "../../x.gguf"\n')
    out = subprocess.run([*EC, "models", "--models", str(traversal)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and "inside the repo" in out.stderr, out.stderr


@pytest.mark.anyio
async def test_a_body_that_never_ends_times_out(models_file: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import anyio
    from daemonhelp import running_daemon

    from everycycle.daemon import httpserver

    monkeypatch.setattr(httpserver, "BODY_TIMEOUT_S", 1.0)
    async with running_daemon(models_file, http=("127.0.0.1", 0)) as daemon:
        def half_body() -> bytes:
            with socket.create_connection(("127.0.0.1", daemon.http_port), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                          b"application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
                started = time.monotonic()
                answer = s.recv(65536)
                assert time.monotonic() - started > 0.8  # (a hang: recv's timeout)
                return answer

        answer = await anyio.to_thread.run_sync(half_body)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
