"""One request's output, as it streams, split into the answer, the model's thinking and
its tool calls (the formats its ChatPrompt named). No I/O; the supervisor runs one per
request that needs it."""

from __future__ import annotations

from collections.abc import Collection

from ..protocol import ToolCall
from .chat import ChatPrompt
from .reasoning import ReasoningFormat, ReasoningSplitter
from .schemacheck import ArgumentCheck
from .toolparse import CallDelta, StreamParser, TextDelta
from .tools import ToolFormat


class ChatOutput:
    """Feeds on the generated text; gives back (answer, reasoning) pieces to send now,
    and at the end the tool calls and how many were malformed."""

    def __init__(self, prompt: ChatPrompt, tool_names: Collection[str] | None,
                 check: ArgumentCheck | None = None) -> None:
        self._thinking = (ReasoningSplitter(ReasoningFormat[prompt.reasoning],
                                            starts_inside=prompt.starts_inside)
                          if prompt.reasoning else None)
        self._tools = (StreamParser(ToolFormat[prompt.tool_format], names=tool_names)
                       if prompt.tool_format and tool_names else None)
        self.calls: list[ToolCall] = []
        self._check = check
        self.invalid: list[str] = []
        """Calls whose arguments break their tool's schema where its grammar did not
        enforce all of it (``schemacheck``): why, one line each. They are returned as
        the model wrote them."""
        self._args: dict[int, list[str]] = {}
        self._heads: dict[int, tuple[str, str]] = {}

    @staticmethod
    def needed(prompt: ChatPrompt, tool_names: Collection[str] | None) -> bool:
        """Whether a request's output needs splitting at all."""
        return bool(prompt.reasoning or (prompt.tool_format and tool_names))

    def feed(self, text: str) -> tuple[str, str]:
        """(answer, reasoning) that ``text`` settles."""
        return self._through(text, final=False)

    def finish(self) -> tuple[str, str]:
        """(answer, reasoning) held back until the end; then ``calls`` and
        ``malformed`` are complete."""
        answer, thought = self._through("", final=True)
        for index in sorted(self._heads):
            call_id, name = self._heads[index]
            self.calls.append(ToolCall(call_id, name, "".join(self._args[index])))
            problem = self._check.problem(name, self.calls[-1].arguments) if self._check else None
            if problem is not None:
                self.invalid.append(f"'{name}': {problem}")
        return answer, thought

    @property
    def malformed(self) -> int:
        """Calls that did not parse (or named no tool): they came back as answer text."""
        return self._tools.malformed if self._tools is not None else 0

    def _through(self, text: str, *, final: bool) -> tuple[str, str]:
        thought = ""
        if self._thinking is not None:
            thought, text = self._thinking.finish() if final else self._thinking.feed(text)
        if self._tools is None:
            return text, thought
        deltas = self._tools.feed(text) if text else []
        if final:
            deltas += self._tools.finish()
        answer: list[str] = []
        for d in deltas:
            if isinstance(d, TextDelta):
                answer.append(d.text)
            elif isinstance(d, CallDelta):
                if d.name is not None:
                    self._heads[d.index] = (d.id or "", d.name)
                self._args.setdefault(d.index, []).append(d.arguments)
        return "".join(answer), thought
