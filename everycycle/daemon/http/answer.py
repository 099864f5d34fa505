"""One answer type for every HTTP dialect: the fold from a request's protocol events to
typed answer parts, and the whole answer they make.

A dialect never looks at protocol events. ``fold`` turns them, as they come, into parts —
``Queued``, ``Running``, ``Prefill``, ``Thinking``, ``Text``, ``Calls``, ``Finished``,
``Failed``, ``Vectors`` — each with the index of the choice it belongs to (OpenAI's ``n``
runs one protocol request per choice). A streamed answer shapes each part as it comes
(``Exchange.chunk``); a whole one is ``gather``\\ed into an ``Answer`` first. The finish
reason is an enum and the token counts one ``Usage``, so each dialect only names them in
its own words.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ...protocol import (
    Accepted,
    Embeddings,
    Error,
    Progress,
    ServerEvent,
    TokenLogprob,
    Tokens,
    ToolCall,
    ToolCalls,
)
from ..outcome import Outcome

T = TypeVar("T")
Events = AsyncIterator[tuple[ServerEvent, Outcome | None]]


class FinishReason(enum.Enum):
    """Why a generation ended, as the engine says it."""

    EOS = "eos"
    STOP = "stop"
    """A stop string matched."""
    LENGTH = "length"
    """``max_tokens`` reached."""
    CONTEXT = "context"
    """The context is full."""
    TOOL_CALLS = "tool_calls"

    @classmethod
    def of(cls, outcome: Outcome | None) -> FinishReason:
        """The outcome's reason (EOS when it names none we know)."""
        try:
            return cls(outcome.finish_reason if outcome is not None else "eos")
        except ValueError:
            return cls.EOS

    @property
    def truncated(self) -> bool:
        """Cut by a limit (tokens or context), not ended by the model."""
        return self in (FinishReason.LENGTH, FinishReason.CONTEXT)


@dataclass(frozen=True, slots=True)
class Usage:
    """What an answer cost in tokens: its prompt (``cached`` of them reused, not read
    again) and what it generated."""

    prompt: int = 0
    cached: int = 0
    generated: int = 0
    reasoning: int | None = None
    """Of ``generated``, the tokens thought (where a thinking budget counted them)."""
    drafted: int = 0
    """Draft tokens verified (speculative decoding), and those the model confirmed."""
    draft_accepted: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.generated

    @property
    def prefilled(self) -> int:
        """Prompt tokens read, the cached ones apart."""
        return self.prompt - self.cached

    @classmethod
    def of(cls, outcome: Outcome | None) -> Usage:
        if outcome is None:
            return cls()
        return cls(outcome.prompt_tokens, outcome.cached_tokens, outcome.generated_tokens,
                   outcome.reasoning_tokens, outcome.draft_tokens, outcome.draft_accepted)

    @classmethod
    def together(cls, usages: Sequence[Usage]) -> Usage:
        """The usage of choices answered together: their one prompt, all they generated."""
        if not usages:
            return cls()
        thought = [u.reasoning for u in usages if u.reasoning is not None]
        return cls(usages[0].prompt, usages[0].cached, sum(u.generated for u in usages),
                   sum(thought) if thought else None, sum(u.drafted for u in usages),
                   sum(u.draft_accepted for u in usages))


@dataclass(frozen=True, slots=True)
class Queued:
    """Waiting in its model's queue at ``position`` (1: next), to start in about
    ``eta_ms`` where the daemon estimated it."""

    position: int
    eta_ms: int | None = None
    index: int = 0
    prompt: int | None = None
    """The prompt's tokens, once known (not while the model loads)."""

    def eta(self) -> dict[str, Any]:
        """``{"eta_ms": N}`` to go beside the position, where there is an estimate."""
        return {} if self.eta_ms is None else {"eta_ms": self.eta_ms}


@dataclass(frozen=True, slots=True)
class Running:
    """It has a slot: generation begins."""

    index: int = 0
    prompt: int | None = None
    """The prompt's tokens."""


@dataclass(frozen=True, slots=True)
class Prefill:
    """How far the prompt has been read (for a request that asked for progress)."""

    total: int
    cached: int
    processed: int
    time_ms: int
    index: int = 0


@dataclass(frozen=True, slots=True)
class Thinking:
    text: str
    index: int = 0


@dataclass(frozen=True, slots=True)
class Text:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0
    ids: tuple[int, ...] = ()
    """The tokens the text came from."""


@dataclass(frozen=True, slots=True)
class Calls:
    """The tool calls the generation made (they come before it finishes)."""

    calls: tuple[ToolCall, ...]
    index: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    """One choice ended; ``last``: every choice of the answer has."""

    reason: FinishReason
    usage: Usage
    outcome: Outcome | None
    index: int = 0
    last: bool = True


