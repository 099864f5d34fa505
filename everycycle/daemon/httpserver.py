"""uvicorn, run as one task of the daemon's event loop (no second loop, no thread), with
bounds on what a client may make it hold.

uvicorn's httptools protocol buffers a request's head for as long as it takes and
however long it grows, and waits for a head or a body forever. ``BoundedHttp`` adds
what llama-server and Ollama get from their HTTP libraries: a request head of at most
``MAX_HEADER_BYTES`` and ``MAX_HEADERS`` fields (else 431), a head that must arrive
within ``HEADER_TIMEOUT_S`` of the connection or of the previous response, and a body
within ``BODY_TIMEOUT_S`` of its head (else 408 and the connection closes). Idle
keep-alive connections close after ``KEEP_ALIVE_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..errors import ConfigError

MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 100
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEP_ALIVE_S = 5.0

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds on the request head and timeouts."""

    _timer: asyncio.TimerHandle | None = None
    _head_bytes = 0
    _head_fields = 0
    _in_head = True
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._expect_head()

    def _expect_head(self) -> None:
        self._in_head, self._head_bytes, self._head_fields = True, 0, 0
        self._arm(HEADER_TIMEOUT_S, "the request head did not arrive in time")

    def _arm(self, seconds: float, why: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._refuse, 408, why)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if (self._in_head and self._head_bytes > MAX_HEADER_BYTES
                and not self.transport.is_closing()):
            self._refuse(431, f"the request head is over {MAX_HEADER_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._expect_head()  # from its first byte, the head has HEADER_TIMEOUT_S

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        if self._refused:
            return
        if self._head_fields > MAX_HEADERS:
            self._refuse(431, f"more than {MAX_HEADERS} header fields")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_head = False
        self._arm(BODY_TIMEOUT_S, "the request body did not arrive in time")
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._disarm()
        if not self._refused:
            super().on_message_complete()

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` with an OpenAI-shaped error and close the connection."""
        self._disarm()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        if self.cycle is not None and not self.cycle.response_complete and (
                self.cycle.response_started):
            self.transport.close()  # a response is under way: only closing is left
            return
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"
                                     if status == 431 else "request_timeout"}}).encode()
        self.transport.write(b"".join([
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        self.transport.close()
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn Server that leaves signals to the daemon (it owns SIGTERM/SIGINT)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: Any, tls: ssl.SSLContext | None = None) -> uvicorn.Server:
    """A uvicorn server for ``app`` (HTTPS with ``tls``); start it with ``await
    server.serve(sockets=[sock])`` and stop it with ``server.should_exit = True``."""
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning",
                            timeout_graceful_shutdown=2, server_header=False,
                            log_config=None, http=BoundedHttp,
                            timeout_keep_alive=int(KEEP_ALIVE_S))
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    if tls is not None:  # (ours, checked at start-up: uvicorn's own would load the files)
        config.load()
        config.ssl = tls
    return _EmbeddedServer(config)


def bind(host: str, port: int) -> socket.socket:
    """The HTTP listening socket on ``host``:``port`` (0: a free port), bound now so that
    errors surface at start-up. Raises ConfigError saying why it cannot listen."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # No Nagle on the connections it accepts (Linux hands them this option): a response
    # goes out as uvicorn writes it, head then body. With Nagle, the body waits for the
    # ACK of the head, which the client delays: 40 ms on every keep-alive request.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}"
                          ) from None
    sock.setblocking(False)
    return sock
