"""The daemon's side of one protocol connection as a state machine. No I/O.

Bytes in → requests to handle and errors to answer; events out → bytes. The socket
server drives one per connection, as the clients drive ``ClientConnection``. Rules,
each applied here and nowhere else:

1. A line that does not decode gets ``Error{Invalid}`` (with its request id when one
   could be read) and the connection stays usable; a line over the limit gets
   ``Error{Invalid}`` and the connection closes (the stream cannot be resynced).
2. A connection that needs authentication (TCP) must send ``Auth`` first: anything
   else, an unknown token or a line that does not decode closes it, and the attempt
   is reported for the audit log. Once authenticated, ``principal`` is whoever the
   token names; ``Auth`` again is Invalid, as is ``Auth`` on a connection that needs
   none.
3. After it closes, nothing more is read: ``receive_data`` returns nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import ErrorKind, LineTooLongError, ProtocolError
from ..protocol import Auth, Error, LineFramer, Request, ServerEvent, decode_request, encode

P = TypeVar("P")


@dataclass(frozen=True, slots=True)
class AuthFailed:
    """A refused authentication, for the audit log: ``missing`` or ``refused``."""

    outcome: str


Received = Request | Error | AuthFailed
"""What a line means: a request to handle, an error to send back, an audit record."""


class ServerConnection(Generic[P]):
    """One connection's framing, decoding and authentication state. No I/O."""

    def __init__(self, principal: P | None, authenticate: Callable[[str], P | None]) -> None:
        """``principal`` is who the connection is (None: it must authenticate first)."""
        self._framer = LineFramer()
        self._authenticate = authenticate
        self._needs_auth = principal is None
        self.principal = principal
        self.closed: str | None = None
        """Why nothing more is read from the connection, once that is so."""

    @property
    def pending(self) -> int:
        """Bytes received after the last complete line."""
        return self._framer.pending

    def receive_data(self, data: bytes) -> list[Received]:
        """Feed bytes from the client (``b""``: end of stream, its last line complete
        even without a newline); return what they mean, in order."""
        if self.closed is not None:
            return []
        if not data:
            if not self._framer.pending:
                self.closed = "end of stream"
                return []
            data = b"\n"  # its last line, unterminated (printf '…' | nc -N)
        try:
            lines = self._framer.feed(data)
        except LineTooLongError as exc:
            self.closed = exc.message
            return [Error("", ErrorKind.INVALID, exc.message)]
        out: list[Received] = []
        for line in lines:
            out.extend(self._line(line))
            if self.closed is not None:
                break
        return out

    def _line(self, line: bytes) -> list[Received]:
        try:
            request = decode_request(line)
        except ProtocolError as exc:
            if self.principal is None:
                self.closed = "not authenticated"
            return [Error(exc.request_id, ErrorKind.INVALID, exc.message)]
        if self.principal is None:
            return self._auth(request)
        if isinstance(request, Auth):
            return [Error("", ErrorKind.INVALID, "already authenticated" if self._needs_auth
                          else "Auth is only for TCP connections")]
        return [request]

    def _auth(self, request: Request) -> list[Received]:
        if not isinstance(request, Auth):
            self.closed = "not authenticated"
            return [Error("", ErrorKind.INVALID, "authentication required"),
                    AuthFailed("missing")]
        principal = self._authenticate(request.token)
        if principal is None:
            self.closed = "invalid token"
            return [Error("", ErrorKind.REJECTED, "invalid token"), AuthFailed("refused")]
        self.principal = principal
        return []

    @staticmethod
    def send(event: ServerEvent) -> bytes:
        """The wire line for ``event``."""
        return encode(event)
