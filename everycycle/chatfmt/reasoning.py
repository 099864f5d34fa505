"""Reasoning: a model's thinking, split from its answer as the output streams.

Thinking is one section at the start of the output, between an open and a close marker
(``<think>``/``</think>`` for DeepSeek-R1 and Qwen3, ``<thinking>``/``</thinking>``,
``[THINK]``/``[/THINK]`` for Magistral). Templates such as DeepSeek-R1's end the prompt
with the open marker, so the output starts inside the section (``starts_inside``) and
holds only the close marker. Whitespace around the reasoning, and between it and the
answer, is dropped. (gpt-oss's ``<|channel|>`` sections are not handled here.)
"""

from __future__ import annotations

import enum

from ..errors import InvalidRequestError
from .template import template_variables


class ReasoningFormat(enum.Enum):
    """A pair of thinking markers: ``open`` and ``close``."""

    THINK = ("<think>", "</think>")
    THINKING = ("<thinking>", "</thinking>")
    MAGISTRAL = ("[THINK]", "[/THINK]")

    @property
    def open(self) -> str:
        return self.value[0]

    @property
    def close(self) -> str:
        return self.value[1]


def detect(template_source: str | None) -> ReasoningFormat | None:
    """The thinking markers a chat template uses, or None when it uses none."""
    src = template_source or ""
    for fmt in ReasoningFormat:
        if fmt.open in src or fmt.close in src:
            return fmt
    return None


def starts_inside(rendered_prompt: str, fmt: ReasoningFormat | None = None) -> bool:
    """Whether the prompt ends with an open marker (``fmt``'s, or any), whitespace aside:
    then the output begins inside the thinking section."""
    tail = rendered_prompt.rstrip()
    return any(tail.endswith(f.open) for f in ([fmt] if fmt else list(ReasoningFormat)))


def accepts_enable_thinking(template_source: str) -> bool:
    """Whether the template reads an ``enable_thinking`` variable (Qwen3 and kin)."""
    try:
        return "enable_thinking" in template_variables(template_source)
    except InvalidRequestError:
        return "enable_thinking" in template_source


class _State(enum.Enum):
    START = enum.auto()  # before any output: an open marker may come
    OPENED = enum.auto()  # inside, before any reasoning text (a repeated open is dropped)
    INSIDE = enum.auto()  # reasoning text, until the close marker
    CLOSED = enum.auto()  # after the close marker, before any answer text
    ANSWER = enum.auto()  # everything left is the answer


def _partial_suffix(text: str, word: str) -> int:
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits streamed output into (reasoning, answer) pieces, holding back text that
    could begin a marker until it proves not to."""

    def __init__(self, fmt: ReasoningFormat, *, starts_inside: bool = False) -> None:
        self.fmt = fmt
        self._state = _State.OPENED if starts_inside else _State.START
        self._buf = ""
        self._held_ws = ""
        self._reasoning: list[str] = []
        self._answer: list[str] = []
        self._final = False

    def feed(self, piece: str) -> tuple[str, str]:
        """Take the next piece; return the (reasoning, answer) text it settles."""
        if self._final:
            raise ValueError("feed after finish")
        self._buf += piece
        return self._run()

    def finish(self) -> tuple[str, str]:
        """End of output: settle what was held back (an unclosed section is reasoning)."""
        if self._final:
            return "", ""
        self._final = True
        return self._run()

    def _run(self) -> tuple[str, str]:
        while self._buf and self._step():
            pass
        out = "".join(self._reasoning), "".join(self._answer)
        self._reasoning, self._answer = [], []
        return out

    def _think(self, text: str) -> None:
        held = self._held_ws + text
        core = held.rstrip()
        self._held_ws = held[len(core):]
        if core:
            self._reasoning.append(core)

    def _step(self) -> bool:
        fmt, buf = self.fmt, self._buf
        stripped = buf.lstrip()
        if self._state in (_State.START, _State.OPENED, _State.CLOSED):
            if not stripped and not self._final:
                return False
            if self._state is _State.CLOSED:
                self._buf, self._state = stripped, _State.ANSWER
                return True
            if stripped.startswith(fmt.open):
                self._buf = stripped[len(fmt.open):]
                self._state = _State.OPENED
                return True
            if fmt.open.startswith(stripped) and not self._final:
                return False
            if self._state is _State.START:
                self._state = _State.ANSWER
            else:
                self._buf, self._state = stripped, _State.INSIDE
            return True
        if self._state is _State.INSIDE:
            at = buf.find(fmt.close)
            if at >= 0:
                self._think(buf[:at])
                self._held_ws = ""
                self._buf, self._state = buf[at + len(fmt.close):], _State.CLOSED
                return True
            keep = 0 if self._final else _partial_suffix(buf, fmt.close)
            if keep == len(buf):
                return False
            self._think(buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return True
        self._answer.append(buf)
        self._buf = ""
        return True


def split(text: str, fmt: ReasoningFormat, *, starts_inside: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of a whole output."""
    splitter = ReasoningSplitter(fmt, starts_inside=starts_inside)
    first = splitter.feed(text)
    last = splitter.finish()
    return first[0] + last[0], first[1] + last[1]
