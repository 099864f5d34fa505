"""The sans-IO client core: request lifecycle and routing, with no sockets (h11-style)."""

from __future__ import annotations

import pytest

from everycycle.client.connection import UNATTRIBUTED, ClientConnection
from everycycle.errors import DaemonUnavailableError, ErrorKind, UsageError
from everycycle.protocol import (
    Accepted,
    DescribeFleet,
    Error,
    FleetDescription,
    FleetSnapshot,
    Generate,
    LineFramer,
    TokenChunk,
    Tokens,
    encode,
)

SNAP = FleetSnapshot("h", (), (), 0)


def wire(*events: object) -> bytes:
    return b"".join(encode(e) for e in events)  # type: ignore[arg-type]


def test_events_are_routed_by_request_id_and_end_at_the_terminal_one() -> None:
    conn = ClientConnection()
    conn.send(Generate("a", "m", "x"))
    conn.send(Generate("b", "m", "y"))
    routed = conn.receive_data(wire(
        Accepted("b", 0), Accepted("a", 1),
        Tokens("a", TokenChunk("hi", (1,)), True),
    ))
    assert [(r.request_id, r.terminal) for r in routed] == [("b", False), ("a", False),
                                                           ("a", True)]
    assert conn.active == {"b"}


def test_an_error_answering_a_fleet_request_does_not_shift_later_fleet_replies() -> None:
    conn = ClientConnection()
    conn.send(DescribeFleet("f1"))
    conn.send(DescribeFleet("f2"))
    routed = conn.receive_data(wire(Error("f1", ErrorKind.INTERNAL, "boom"),
                                    FleetDescription(SNAP)))
    assert [r.request_id for r in routed] == ["f1", "f2"]
    assert conn.active == frozenset()


def test_fleet_replies_go_to_waiters_in_order() -> None:
    conn = ClientConnection()
    conn.send(DescribeFleet("f1"))
    conn.send(Generate("g", "m", "x"))
    conn.send(DescribeFleet("f2"))
    routed = conn.receive_data(wire(FleetDescription(SNAP), FleetDescription(SNAP)))
    assert [r.request_id for r in routed] == ["f1", "f2"]
    extra = conn.receive_event(FleetDescription(SNAP))
    assert extra.request_id == UNATTRIBUTED  # nobody asked: made explicit, not guessed


def test_an_unattributed_error_goes_to_the_only_request_else_nowhere() -> None:
    conn = ClientConnection()
    conn.send(Generate("a", "m", "x"))
    assert conn.receive_event(Error("", ErrorKind.INVALID, "bad line")).request_id == "a"
    conn.send(Generate("b", "m", "x"))
    conn.send(Generate("c", "m", "x"))
    assert conn.receive_event(Error("", ErrorKind.INVALID, "?")).request_id == UNATTRIBUTED
    assert conn.active == {"b", "c"}


def test_reusing_an_active_id_is_a_usage_error_and_a_finished_one_is_fine() -> None:
    conn = ClientConnection()
    conn.send(Generate("a", "m", "x"))
    with pytest.raises(UsageError, match="already active"):
        conn.send(Generate("a", "m", "x"))
    conn.receive_event(Error("a", ErrorKind.CANCELLED, "c"))
    conn.send(Generate("a", "m", "x"))


def test_a_closed_connection_reports_what_was_lost_and_refuses_new_requests() -> None:
    conn = ClientConnection()
    conn.send(Generate("a", "m", "x"))
    conn.send(DescribeFleet("f"))
    assert conn.receive_data(b"") == []
    assert conn.closed and conn.active == frozenset()
    with pytest.raises(DaemonUnavailableError):
        conn.send(Generate("b", "m", "x"))


def test_a_garbage_line_from_the_daemon_closes_after_the_good_ones() -> None:
    conn = ClientConnection()
    conn.send(Generate("a", "m", "x"))
    routed = conn.receive_data(wire(Accepted("a", 0)) + b"not json\n" + wire(Accepted("a", 0)))
    assert len(routed) == 1 and conn.closed and "invalid line" in conn.closed
    assert conn.close() == []


def test_framer_feeding_is_eager() -> None:
    framer = LineFramer()
    framer.feed(b'{"a":1}')  # not iterated: the bytes must still be kept
    assert framer.feed(b"\n") == [b'{"a":1}']
    assert framer.feed(b"x\ny\n") == [b"x", b"y"]
