"""Fuzz the running daemon: whatever a client sends, the daemon answers and survives.

A fixed budget runs in the normal suite; set EVERYCYCLE_FUZZ_EXAMPLES for a long run
(bench/fuzz.sh does). Each example sends one fuzzed line and then a DescribeFleet
sentinel on a fresh connection, and checks that the fuzzed line got exactly one
terminal event (an over-long line: one Error, then only that connection closes).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonhelp import accepted, daemon_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everycycle.client import SyncClient
from everycycle.errors import ErrorKind, ProtocolError
from everycycle.protocol import (
    MAX_LINE_BYTES,
    DescribeFleet,
    Error,
    FleetDescription,
    LineFramer,
    ServerEvent,
    Tokens,
    decode_event,
    decode_request,
    encode,
    is_terminal,
)

EXAMPLES = int(os.environ.get("EVERYCYCLE_FUZZ_EXAMPLES", "60"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[Path]:
    home = Path(tmp_path_factory.mktemp("fz"))
    import tempfile

    run = Path(tempfile.mkdtemp(prefix="fz", dir="/tmp"))
    sock = run / "d.sock"
    models = home / "models.toml"
    models.write_text(f'[models.tiny]\npath = "{tiny_gguf}"\ncontext = 128\nparallel = 2\n')
    env = {**os.environ, "EVERYCYCLE_HOME": str(home)}
    with daemon_process("--models", str(models), "--max-inflight", "4", "--http",
                        "127.0.0.1:0", sock=sock, env=env) as proc:
        _pids[sock] = proc.pid
        yield sock
        assert proc.poll() is None, "the daemon died during fuzzing"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


_pids: dict[Path, int] = {}
_baseline: dict[Path, int] = {}


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines()
                    if ln.startswith("VmRSS:"))) * 1024


def http_address(sock: Path) -> tuple[str, int]:
    with SyncClient(sock) as c:
        url = c.describe_fleet().http
    assert url is not None
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


def exchange(sock: Path, line: bytes) -> tuple[list[ServerEvent], bool]:
    """Send ``line`` and a sentinel DescribeFleet; read until both are answered.

    Returns the events and whether the daemon closed the connection first.
    """
    try:
        request = decode_request(line)
        rid = getattr(request, "request_id", "")
    except ProtocolError as exc:
        request, rid = None, exc.request_id
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(str(sock))
    framer = LineFramer()
    events: list[ServerEvent] = []
    try:
        s.sendall(line + b"\n")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(encode(DescribeFleet("sentinel")))
        line_done = sentinel_done = False
        while not (line_done and sentinel_done):
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return events, True
            for raw in framer.feed(data):
                ev = decode_event(raw)
                events.append(ev)
                if isinstance(ev, FleetDescription):
                    # answered in order: the fuzzed DescribeFleet (if it is one) comes first
                    if isinstance(request, DescribeFleet) and not line_done:
                        line_done = True
                    else:
                        sentinel_done = True
                elif is_terminal(ev) and ev.request_id in (rid, ""):
                    line_done = True
        return events, False
    finally:
        s.close()


json_leaf = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
             | st.text(max_size=30))


def _nest(children: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children,
                                                            max_size=4)


wild_value = st.recursive(json_leaf, _nest, max_leaves=8)
control_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]),
                       max_size=60) | st.just("a\x00b\x1b[31m\r\n")
tags = st.sampled_from(["Generate", "DescribeFleet", "Cancel", "Load", "Unload", "Auth",
                        "Nope", "Tokens", "Accepted"])
generate_fields = st.fixed_dictionaries(
    {"request_id": st.from_regex(r"[A-Za-z0-9._:-]{1,70}", fullmatch=True) | wild_value,
     "model": st.sampled_from(["tiny", "nope", "", "/etc/passwd", "../x.gguf"]) | wild_value,
     "prompt": control_text | wild_value},
    optional={k: wild_value | st.integers(-10, 10**12) | st.floats(allow_nan=True) for k in (
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed",
        "stop", "format", "auto_load", "deadline_ms")},
)


def _dumps(value: object) -> bytes:
    return json.dumps(value, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


lines = st.one_of(
    st.binary(max_size=300).map(lambda b: b.replace(b"\n", b" ")),
    st.tuples(tags, wild_value).map(lambda t: _dumps({t[0]: t[1]})),
    generate_fields.map(lambda g: _dumps({"Generate": g})),
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n),
    st.sampled_from([b"1e99999", b"123456789" * 50, b'{"Generate":{"max_tokens":1e400}}',
                     b"\xff\xfe\xfd", b'{"Generate":"\xc3\x28"}', b"", b" " * 10]),
)


# Type confusion: a well-formed request with one field (at any depth of its own
# structure) replaced by a list, an object, a number or null.
confusion = (st.lists(json_leaf, max_size=3) | st.dictionaries(st.text(max_size=5), json_leaf,
                                                               max_size=3)
             | st.integers() | st.none() | st.booleans() | st.floats(allow_nan=True))
_WELL_FORMED = {
    "Generate": {"request_id": "g", "model": "tiny", "prompt": None, "max_tokens": 4,
                 "temperature": 0.0, "stop": ["x"], "seed": 1, "deadline_ms": 5000,
                 "messages": [{"role": "user", "content": "hi"}], "keep_alive_ms": 1000,
                 "json_schema": '{"type": "object"}'},
    "Embed": {"request_id": "e", "model": "tiny", "input": ["a", "b"]},
    "Load": {"request_id": "l", "model": "tiny", "executor": "cpu"},
    "Cancel": {"request_id": "c", "target": "g"},
    "Unload": {"request_id": "u", "model": "nope"},
}


def _paths(value: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def confused(draw: st.DrawFn) -> bytes:
    tag = draw(st.sampled_from(sorted(_WELL_FORMED)))
    body = json.loads(json.dumps(_WELL_FORMED[tag]))
    where = draw(st.sampled_from(_paths(body)))
    node = body
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = draw(confusion)
    return _dumps({tag: body})


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(line=lines | confused())
def test_every_line_gets_exactly_one_answer(daemon: Path, line: bytes) -> None:
    _baseline.setdefault(daemon, rss(_pids[daemon]))
    events, closed = exchange(daemon, line)
    assert not closed, f"connection closed for a line of {len(line)} bytes"
    ends = [e for e in events if is_terminal(e)]
    assert len(ends) == 2, events  # exactly one for the fuzzed line, one for the sentinel


def test_an_overlong_line_closes_only_that_connection(daemon: Path) -> None:
    events, closed = exchange(daemon, b"x" * (MAX_LINE_BYTES + 1))
    assert closed and len(events) == 1 and isinstance(events[0], Error)
    events, closed = exchange(daemon, encode(DescribeFleet("after")).rstrip(b"\n"))
    assert not closed and isinstance(events[0], FleetDescription)


def test_other_clients_are_unaffected_after_fuzzing(daemon: Path) -> None:
    line = b'{"Generate":{"request_id":"calm","model":"tiny","prompt":"hi","max_tokens":3,"temperature":0}}'
    events, closed = exchange(daemon, line)
    assert not closed
    calm = [e for e in events if getattr(e, "request_id", None) == "calm"]
    assert calm[0] == accepted("calm", 0)
    assert isinstance(calm[-1], Tokens) and calm[-1].finished


# Grammars and schemas from hypothesis: valid, broken, dead ends, huge counts.
gbnf_atom = st.one_of(
    st.sampled_from(['"a"', '"yes"', '[0-9]', '[\\x00]', '[^a]', '"\\n"', "x", "root", '""',
                     "[", '"unterminated', "(", ")"]),
    st.text(alphabet='ab"[]()|*+?{},0123456789 ', max_size=12))
gbnf_piece = st.tuples(gbnf_atom, st.sampled_from(["", "*", "+", "?", "{2}", "{1,3}",
                                                   "{0,}", "{100000}", "{99999999}"])).map(
    "".join)
grammars = st.lists(gbnf_piece, min_size=1, max_size=6).map(
    lambda parts: "root ::= " + " ".join(parts) + '\nx ::= "x"')
schema_leaf = st.fixed_dictionaries(
    {"type": st.sampled_from(["string", "integer", "number", "boolean", "null", "array",
                              "object", "nope", 3])},
    optional={"minItems": st.integers(-5, 10**9), "maxItems": st.integers(-5, 10**9),
              "maxLength": st.integers(-5, 10**9), "minLength": st.integers(0, 10),
              "pattern": st.sampled_from(["^a+$", "^[\\u0000]+$", "(a{1000}){1000}", "[",
                                          "^\\d{3}-\\d{4}$"]),
              "enum": st.lists(json_leaf, max_size=3), "minimum": st.integers(),
              "format": st.sampled_from(["date", "uuid", "email"])})
schemas = st.recursive(schema_leaf, lambda inner: st.fixed_dictionaries(
    {"type": st.just("object"),
     "properties": st.dictionaries(st.text(min_size=1, max_size=5), inner, max_size=3)},
    optional={"required": st.lists(st.text(max_size=5), max_size=2),
              "items": inner, "additionalProperties": st.booleans() | inner}), max_leaves=4)


@settings(max_examples=max(EXAMPLES // 2, 10), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(grammar=grammars | schemas.map(json.dumps), sampled=st.booleans(), seed=st.integers(0, 99))
def test_generated_grammars_and_schemas_get_one_answer(daemon: Path, grammar: str,
                                                       sampled: bool, seed: int) -> None:
    _baseline.setdefault(daemon, rss(_pids[daemon]))
    field = "json_schema" if grammar.startswith("{") else "grammar"
    line = _dumps({"Generate": {"request_id": "gr", "model": "tiny", "prompt": "hi",
                                "max_tokens": 8, "temperature": 0.9 if sampled else 0.0,
                                "seed": seed, field: grammar}})
    events, closed = exchange(daemon, line)
    assert not closed
    ends = [e for e in events if is_terminal(e)]
    assert len(ends) == 2, events
    mine = next(e for e in ends if getattr(e, "request_id", None) == "gr")
    assert isinstance(mine, Tokens) or (isinstance(mine, Error) and mine.kind in (
        ErrorKind.INVALID,)), mine


http_fields = st.fixed_dictionaries(
    {"model": st.just("tiny") | confusion,
     "messages": st.just([{"role": "user", "content": "hi"}]) | confusion
     | st.lists(st.fixed_dictionaries({"role": st.just("user") | confusion,
                                       "content": st.just("x") | confusion}), max_size=2)},
    optional={"max_tokens": st.just(2) | confusion, "temperature": confusion,
              "stop": confusion, "stream": confusion, "seed": confusion, "n": confusion,
              "response_format": confusion | st.just({"type": "json_schema",
                                                      "json_schema": {"schema": 3}}),
              "stream_options": confusion, "top_p": confusion, "logit_bias": confusion})


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=http_fields, path=st.sampled_from(["/v1/chat/completions", "/v1/completions",
                                              "/v1/embeddings"]),
       deadline=st.sampled_from([None, "5000", "²", "-1", "1e3", "99999999999999999999"]))
def test_http_answers_bad_json_with_a_4xx(daemon: Path, body: dict[str, object], path: str,
                                          deadline: str | None) -> None:
    _baseline.setdefault(daemon, rss(_pids[daemon]))
    if path != "/v1/chat/completions":
        body = {**body, "prompt": body.pop("messages"), "input": "x"}
    headers = {"content-type": "application/json"}
    if deadline is not None:
        headers["x-deadline-ms"] = deadline
    conn = http.client.HTTPConnection(*http_address(daemon), timeout=30)
    try:
        conn.request("POST", path, body=_dumps(body),
                     headers={k: v.encode() for k, v in headers.items()})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    assert resp.status < 500, (resp.status, data[:300])
    if resp.status >= 400:
        assert "error" in json.loads(data)


def test_the_daemon_memory_returns_near_its_baseline(daemon: Path) -> None:
    """Runs after the fuzzers (file order): what they made the daemon hold, it let go."""
    if daemon not in _baseline:
        pytest.skip("no fuzzing ran")
    grown = rss(_pids[daemon]) - _baseline[daemon]
    assert grown < 64 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB over the fuzzing"
