"""Daemon → client events: the seed's four, and the extensions (Done, Embeddings, Usage).

Fields marked ``skip_none`` are everycycle extensions: written only when set, so the
seed's own lines still round-trip byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import ErrorKind
from .requests import ToolCall
from .toolhost import ToolList, ToolResult
from .validation import COUNT, TOKEN_ID_MAX, U32, check_range, check_text, message
from .validation import validate_request_id as _validate_request_id

_EXT = {"skip_none": True}


@message(ranges={"queue_position": U32, "eta_ms": U32})
class Accepted:
    """The request was admitted; ``queue_position`` requests are ahead of it, and (an
    extension, while it waits) it should start in about ``eta_ms`` ms, as its model's
    measured rates predict."""

    request_id: str
    queue_position: int
    eta_ms: int | None = field(default=None, metadata=_EXT)
    prompt_tokens: int | None = field(default=None, metadata=_EXT)
    """The prompt's tokens, once it is read into tokens (an extension: absent while
    its model loads)."""


@message()
class TopLogprob:
    """One of the likeliest tokens at a position, and its log-probability."""

    token: str
    logprob: float
    id: int | None = field(default=None, metadata=_EXT)
    """The token's id (an extension)."""


@message()
class TokenLogprob:
    """A generated token's text and log-probability under the model (its raw logits),
    and the likeliest tokens there (an extension: ``Generate.logprobs``)."""

    token: str
    logprob: float
    top: tuple[TopLogprob, ...]


