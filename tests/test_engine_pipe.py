"""The engine pipe's framing: what one side sends, the other reads back whole, however
the bytes arrive (several messages in one read, one message over many reads)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from everycycle.engine.host.contract import (
    Heartbeat,
    JobOutput,
    MessageReader,
    Outputs,
    Returned,
    WireError,
    send_message,
)
from everycycle.engine.spec.proposer import DraftCount


@pytest.fixture
def pipe() -> Iterator[tuple[Connection, Connection]]:
    a, b = socket.socketpair()
    ends = Connection(a.detach()), Connection(b.detach())
    yield ends
    for end in ends:
        end.close()


def output(jid: int, text: str = " the", **kw: Any) -> JobOutput:
    return JobOutput(jid, text, (1234,), False, None, None, None, None, 20, 0, 3)._replace(
        **kw)


def read_all(reader: MessageReader, count: int) -> list[object]:
    got: list[object] = []
    while len(got) < count:
        got.extend(reader.read())
    return got


def test_a_steps_outputs_come_back_as_the_same_typed_messages(
        pipe: tuple[Connection, Connection]) -> None:
    sender, receiver = pipe
    step = Outputs([output(1), output(2, "é", finished=True, reason="eos",
                                    logprobs=(("é", -0.5, (("é", -0.5), ("a", -2.0))),))],
                   (DraftCount("lookup", 3, 2),), 1)
    failed = Outputs([output(3, "", finished=True, reason="error",
                             error=WireError("Invalid", "bad grammar"))])
    for message in (step, Heartbeat(7), failed, Returned(4, [1, 2], None)):
        send_message(sender, message)
    got = read_all(MessageReader(receiver.fileno()), 4)
    assert got == [step, Heartbeat(7), failed, Returned(4, [1, 2], None)]
    first, _, third, _ = got
    assert isinstance(first, Outputs) and type(first.items[0]) is JobOutput
    assert type(first.draft_counts[0]) is DraftCount
    assert isinstance(third, Outputs) and third.items[0].error is not None
    assert third.items[0].error.exception().message == "bad grammar"


def test_a_message_longer_than_one_read_is_put_together(
        pipe: tuple[Connection, Connection]) -> None:
    sender, receiver = pipe
    big = Outputs([output(1, embeddings=[[float(i) for i in range(40_000)]], finished=True,
                          reason="eos")])
    def write() -> None:
        for m in (Heartbeat(1), big, Heartbeat(2)):
            send_message(sender, m)

    writer = threading.Thread(target=write)
    writer.start()
    reader = MessageReader(receiver.fileno())
    reads = 0
    got: list[object] = []
    while len(got) < 3:
        got.extend(reader.read())
        reads += 1
    writer.join()
    assert got == [Heartbeat(1), big, Heartbeat(2)]
    assert reads > 2  # (the embedding is over 300 KiB: it took several reads)


def test_the_end_of_the_pipe_is_eof(pipe: tuple[Connection, Connection]) -> None:
    sender, receiver = pipe
    send_message(sender, Heartbeat(1))
    sender.close()
    reader = MessageReader(receiver.fileno())
    assert read_all(reader, 1) == [Heartbeat(1)]
    with pytest.raises(EOFError):
        reader.read()
