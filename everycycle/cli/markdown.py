"""A streamed answer rendered as Markdown on a terminal (Rich): code blocks
highlighted, lists and headings laid out, as the text arrives.

Finished blocks (up to a blank line outside a code fence) are printed once, for good;
only the block still arriving is redrawn in place (a transient Live), so scrollback
holds each block exactly once and the screen never flickers over the whole answer.
Imported only by ``chat`` on a terminal.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live

__all__ = ["MarkdownStream", "finished_blocks", "tail"]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
REDRAW_S = 0.05
"""The block still arriving is redrawn at most this often (a fast model's tokens would
otherwise each cost a render, and a slow terminal would hold the stream back)."""


def tail(text: str, lines: int, chars: int) -> str:
    """The end of a block that fits the screen while it arrives: its last ``lines``
    lines and at most ``chars`` characters of them, still Markdown (an open code fence
    cut off above is opened again)."""
    every = text.split("\n")
    if len(every) <= lines and len(text) <= chars:
        return text
    lines = min(lines, len(every))
    fence: str | None = None
    opening = ""
    for line in every[:-lines]:
        mark = FENCE.match(line)
        if fence is None and mark:
            fence, opening = mark.group(1)[0] * 3, line
        elif fence is not None and mark and mark.group(1).startswith(fence):
            fence = None
    shown = "\n".join(every[-lines:])
    if len(shown) > chars:
        shown = "…" + shown[-chars:]
    return f"{opening}\n{shown}" if fence is not None else shown


def finished_blocks(text: str) -> int:
    """How much of ``text`` is whole blocks: the end of its last blank line outside a
    fenced code block (0 when none is finished yet)."""
    fence: str | None = None
    cut = 0
    pos = 0
    seen_content = False
    for line in text.splitlines(keepends=True):
        pos += len(line)
        if not line.endswith("\n"):
            break  # (a line still arriving)
        mark = FENCE.match(line)
        if fence is None and mark:
            fence = mark.group(1)[0] * 3
        elif fence is not None and mark and mark.group(1).startswith(fence):
            fence = None
        elif fence is None and not line.strip() and seen_content:
            cut = pos
            continue
        seen_content = True
    return cut


class MarkdownStream:
    """Writes an answer as Markdown to a terminal, block by block."""

    def __init__(self, out: TextIO) -> None:
        from rich.console import Console

        self._console: Console = Console(file=out, force_terminal=True, highlight=False)
        self._pending = ""
        self._live: Live | None = None
        self._drawn = 0.0

    def write(self, text: str) -> None:
        self._pending += text
        cut = finished_blocks(self._pending)
        if cut:
            done, self._pending = self._pending[:cut], self._pending[cut:]
            self._print(done)
        if self._pending.strip() and time.monotonic() - self._drawn >= REDRAW_S:
            self._redraw()

    def end(self) -> None:
        """The answer is over (or was stopped): what is left, printed for good."""
        if self._pending.strip():
            self._print(self._pending)
        else:
            self._stop()
        self._pending = ""

    def _print(self, block: str) -> None:
        from rich.markdown import Markdown

        self._stop()
        self._console.print(Markdown(block.strip("\n")))
        self._console.print()

    def _redraw(self) -> None:
        from rich.live import Live
        from rich.markdown import Markdown

        if self._live is None:
            self._live = Live(console=self._console, transient=True, auto_refresh=False,
                              vertical_overflow="crop")
            self._live.start()
        rows = max(4, self._console.size.height - 2)
        shown = tail(self._pending, rows, rows * max(20, self._console.size.width - 4) // 2)
        self._live.update(Markdown(shown), refresh=True)
        self._drawn = time.monotonic()

    def _stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