# TokenChunk and Tokens go out once per decode step per stream: their checks are written
# out by hand, the cheapest that says the same as the shared ones.


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Generated text and the token ids it came from; ``text`` is whole UTF-8.

    For a model that thinks before it answers, ``reasoning`` (an extension, absent when
    empty) carries the thinking and ``text`` only the answer; with tools, the text of a
    call is not in either: the calls come in a ``ToolCalls`` event."""

    text: str
    ids: tuple[int, ...]
    reasoning: str | None = field(default=None, metadata=_EXT)
    logprobs: tuple[TokenLogprob, ...] | None = field(default=None, metadata=_EXT)
    """One per id, for a Generate that asked (``logprobs``)."""

    def __post_init__(self) -> None:
        if not self.text.isascii():
            check_text("text", self.text)
        if self.reasoning is not None and not self.reasoning.isascii():
            check_text("reasoning", self.reasoning)
        if self.ids and not 0 <= min(self.ids) <= max(self.ids) <= TOKEN_ID_MAX:
            for i in self.ids:
                check_range("token id", i, 0, TOKEN_ID_MAX)


@dataclass(frozen=True, slots=True)
class Tokens:
    """A chunk of generated text; the last one of a request has ``finished``."""

    request_id: str
    chunk: TokenChunk
    finished: bool

    def __post_init__(self) -> None:
        _validate_request_id(self.request_id)  # ASCII; the chunk checked its own text


@message(ranges={"device_count": U32, "memory_total": COUNT, "memory_free": COUNT})
class ExecutorSummary:
    """One ggml backend and its devices, as the fleet reports it."""

    name: str
    vendor: str
    device_count: int
    memory_total: int | None = field(default=None, metadata=_EXT)
    memory_free: int | None = field(default=None, metadata=_EXT)
    status: str | None = field(default=None, metadata=_EXT)
    """``unreachable`` for a remote executor that cannot be reached; absent when fine."""


@message(names=(), ranges={"drafted": COUNT, "accepted": COUNT})
class DraftTokens:
    """One speculative method's draft tokens the model verified so far, and those it
    confirmed: ``forced`` (a grammar's forced tokens), ``lookup`` (prompt lookup),
    ``mtp`` (the model's own MTP heads), ``model`` (a draft model)."""

    method: str
    drafted: int
    accepted: int


@message(names=(), ranges={
    "slots": U32, "busy": U32, "queued": U32, "device_layers": U32, "total_layers": U32,
    "unload_in_ms": COUNT, "keep_alive_ms": (-1, COUNT[1]), "weights_bytes": COUNT,
    "kv_bytes": COUNT, "engine_pid": COUNT, "engine_rss": COUNT, "engine_restarts": COUNT,
    "prompt_cache_bytes": COUNT, "prompt_cache_hits": COUNT, "prompt_cache_evictions": COUNT,
    "context": COUNT})
class LoadedModel:
    """A model resident on an executor; ``revision`` is its pinned commit, if any."""

    name: str
    revision: str | None
    assigned_executor: str
    slots: int | None = field(default=None, metadata=_EXT)
    busy: int | None = field(default=None, metadata=_EXT)
    queued: int | None = field(default=None, metadata=_EXT)
    weights_bytes: int | None = field(default=None, metadata=_EXT)
    kv_bytes: int | None = field(default=None, metadata=_EXT)
    lookup: bool | None = field(default=None, metadata=_EXT)
    """Whether greedy requests use prompt lookup by default: on unless models.toml says
    otherwise or this model's batched decoding is not bit-exact on this build."""
    drafts: tuple[DraftTokens, ...] | None = field(default=None, metadata=_EXT)
    """Each speculative method's draft tokens so far (the methods this model has)."""
    draft_model: str | None = field(default=None, metadata=_EXT)
    """Its draft model (speculative decoding; absent: none)."""
    images_encoded: int | None = field(default=None, metadata=_EXT)
    """Images its vision projector encoded (absent: it has none)."""
    device_layers: int | None = field(default=None, metadata=_EXT)
    """Repeating layers on the executor's devices (the rest on the CPU); GPU only."""
    total_layers: int | None = field(default=None, metadata=_EXT)
    unload_in_ms: int | None = field(default=None, metadata=_EXT)
    """When the model will be unloaded for being idle; absent: never, or busy now."""
    keep_alive_ms: int | None = field(default=None, metadata=_EXT)
    """How long it stays loaded once idle (-1: always)."""
    engine_pid: int | None = field(default=None, metadata=_EXT)
    """The process id of its engine process (absent in embedded mode)."""
    engine_rss: int | None = field(default=None, metadata=_EXT)
    """Its engine process's resident memory, in bytes."""
    engine_restarts: int | None = field(default=None, metadata=_EXT)
    """How many times its engine was restarted after dying."""
    engine_exit: str | None = field(default=None, metadata=_EXT)
    """How its engine last died, e.g. ``SIGILL (illegal instruction)``."""
    state: str | None = field(default=None, metadata=_EXT)
    """``loading`` while it loads (``queued``: the requests waiting for it),
    ``restarting`` while its engine restarts, ``failed`` after a crash loop (until
    ``Load``); absent while it serves."""
    prompt_cache_bytes: int | None = field(default=None, metadata=_EXT)
    """Host RAM its prompt cache holds (conversations its slots gave up)."""
    prompt_cache_hits: int | None = field(default=None, metadata=_EXT)
    """Prompts restored from its prompt cache (RAM or disk) since it loaded."""
    prompt_cache_evictions: int | None = field(default=None, metadata=_EXT)
    """Conversations its prompt cache moved out of RAM (to disk, or gone)."""
    held_by: str | None = field(default=None, metadata=_EXT)
    """While its load waits for memory: who holds it (``'b' (300 MiB, busy)``); its
    ``state`` says the same in a sentence."""
    context: int | None = field(default=None, metadata=_EXT)
    """Tokens a slot, as loaded (models.toml's ``context``, or chosen from what the
    model was trained for and the memory it has)."""
    lora: tuple[str, ...] | None = field(default=None, metadata=_EXT)
    """Its LoRA adapters as ``FILE@SCALE``, in their order (the scales requests get
    unless they name their own)."""

    def drafted(self, method: str) -> tuple[int, int]:
        """The draft tokens ``method`` made that were verified so far, and those the
        model confirmed ((0, 0) where it made none)."""
        found = next((d for d in self.drafts or () if d.method == method), None)
        return (found.drafted, found.accepted) if found is not None else (0, 0)


@message(names=(), ranges={"age_ms": COUNT, "tokens": COUNT, "eta_ms": COUNT})
class ActiveRequest:
    """One request running or queued: what ``everycycle cancel`` needs to find it."""

    request_id: str
    model: str
    principal: str
    state: str
    """``loading`` (waiting for its model to load), ``admitting``, ``queued`` or
    ``running``."""
    age_ms: int
    tokens: int
    """Tokens generated so far."""
    lane: str | None = field(default=None, metadata=_EXT)
    """``interactive`` or ``background`` (an extension)."""
    eta_ms: int | None = field(default=None, metadata=_EXT)
    """A queued request's estimated start, from now (an extension)."""


@message(ranges={"active_requests": U32})
class PrincipalLoad:
    """One principal's active (running + queued) requests."""

    name: str
    active_requests: int


@message(ranges={"active_requests": U32, "daemon_rss": COUNT})
class FleetSnapshot:
    """The daemon's executors, resident models and active (running + queued) requests."""

    hostname: str
    executors: tuple[ExecutorSummary, ...]
    loaded_models: tuple[LoadedModel, ...]
    active_requests: int
    http: str | None = field(default=None, metadata=_EXT)
    """Where the daemon serves its HTTP API (``http://HOST:PORT``), if it does."""
    daemon_rss: int | None = field(default=None, metadata=_EXT)
    """The daemon process's resident memory, in bytes."""
    principals: tuple[PrincipalLoad, ...] | None = field(default=None, metadata=_EXT)
    """Active requests per principal; present when more than one principal is active."""
    rpc: bool | None = field(default=None, metadata=_EXT)
    """Whether the daemon's llama.cpp has the RPC backend (remote executors)."""
    requests: tuple[ActiveRequest, ...] | None = field(default=None, metadata=_EXT)
    """The active requests, oldest first (the first 100)."""
    cpu_kernels: str | None = field(default=None, metadata=_EXT)
    """Why the CPU's extra kernels (AMX, repacked weights) are off, when they are."""
    last_eviction: str | None = field(default=None, metadata=_EXT)
    """The last model unloaded to make room for another, in a line."""
    state: str | None = field(default=None, metadata=_EXT)
    """Whether it takes new work: ``ready``, ``loading`` (its only model, as llama-server
    says while it loads) or ``draining`` (finishing its work before it stops)."""


@dataclass(frozen=True, slots=True)
class FleetDescription:
    """Answer to DescribeFleet (a newtype around FleetSnapshot: no request id)."""

    snapshot: FleetSnapshot
    newtype: ClassVar[bool] = True


@message(empty_id=True)
class Error:
    """Terminal failure of a request; ``request_id`` is "" when none could be read."""

    request_id: str
    kind: ErrorKind
    message: str


@message()
class Done:
    """Terminal success of Load, Unload, Cancel and Shutdown (an extension)."""

    request_id: str


@message()
class Embeddings:
    """Terminal success of Embed: one vector per input, in input order (an extension)."""

    request_id: str
    vectors: tuple[tuple[float, ...], ...]


@message(ranges={"prompt_tokens": COUNT, "cached_tokens": COUNT, "generated_tokens": COUNT,
                 "reasoning_tokens": COUNT, "draft_n": COUNT, "draft_n_accepted": COUNT})
class Usage:
    """What a finished generation cost, just before its last Tokens (an extension, sent
    only to a Generate that asked for it with ``usage: true``)."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens reused from the slot's cache (not prefilled again)."""
    generated_tokens: int
    finish_reason: str
    """``eos``, ``stop``, ``length`` (max_tokens) or ``context`` (the context is full)."""
    reasoning_tokens: int | None = field(default=None, metadata=_EXT)
    """Of ``generated_tokens``, those a thinking model thought (an extension; with a
    thinking budget, where the engine counts them)."""
    draft_n: int | None = field(default=None, metadata=_EXT)
    """Draft tokens verified for it (a draft model's, prompt lookup's, a grammar's), and
    those the model confirmed (llama-server's ``timings.draft_n``, ``draft_n_accepted``;
    an extension, absent where nothing drafted)."""
    draft_n_accepted: int | None = field(default=None, metadata=_EXT)


@message(ranges={"total": COUNT, "cached": COUNT, "processed": COUNT, "time_ms": COUNT})
class Progress:
    """How far the prompt has been read (an extension, sent only to a Generate that
    asked with ``progress: true``): at the start, then after each batch of it, until the
    first token comes. Tokens ``cached`` were reused, not read again."""

    request_id: str
    total: int
    cached: int
    processed: int
    """Prompt tokens in the slot now, the cached ones included."""
    time_ms: int
    """Since the request was admitted."""


@message()
class ToolCalls:
    """The tool calls a finished generation made, just before its last Tokens (an
    extension, for a Generate with ``tools``)."""

    request_id: str
    calls: tuple[ToolCall, ...]


@message()
class Notice:
    """One daemon event for a Subscribe (an extension): its ``type`` (``request``,
    ``model_loaded``, …) and ``data``, the event as a JSON object's text (what
    ``GET /v1/events`` sends as its ``data``)."""

    request_id: str
    type: str
    data: str


ServerEvent = (Accepted | Tokens | FleetDescription | Error | Done | Embeddings | Usage
               | ToolCalls | Progress | Notice | ToolList | ToolResult)

EVENTS: dict[str, type[ServerEvent]] = {
    c.__name__: c for c in (Accepted, Tokens, FleetDescription, Error, Done, Embeddings, Usage,
                            ToolCalls, Progress, Notice, ToolList, ToolResult)
}


def is_terminal(event: ServerEvent) -> bool:
    """True for the one event that ends a request."""
    if isinstance(event, Tokens):
        return event.finished
    return not isinstance(event, Accepted | Usage | ToolCalls | Progress | Notice)
