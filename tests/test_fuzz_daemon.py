"""Fuzz the running daemon: whatever a client sends, the daemon answers and survives.

A fixed budget runs in the normal suite; set EVERYCYCLE_FUZZ_EXAMPLES for a long run
(bench/fuzz.sh does). Each example sends one fuzzed line and then a DescribeFleet
sentinel on a fresh connection, and checks that the fuzzed line got exactly one
terminal event (an over-long line: one Error, then only that connection closes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemonhelp import daemon_process
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everycycle.errors import ProtocolError
from everycycle.protocol import (
    MAX_LINE_BYTES,
    Accepted,
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
    with daemon_process("--models", str(models), "--max-inflight", "4", sock=sock,
                        env=env) as proc:
        yield sock
        assert proc.poll() is None, "the daemon died during fuzzing"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


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


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(line=lines)
def test_every_line_gets_exactly_one_answer(daemon: Path, line: bytes) -> None:
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
    assert calm[0] == Accepted("calm", 0)
    assert isinstance(calm[-1], Tokens) and calm[-1].finished
