"""The daemon's sans-IO connection: framing, decoding and authentication, no sockets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from everycycle.daemon.connection import AuthFailed, ServerConnection
from everycycle.errors import ErrorKind
from everycycle.protocol import MAX_LINE_BYTES, Auth, DescribeFleet, Error, Generate, encode


def _local() -> ServerConnection[str]:
    return ServerConnection("local", lambda token: None)


def _tcp() -> ServerConnection[str]:
    return ServerConnection(None, lambda token: "alice" if token == "s3cret" else None)


def test_lines_split_anywhere_decode_to_the_same_requests() -> None:
    wire = encode(Generate("a", "m", "hi")) + encode(DescribeFleet("b"))
    for cut in range(1, len(wire)):
        conn = _local()
        got = conn.receive_data(wire[:cut]) + conn.receive_data(wire[cut:])
        assert got == [Generate("a", "m", "hi"), DescribeFleet("b")]


def test_a_bad_line_is_answered_and_the_connection_stays_usable() -> None:
    conn = _local()
    got = conn.receive_data(b'{"Generate":{"request_id":"x1","model":3}}\n'
                            + encode(DescribeFleet("b")))
    assert isinstance(got[0], Error) and got[0].request_id == "x1"
    assert got[0].kind is ErrorKind.INVALID and got[1] == DescribeFleet("b")
    assert conn.closed is None


def test_an_over_long_line_closes_the_connection() -> None:
    conn = _local()
    (error,) = conn.receive_data(b"x" * (MAX_LINE_BYTES + 1))
    assert isinstance(error, Error) and "longer than" in error.message
    assert conn.closed and conn.receive_data(encode(DescribeFleet("b"))) == []


def test_the_last_line_counts_without_its_newline_and_then_the_stream_ends() -> None:
    conn = _local()
    assert conn.receive_data(encode(DescribeFleet("b")).rstrip(b"\n")) == []
    assert conn.receive_data(b"") == [DescribeFleet("b")]
    assert conn.closed is None
    assert conn.receive_data(b"") == [] and conn.closed == "end of stream"


def test_tcp_needs_auth_first_and_then_is_whoever_the_token_names() -> None:
    conn = _tcp()
    assert conn.principal is None
    assert conn.receive_data(encode(Auth("s3cret")) + encode(DescribeFleet("b"))) == [
        DescribeFleet("b")]
    assert conn.principal == "alice"
    (again,) = conn.receive_data(encode(Auth("s3cret")))
    assert isinstance(again, Error) and again.message == "already authenticated"


def test_tcp_refuses_a_wrong_token_a_missing_one_and_garbage_and_closes() -> None:
    for first, outcome in ((encode(Auth("nope")), "refused"),
                           (encode(DescribeFleet("b")), "missing")):
        conn = _tcp()
        error, audit = conn.receive_data(first + encode(DescribeFleet("c")))
        assert isinstance(error, Error) and audit == AuthFailed(outcome)
        assert conn.closed and conn.principal is None
    conn = _tcp()
    (error,) = conn.receive_data(b"not json\n")
    assert isinstance(error, Error) and conn.closed


def test_auth_on_a_local_connection_is_invalid() -> None:
    (error,) = _local().receive_data(encode(Auth("s3cret")))
    assert isinstance(error, Error) and "only for TCP" in error.message


@given(st.lists(st.binary(max_size=200), max_size=20), st.booleans())
def test_any_bytes_give_requests_errors_or_a_close_never_an_exception(
        chunks: list[bytes], tcp: bool) -> None:
    conn = _tcp() if tcp else _local()
    for chunk in [*chunks, b""]:
        for item in conn.receive_data(chunk):
            assert isinstance(item, Error | AuthFailed) or conn.principal is not None
