"""What the supervisor promises its peers: admission limits, the Peer contract, and the
Outcome each generation ends with (what metrics, the audit log and HTTP usage report)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..errors import ErrorKind
from ..protocol import MAX_TOKENS_LIMIT, Embed, Generate, ServerEvent
from .keys import LOCAL, Principal


@dataclass(frozen=True, slots=True)
class Limits:
    """Admission bounds; beyond them a request is Rejected (queues) or Invalid (sizes)."""

    max_queue: int = 64
    """Queued (not yet running) requests per model."""
    max_inflight: int = 32
    """Active requests per connection."""
    max_prompt_bytes: int = 512 * 1024
    max_tokens: int = MAX_TOKENS_LIMIT
    swap_after: float = 2.0
    """Seconds a load waits for memory busy models hold before they give way to it."""
    min_residency: float = 2.0
    """Seconds a model stays, taking requests, before it gives way to a load."""
    background_age: float = 120.0
    """Seconds background work may wait with none of it moving (interactive work keeps
    every slot) before its oldest request is served as an interactive one."""
    hang_timeout: float = 60.0
    """Seconds an engine with work in hand may make no progress before it is taken for
    hung: killed and restarted, its requests told why."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a Generate or Embed request ended."""

    request_id: str
    model: str
    executor: str | None
    kind: ErrorKind | None
    """None when the request finished; else the kind of its terminal Error."""
    finish_reason: str | None
    """The engine's reason when finished: eos, stop, length or context."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    reasoning_tokens: int | None = None
    """Of ``generated_tokens``, those thought (counted with a thinking budget)."""
    draft_tokens: int = 0
    """Draft tokens verified for it, and those the model confirmed."""
    draft_accepted: int = 0
    queue_wait_s: float = 0.0
    ttft_s: float | None = None
    duration_s: float = 0.0
    principal: str = LOCAL.name
    limit: str | None = None
    """The quota that refused it (a Rejected request), e.g. ``requests_per_minute``."""
    retry_after_s: float | None = None
    """When it was refused for a while: in how many seconds to try again."""
    tool_calls: int = 0
    """Tool calls it made (its finish reason is then ``tool_calls``)."""
    malformed_calls: int = 0
    """Tool calls that did not parse: they reached the client as text."""
    invalid_calls: int = 0
    """Tool calls whose arguments break their tool's whole schema, where its grammar
    enforced only part of it: returned as the model wrote them."""
    context_limit: int | None = None
    """Set when the prompt did not fit: the context's tokens (``prompt_tokens`` holds
    the prompt's), for the dialects' own "too long" errors."""
    lane: str = "interactive"
    """The lane it asked for: ``interactive`` or ``background``."""
    cancel_cause: str | None = None
    """Why it was cancelled (``events.CancelCause``'s value), when it was."""


class Peer(Protocol):
    """Whoever sent the request: receives its events without blocking."""

    allow_paths: bool

    @property
    def principal(self) -> Principal: ...

    def emit(self, event: ServerEvent, outcome: Outcome | None = None) -> None:
        """One event of a request. A Generate or Embed request's terminal event comes
        with its ``outcome``; every other event comes without one."""


def prompt_bytes(req: Generate | Embed) -> int:
    """The UTF-8 size of what ``req`` asks the model to read."""
    if isinstance(req, Embed):
        return sum(len(text.encode("utf-8")) for text in (*req.input, req.query or ""))
    if req.messages is not None:
        return sum(len(m.text.encode("utf-8")) for m in req.messages)
    if req.prompt_tokens is not None:
        return 4 * len(req.prompt_tokens)  # (as a token's text is, on average)
    size = len((req.prompt or "").encode("utf-8"))
    if req.infill is not None:
        size += sum(len(t.encode("utf-8")) for t in (
            req.infill.suffix, req.infill.middle,
            *(c.filename + c.text for c in req.infill.extra)))
    return size