@dataclass(frozen=True, slots=True)
class Failed:
    """The answer failed: the terminal Error (and how the request ended)."""

    error: Error
    outcome: Outcome | None


@dataclass(frozen=True, slots=True)
class Vectors:
    """An Embed's answer: one vector per input (a reranker's: its scores)."""

    vectors: tuple[tuple[float, ...], ...]
    usage: Usage
    outcome: Outcome | None


Part = Queued | Running | Prefill | Thinking | Text | Calls | Finished | Failed | Vectors


def ends(part: Part) -> bool:
    """True for the part after which the answer has nothing more."""
    return isinstance(part, Failed | Vectors) or (isinstance(part, Finished) and part.last)


async def fold(events: Events, ids: Sequence[str] = ()) -> AsyncIterator[Part]:
    """The answer's parts from its requests' events (``ids``: the request of each choice,
    in order), up to the part that ends it."""
    index = {rid: i for i, rid in enumerate(ids)}
    left = max(1, len(ids))
    async for event, outcome in events:
        i = index.get(getattr(event, "request_id", ""), 0)
        parts: list[Part] = []
        if isinstance(event, Tokens):
            chunk = event.chunk
            if chunk.reasoning:
                parts.append(Thinking(chunk.reasoning, i))
            if chunk.text or chunk.logprobs:
                parts.append(Text(chunk.text, chunk.logprobs or (), i, chunk.ids))
            if event.finished:
                left -= 1
                parts.append(Finished(FinishReason.of(outcome), Usage.of(outcome), outcome, i,
                                      last=left == 0))
        elif isinstance(event, Accepted):
            parts.append(Queued(event.queue_position, event.eta_ms, i, event.prompt_tokens)
                         if event.queue_position else Running(i, event.prompt_tokens))
        elif isinstance(event, ToolCalls):
            parts.append(Calls(event.calls, i))
        elif isinstance(event, Progress):
            parts.append(Prefill(event.total, event.cached, event.processed, event.time_ms, i))
        elif isinstance(event, Error):
            parts.append(Failed(event, outcome))
        elif isinstance(event, Embeddings):
            parts.append(Vectors(event.vectors, Usage.of(outcome), outcome))
        for part in parts:
            yield part
            if ends(part):
                return


@dataclass
class Choice:
    """One choice gathered whole."""

    text: str = ""
    reasoning: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    calls: tuple[ToolCall, ...] = ()
    finished: Finished | None = None

    @property
    def reason(self) -> FinishReason:
        return self.finished.reason if self.finished else FinishReason.EOS

    @property
    def usage(self) -> Usage:
        return self.finished.usage if self.finished else Usage()

    @property
    def outcome(self) -> Outcome | None:
        return self.finished.outcome if self.finished else None

    def parts(self, thought: Callable[[str], T], text: Callable[[str], T],
              call: Callable[[ToolCall], T]) -> list[T]:
        """The choice's content, each part shaped by its function, in the order every
        dialect gives it: the thoughts (if any), the text (even empty, unless there are
        tool calls), then each tool call."""
        out = [thought(self.reasoning)] if self.reasoning else []
        if self.text or not self.calls:
            out.append(text(self.text))
        out.extend(call(c) for c in self.calls)
        return out


@dataclass
class Answer:
    """An answer gathered whole: its choices, or its vectors, or how it failed."""

    choices: list[Choice]
    failed: Failed | None = None
    vectors: Vectors | None = None
    ended: bool = False
    """Whether it came to its end (else its events stopped first: the client left)."""

    @property
    def first(self) -> Choice:
        return self.choices[0]

    @property
    def usage(self) -> Usage:
        return Usage.together([c.usage for c in self.choices])


async def gather(parts: AsyncIterator[Part], n: int = 1) -> Answer:
    """The whole answer of ``n`` choices from its parts."""
    answer = Answer([Choice() for _ in range(max(1, n))])
    async for part in parts:
        answer.ended = ends(part)
        if isinstance(part, Failed):
            answer.failed = part
        elif isinstance(part, Vectors):
            answer.vectors = part
        elif isinstance(part, Queued | Running | Prefill):
            continue
        else:
            choice = answer.choices[part.index]
            if isinstance(part, Text):
                choice.text += part.text
                choice.logprobs.extend(part.logprobs)
                choice.ids.extend(part.ids)
            elif isinstance(part, Thinking):
                choice.reasoning += part.text
            elif isinstance(part, Calls):
                choice.calls = part.calls
            else:
                choice.finished = part
    return answer
