"""Showing a model's thinking: dimmed on a terminal, plain otherwise, and folded into
one line once the answer begins (chat) or left as it is (``run --think`` on stderr)."""

from __future__ import annotations

import shutil
from typing import TextIO

DIM, RESET = "\x1b[2m", "\x1b[0m"


class Thoughts:
    """Writes reasoning text to ``stream`` as it comes; ``fold`` replaces what a
    terminal shows of it with a one-line summary."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._shown = ""
        self._open = False

    @property
    def active(self) -> bool:
        """Whether thinking is on the screen now (and not folded)."""
        return self._open

    def write(self, text: str) -> None:
        if not text:
            return
        if not self._open:
            self._open = True
            if self.tty:
                self.stream.write(DIM)
        self._shown += text
        self.stream.write(text)
        self.stream.flush()

    def end(self, *, fold: bool) -> None:
        """Thinking is over (the answer begins, or the output ended): with ``fold`` on a
        terminal, erase it and say how long it was; else close it with a newline."""
        if not self._open:
            return
        self._open = False
        words = len(self._shown.split())
        if self.tty:
            self.stream.write(RESET)
            if fold:
                self.stream.write(self._erase())
                self.stream.write(f"{DIM}(thought for {words} words){RESET}\n")
                self.stream.flush()
                self._shown = ""
                return
        self.stream.write("\n")
        self.stream.flush()
        self._shown = ""

    def _erase(self) -> str:
        """The escapes that take the cursor back to where the thinking began, clearing
        everything after it."""
        width = max(1, shutil.get_terminal_size().columns)
        rows = sum(max(1, -(-len(line) // width)) for line in self._shown.split("\n"))
        up = f"\x1b[{rows - 1}A" if rows > 1 else ""
        return f"\r{up}\x1b[J"
