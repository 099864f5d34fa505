"""Splitting a byte stream into protocol lines, with the 8 MiB limit (images ride in requests). No I/O."""

from __future__ import annotations

from ..errors import LineTooLongError

MAX_LINE_BYTES = 8 << 20
"""Longest line (excluding the newline) either side may send."""


class LineFramer:
    """Splits a byte stream into lines of at most ``max_line`` bytes. No I/O.

    ``feed`` consumes its data at once (like h11's receive buffer) and returns the
    complete lines received so far, without newlines. A line that grows past the limit
    raises LineTooLongError; the stream cannot be resynced, so the caller closes the
    connection.
    """

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._max = max_line
        self._buf = bytearray()

    def feed(self, data: bytes | bytearray) -> list[bytes]:
        """Add ``data``; return each complete line. Raises LineTooLongError."""
        self._buf += data
        lines: list[bytes] = []
        start = 0
        while True:
            nl = self._buf.find(b"\n", start)
            if nl < 0:
                break
            if nl - start > self._max:
                raise LineTooLongError(f"line longer than {self._max} bytes")
            lines.append(bytes(self._buf[start:nl]))
            start = nl + 1
        del self._buf[:start]
        if len(self._buf) > self._max:
            raise LineTooLongError(f"line longer than {self._max} bytes")
        return lines

    @property
    def pending(self) -> int:
        """Bytes received after the last newline."""
        return len(self._buf)
