"""Socket helpers shared by the daemon and the clients."""

from __future__ import annotations

import contextlib
import socket

import anyio.abc


def wake_reader(stream: anyio.abc.ByteStream) -> None:
    """End a pending receive with EOF instead of cancelling it.

    Cancelling a receive on an asyncio UNIX socket stream can leave a reader callback
    that fails later (anyio#1267); shutting the socket down ends it cleanly.
    """
    raw = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
    if raw is not None:
        with contextlib.suppress(OSError):
            raw.shutdown(socket.SHUT_RDWR)
