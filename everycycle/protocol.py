"""The wire protocol: requests, events, and their one-line JSON encoding. No I/O.

Every message is a frozen dataclass whose constructor validates it, so an object
that exists is an object that may go on the wire. ``encode`` turns one into a line
of bytes exactly as serde_json encodes the seed's Rust types (externally tagged
enums, ``Option`` as value-or-null, newtypes as their inner value, compact
separators, UTF-8); ``decode_request`` / ``decode_event`` turn one line back, and
raise :class:`~everycycle.errors.ProtocolError` (kind Invalid, carrying the
request id when one could be read) for anything else. ``LineFramer`` splits a byte
stream into lines and enforces the 1 MiB limit.

Rules the decoder follows, serde's own:
  * unknown fields are ignored; a missing required field is an error;
  * an ``Option`` field may be absent or ``null``;
  * a duplicate field, a bool where a number is wanted, NaN/Infinity, lone
    surrogates, or a top-level object with other than one key are errors.
Fields marked ``skip_none`` are everycycle extensions: written only when set, so the
seed's own lines still round-trip byte for byte.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

from .errors import ErrorKind, LineTooLongError, ProtocolError

__all__ = [
    "MAX_EMBED_INPUTS",
    "MAX_LINE_BYTES",
    "MAX_TOKENS_LIMIT",
    "Accepted",
    "ActiveRequest",
    "Auth",
    "Cancel",
    "DescribeFleet",
    "Done",
    "Embed",
    "Embeddings",
    "Error",
    "ErrorKind",
    "ExecutorSummary",
    "FleetDescription",
    "FleetSnapshot",
    "Format",
    "Generate",
    "LineFramer",
    "Load",
    "LoadedModel",
    "Message",
    "PrincipalLoad",
    "Request",
    "Role",
    "ServerEvent",
    "Shutdown",
    "TokenChunk",
    "Tokens",
    "Unload",
    "Usage",
    "check_model_name",
    "decode_event",
    "decode_request",
    "encode",
    "is_terminal",
    "validate_request_id",
]

MAX_LINE_BYTES = 1 << 20
"""Longest line (excluding the newline) either side may send."""

MAX_TOKENS_LIMIT = 32768
_U32_MAX = 2**32 - 1
_TOKEN_ID_MAX = 2**31 - 1
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_MAX_NAME = 256
_MAX_STOPS = 16
_MAX_STOP_CHARS = 256
_MAX_KEEP_ALIVE_MS = 10**12
_MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000
_MAX_MESSAGES = 4096
_MAX_GRAMMAR_CHARS = 64 * 1024
MAX_EMBED_INPUTS = 2048


def validate_request_id(value: str) -> str:
    """Return ``value`` if it is a valid RequestId; raises ProtocolError otherwise."""
    if not _REQUEST_ID.fullmatch(value):
        raise ProtocolError("request_id must be 1-64 characters of [A-Za-z0-9._:-]")
    return value


def _check_range(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number")
    if not lo <= value <= hi:
        lo_s = int(lo) if float(lo).is_integer() else lo
        hi_s = int(hi) if float(hi).is_integer() else hi
        raise ProtocolError(f"{name} must be between {lo_s} and {hi_s}")


def _check_text(message: object) -> None:
    """Every string field must be encodable as UTF-8 (no lone surrogates)."""
    for name, _ in _fields(type(message)):
        value = getattr(message, name)
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if isinstance(v, str) and not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise ProtocolError(f"{name} is not valid Unicode") from None


def check_model_name(name: str) -> str:
    """``name`` if a request can name it (1-256 characters, no control characters).
    Raises ProtocolError."""
    _check_name("model", name)
    return name


def _check_name(what: str, value: str) -> None:
    if not 1 <= len(value) <= _MAX_NAME:
        raise ProtocolError(f"{what} must be 1-{_MAX_NAME} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ProtocolError(f"{what} must not contain control characters")


class Format(enum.Enum):
    """How a Generate prompt is turned into tokens."""

    CHAT = "chat"
    """Apply the model's own chat template (the default where the GGUF has one)."""
    RAW = "raw"
    """Tokenize the prompt as is."""


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Accepted:
    """The request was admitted; ``queue_position`` requests are ahead of it."""

    request_id: str
    queue_position: int

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)
        _check_range("queue_position", self.queue_position, 0, _U32_MAX)


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """Generated text and the token ids it came from; ``text`` is whole UTF-8."""

    text: str
    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.text.isascii():
            _check_text(self)
        if self.ids and not 0 <= min(self.ids) <= max(self.ids) <= _TOKEN_ID_MAX:
            for i in self.ids:
                _check_range("token id", i, 0, _TOKEN_ID_MAX)


@dataclass(frozen=True, slots=True)
class Tokens:
    """A chunk of generated text; the last one of a request has ``finished``."""

    request_id: str
    chunk: TokenChunk
    finished: bool

    def __post_init__(self) -> None:
        validate_request_id(self.request_id)  # ASCII; the chunk checked its own text


@dataclass(frozen=True, slots=True)
class ExecutorSummary:
    """One ggml backend and its devices, as the fleet reports it."""

    name: str
    vendor: str
    device_count: int
    memory_total: int | None = field(default=None, metadata={"skip_none": True})
    memory_free: int | None = field(default=None, metadata={"skip_none": True})
    status: str | None = field(default=None, metadata={"skip_none": True})
    """``unreachable`` for a remote executor that cannot be reached; absent when fine."""

    def __post_init__(self) -> None:
        _check_text(self)
        _check_range("device_count", self.device_count, 0, _U32_MAX)
        _check_range("memory_total", self.memory_total, 0, 2**63 - 1)
        _check_range("memory_free", self.memory_free, 0, 2**63 - 1)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model resident on an executor; ``revision`` is its pinned commit, if any."""

    name: str
    revision: str | None
    assigned_executor: str
    slots: int | None = field(default=None, metadata={"skip_none": True})
    busy: int | None = field(default=None, metadata={"skip_none": True})
    queued: int | None = field(default=None, metadata={"skip_none": True})
    weights_bytes: int | None = field(default=None, metadata={"skip_none": True})
    kv_bytes: int | None = field(default=None, metadata={"skip_none": True})
    lookup: bool | None = field(default=None, metadata={"skip_none": True})
    """Whether greedy requests use prompt lookup by default: on unless models.toml says
    otherwise or this model's batched decoding is not bit-exact on this build."""
    lookup_drafted: int | None = field(default=None, metadata={"skip_none": True})
    """Prompt-lookup draft tokens proposed so far, and those the model confirmed."""
    lookup_accepted: int | None = field(default=None, metadata={"skip_none": True})
    device_layers: int | None = field(default=None, metadata={"skip_none": True})
    """Repeating layers on the executor's devices (the rest on the CPU); GPU only."""
    total_layers: int | None = field(default=None, metadata={"skip_none": True})
    unload_in_ms: int | None = field(default=None, metadata={"skip_none": True})
    """When the model will be unloaded for being idle; absent: never, or busy now."""
    keep_alive_ms: int | None = field(default=None, metadata={"skip_none": True})
    """How long it stays loaded once idle (-1: always)."""
    engine_pid: int | None = field(default=None, metadata={"skip_none": True})
    """The process id of its engine process (absent in embedded mode)."""
    engine_rss: int | None = field(default=None, metadata={"skip_none": True})
    """Its engine process's resident memory, in bytes."""
    engine_restarts: int | None = field(default=None, metadata={"skip_none": True})
    """How many times its engine was restarted after dying."""
    engine_exit: str | None = field(default=None, metadata={"skip_none": True})
    """How its engine last died, e.g. ``SIGILL (illegal instruction)``."""
    state: str | None = field(default=None, metadata={"skip_none": True})
    """``restarting`` while its engine restarts, ``failed`` after a crash loop (until
    ``Load``); absent while it serves."""

    def __post_init__(self) -> None:
        _check_text(self)
        for name in ("slots", "busy", "queued", "device_layers", "total_layers"):
            _check_range(name, getattr(self, name), 0, _U32_MAX)
        _check_range("unload_in_ms", self.unload_in_ms, 0, 2**63 - 1)
        _check_range("keep_alive_ms", self.keep_alive_ms, -1, 2**63 - 1)
        for name in ("weights_bytes", "kv_bytes", "engine_pid", "engine_rss",
                     "engine_restarts"):
            _check_range(name, getattr(self, name), 0, 2**63 - 1)


@dataclass(frozen=True, slots=True)
class ActiveRequest:
    """One request running or queued: what ``everycycle cancel`` needs to find it."""

    request_id: str
    model: str
    principal: str
    state: str
    """``admitting``, ``queued`` or ``running``."""
    age_ms: int
    tokens: int
    """Tokens generated so far."""

    def __post_init__(self) -> None:
        _check_text(self)
        _check_range("age_ms", self.age_ms, 0, 2**63 - 1)
        _check_range("tokens", self.tokens, 0, 2**63 - 1)


@dataclass(frozen=True, slots=True)
class PrincipalLoad:
    """One principal's active (running + queued) requests."""

    name: str
    active_requests: int

    def __post_init__(self) -> None:
        _check_text(self)
        _check_range("active_requests", self.active_requests, 0, _U32_MAX)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """The daemon's executors, resident models and active (running + queued) requests."""

    hostname: str
    executors: tuple[ExecutorSummary, ...]
    loaded_models: tuple[LoadedModel, ...]
    active_requests: int
    http: str | None = field(default=None, metadata={"skip_none": True})
    """Where the daemon serves its HTTP API (``http://HOST:PORT``), if it does."""
    daemon_rss: int | None = field(default=None, metadata={"skip_none": True})
    """The daemon process's resident memory, in bytes."""
    principals: tuple[PrincipalLoad, ...] | None = field(default=None,
                                                          metadata={"skip_none": True})
    """Active requests per principal; present when more than one principal is active."""
    rpc: bool | None = field(default=None, metadata={"skip_none": True})
    """Whether the daemon's llama.cpp has the RPC backend (remote executors)."""
    requests: tuple[ActiveRequest, ...] | None = field(default=None,
                                                      metadata={"skip_none": True})
    """The active requests, oldest first (the first 100)."""
    cpu_kernels: str | None = field(default=None, metadata={"skip_none": True})
    """Why the CPU's extra kernels (AMX, repacked weights) are off, when they are."""

    def __post_init__(self) -> None:
        _check_text(self)
        _check_range("active_requests", self.active_requests, 0, _U32_MAX)
        _check_range("daemon_rss", self.daemon_rss, 0, 2**63 - 1)


@dataclass(frozen=True, slots=True)
class FleetDescription:
    """Answer to DescribeFleet (a newtype around FleetSnapshot: no request id)."""

    snapshot: FleetSnapshot
    newtype: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class Error:
    """Terminal failure of a request; ``request_id`` is "" when none could be read."""

    request_id: str
    kind: ErrorKind
    message: str

    def __post_init__(self) -> None:
        _check_text(self)
        if self.request_id:
            validate_request_id(self.request_id)


@dataclass(frozen=True, slots=True)
class Done:
    """Terminal success of Load, Unload, Cancel and Shutdown (an extension)."""

    request_id: str

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)


@dataclass(frozen=True, slots=True)
class Embeddings:
    """Terminal success of Embed: one vector per input, in input order (an extension)."""

    request_id: str
    vectors: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)


@dataclass(frozen=True, slots=True)
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

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)
        for name in ("prompt_tokens", "cached_tokens", "generated_tokens"):
            _check_range(name, getattr(self, name), 0, 2**63 - 1)


ServerEvent = Accepted | Tokens | FleetDescription | Error | Done | Embeddings | Usage


def is_terminal(event: ServerEvent) -> bool:
    """True for the one event that ends a request."""
    if isinstance(event, Tokens):
        return event.finished
    return not isinstance(event, Accepted | Usage)


# --------------------------------------------------------------------------- requests


class Role(enum.Enum):
    """Who said a conversation message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class Message:
    """One turn of a conversation (an extension: ``Generate.messages``)."""

    role: Role
    content: str

    def __post_init__(self) -> None:
        _check_text(self)


@dataclass(frozen=True, slots=True)
class Generate:
    """Generate text with ``model`` from ``prompt`` or from a conversation, ``messages``.

    Exactly one of the two is given. ``messages`` (an extension) is rendered with the
    model's chat template; unset options take the model's defaults.
    """

    request_id: str
    model: str
    prompt: str | None = field(default=None, metadata={"skip_none": True})
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    format: Format | None = None
    auto_load: bool | None = None
    deadline_ms: int | None = None
    messages: tuple[Message, ...] | None = field(default=None, metadata={"skip_none": True})
    json_schema: str | None = field(default=None, metadata={"skip_none": True})
    """A JSON Schema (as JSON text) the output must validate against (an extension)."""
    grammar: str | None = field(default=None, metadata={"skip_none": True})
    """A GBNF grammar the output must follow, root rule ``root`` (an extension)."""
    keep_alive_ms: int | None = field(default=None, metadata={"skip_none": True})
    """How long the model stays loaded once idle, from now on (-1: always; an extension)."""
    speculative: bool | None = field(default=None, metadata={"skip_none": True})
    """Prompt-lookup decoding for a greedy request (default: the model's, on; an
    extension). The output is the same either way; only the speed differs."""
    usage: bool | None = field(default=None, metadata={"skip_none": True})
    """Send a ``Usage`` event before the last Tokens (an extension)."""

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)
        _check_name("model", self.model)
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("give exactly one of `prompt` and `messages`")
        if self.messages is not None:
            if not self.messages:
                raise ProtocolError("`messages` must not be empty")
            if len(self.messages) > _MAX_MESSAGES:
                raise ProtocolError(f"at most {_MAX_MESSAGES} messages")
            if self.format is Format.RAW:
                raise ProtocolError("`messages` need the chat template: format `raw` is for "
                                    "`prompt`")
        if self.json_schema is not None and self.grammar is not None:
            raise ProtocolError("give at most one of `json_schema` and `grammar`")
        for name in ("json_schema", "grammar"):
            value = getattr(self, name)
            if value is not None and not 1 <= len(value) <= _MAX_GRAMMAR_CHARS:
                raise ProtocolError(f"`{name}` must be 1-{_MAX_GRAMMAR_CHARS} characters")
        if self.json_schema is not None:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise ProtocolError(f"`json_schema` is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise ProtocolError("`json_schema` must be a JSON object")
        _check_range("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        _check_range("top_k", self.top_k, 0, 1_000_000)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repeat_penalty", self.repeat_penalty, 0.01, 10.0)
        _check_range("seed", self.seed, 0, _U32_MAX - 1)
        _check_range("deadline_ms", self.deadline_ms, 1, _MAX_DEADLINE_MS)
        _check_range("keep_alive_ms", self.keep_alive_ms, -1, _MAX_KEEP_ALIVE_MS)
        if self.stop is not None:
            if len(self.stop) > _MAX_STOPS:
                raise ProtocolError(f"at most {_MAX_STOPS} stop strings")
            for s in self.stop:
                if not 1 <= len(s) <= _MAX_STOP_CHARS:
                    raise ProtocolError(f"stop strings must be 1-{_MAX_STOP_CHARS} characters")


@dataclass(frozen=True, slots=True)
class DescribeFleet:
    """Ask for a FleetSnapshot."""

    request_id: str

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel the active request ``target`` (any connection of the same user)."""

    request_id: str
    target: str

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)
        validate_request_id(self.target)


@dataclass(frozen=True, slots=True)
class Load:
    """Make ``model`` resident, on ``executor`` if given."""

    request_id: str
    model: str
    executor: str | None = None
    keep_alive_ms: int | None = field(default=None, metadata={"skip_none": True})
    """As Generate's (an extension)."""

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)
        _check_name("model", self.model)
        _check_range("keep_alive_ms", self.keep_alive_ms, -1, _MAX_KEEP_ALIVE_MS)
        if self.executor is not None:
            _check_name("executor", self.executor)


@dataclass(frozen=True, slots=True)
class Unload:
    """Release ``model``; its active requests are cancelled first."""

    request_id: str
    model: str

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)
        _check_name("model", self.model)


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the daemon gracefully."""

    request_id: str

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)


@dataclass(frozen=True, slots=True)
class Auth:
    """First line on a TCP connection: the bearer token."""

    token: str

    def __post_init__(self) -> None:
        _check_text(self)


@dataclass(frozen=True, slots=True)
class Embed:
    """Embed each string of ``input`` with ``model`` (an extension); answered by one
    Embeddings event, after Accepted like a Generate."""

    request_id: str
    model: str
    input: tuple[str, ...]
    auto_load: bool | None = None
    deadline_ms: int | None = None
    keep_alive_ms: int | None = field(default=None, metadata={"skip_none": True})

    def __post_init__(self) -> None:
        _check_text(self)
        validate_request_id(self.request_id)
        _check_name("model", self.model)
        _check_range("keep_alive_ms", self.keep_alive_ms, -1, _MAX_KEEP_ALIVE_MS)
        if not self.input:
            raise ProtocolError("`input` must hold at least one string")
        if len(self.input) > MAX_EMBED_INPUTS:
            raise ProtocolError(f"at most {MAX_EMBED_INPUTS} inputs per request")
        if any(not s for s in self.input):
            raise ProtocolError("`input` strings must not be empty")
        _check_range("deadline_ms", self.deadline_ms, 1, _MAX_DEADLINE_MS)


Request = Generate | DescribeFleet | Cancel | Load | Unload | Shutdown | Auth | Embed

_EVENTS: dict[str, type[Any]] = {
    c.__name__: c for c in (Accepted, Tokens, FleetDescription, Error, Done, Embeddings,
                            Usage)
}
_REQUESTS: dict[str, type[Any]] = {
    c.__name__: c for c in (Generate, DescribeFleet, Cancel, Load, Unload, Shutdown, Auth,
                            Embed)
}

# --------------------------------------------------------------------------- encoding


_FIELDS: dict[type[Any], tuple[tuple[str, bool], ...]] = {}


def _fields(cls: type[Any]) -> tuple[tuple[str, bool], ...]:
    """(name, skip_none) of each field of dataclass ``cls``, computed once."""
    found = _FIELDS.get(cls)
    if found is None:
        found = _FIELDS[cls] = tuple((f.name, bool(f.metadata.get("skip_none")))
                                     for f in dataclasses.fields(cls))
    return found


def _to_json(obj: Any) -> Any:
    cls = type(obj)
    if hasattr(cls, "__dataclass_fields__"):
        names = _fields(cls)
        if getattr(cls, "newtype", False):
            return _to_json(getattr(obj, names[0][0]))
        out: dict[str, Any] = {}
        for name, skip_none in names:
            value = getattr(obj, name)
            if value is None and skip_none:
                continue
            out[name] = _to_json(value)
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, tuple):
        return [_to_json(v) for v in obj]
    return obj


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
_string = json.encoder.encode_basestring  # what _ENCODER writes for a str (C when built)


def _encode_tokens(t: Tokens) -> bytes:
    """Tokens, the one event sent per step per stream, without the generic walk: the
    same bytes as ``_ENCODER`` would write (tests compare the two)."""
    chunk = t.chunk
    return (f'{{"Tokens":{{"request_id":{_string(t.request_id)},"chunk":{{"text":'
            f'{_string(chunk.text)},"ids":[{",".join(map(str, chunk.ids))}]}},"finished":'
            f'{"true" if t.finished else "false"}}}}}\n').encode()


def encode(message: ServerEvent | Request) -> bytes:
    """One wire line (with its trailing newline) for ``message``."""
    if type(message) is Tokens:
        return _encode_tokens(message)
    return _encode_generic(message)


def _encode_generic(message: ServerEvent | Request) -> bytes:
    body = {type(message).__name__: _to_json(message)}
    return _ENCODER.encode(body).encode("utf-8") + b"\n"


# --------------------------------------------------------------------------- decoding


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"invalid number {name}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ProtocolError(f"duplicate field `{key}`")
            seen.add(key)
    return out


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    return hints


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _from_json(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        inner = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _from_json(inner[0], value, where)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {_describe(value)}")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(f"{where}: string is not valid Unicode") from None
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected a boolean, got {_describe(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {_describe(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {_describe(value)}")
        try:
            return float(value)
        except OverflowError:
            raise ProtocolError(f"{where}: number out of range") from None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {_describe(value)}")
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(f"`{m.value}`" for m in tp)
            raise ProtocolError(
                f"{where}: unknown variant `{value}`, expected one of {allowed}"
            ) from None
    if origin is tuple:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected an array, got {_describe(value)}")
        (elem,) = (a for a in get_args(tp) if a is not Ellipsis)
        return tuple(_from_json(elem, v, f"{where}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _struct(typing.cast(type[Any], tp), value, where)
    raise TypeError(f"no decoder for {tp!r}")  # pragma: no cover - a bug in this module


def _struct(cls: type[Any], value: Any, where: str) -> Any:
    if getattr(cls, "newtype", False):
        inner = dataclasses.fields(cls)[0]
        return cls(_from_json(_hints(cls)[inner.name], value, where))
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected an object, got {_describe(value)}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        optional = f.default is not dataclasses.MISSING or type(None) in get_args(tp)
        if f.name not in value:
            if not optional:
                raise ProtocolError(f"{where}: missing field `{f.name}`")
            if f.default is dataclasses.MISSING:
                kwargs[f.name] = None  # serde: an absent Option is None
            continue
        kwargs[f.name] = _from_json(tp, value[f.name], f"{where}.{f.name}")
    return cls(**kwargs)


# The generic functions above walk the type hints on every call and say exactly what
# is wrong. The compiled decoders below check the common shapes once per field with
# the hints looked up in advance, and hand anything unexpected to the generic path,
# so both accept the same lines and raise the same errors (tests compare them).

_Decoder = Callable[[Any], Any]
_COMPILED: dict[tuple[Any, str], _Decoder] = {}


def _compiled(tp: Any, where: str) -> _Decoder:
    dec = _COMPILED.get((tp, where))
    if dec is None:
        dec = _COMPILED[(tp, where)] = _compile(tp, where)
    return dec


def _compile(tp: Any, where: str) -> _Decoder:
    def generic(value: Any) -> Any:
        return _from_json(tp, value, where)

    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        (inner_tp,) = (a for a in get_args(tp) if a is not type(None))
        inner = _compiled(inner_tp, where)

        def optional(value: Any) -> Any:
            return None if value is None else inner(value)
        return optional
    if tp is str:
        def string(value: Any) -> Any:
            if type(value) is str and value.isascii():
                return value
            return generic(value)
        return string
    if tp is bool or tp is int or tp is float:
        def scalar(value: Any) -> Any:
            return value if type(value) is tp else generic(value)
        return scalar
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        members = {m.value: m for m in tp}

        def variant(value: Any) -> Any:
            member = members.get(value) if type(value) is str else None
            return member if member is not None else generic(value)
        return variant
    if origin is tuple and get_args(tp)[0] in (int, str):
        elem = get_args(tp)[0]

        def array(value: Any) -> Any:
            if type(value) is list and all(type(v) is elem for v in value) and (
                    elem is int or all(v.isascii() for v in value)):
                return tuple(value)
            return generic(value)
        return array
    if dataclasses.is_dataclass(tp):
        return _compile_struct(typing.cast(type[Any], tp), where)
    return generic


def _compile_struct(cls: type[Any], where: str) -> _Decoder:
    hints = _hints(cls)
    if getattr(cls, "newtype", False):
        inner = _compiled(hints[dataclasses.fields(cls)[0].name], where)

        def newtype(value: Any) -> Any:
            return cls(inner(value))
        return newtype
    # (name, decoder, absent): absent is what an absent field means — a missing field
    # (required), nothing (it has a default), or None (an Option without one).
    required = object()
    plan = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        absent = (None if f.default is not dataclasses.MISSING
                  else (None,) if type(None) in get_args(tp) else required)
        plan.append((f.name, _compiled(tp, f"{where}.{f.name}"), absent))

    def struct(value: Any) -> Any:
        if type(value) is not dict:
            return _struct(cls, value, where)
        kwargs: dict[str, Any] = {}
        for name, dec, absent in plan:
            if name in value:
                kwargs[name] = dec(value[name])
            elif absent is required:
                raise ProtocolError(f"{where}: missing field `{name}`")
            elif absent is not None:
                kwargs[name] = None
        return cls(**kwargs)
    return struct


def _peek_request_id(body: Any) -> str:
    if isinstance(body, dict) and len(body) == 1:
        (inner,) = body.values()
        if isinstance(inner, dict):
            rid = inner.get("request_id")
            if isinstance(rid, str) and _REQUEST_ID.fullmatch(rid):
                return rid
    return ""


def _decode(line: bytes | str, variants: dict[str, type[Any]]) -> Any:
    if isinstance(line, bytes | bytearray):
        if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:
            raise LineTooLongError(f"line longer than {MAX_LINE_BYTES} bytes")
        try:
            text = bytes(line).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("line is not valid UTF-8") from None
    else:
        text = line
    try:
        body = _DECODER.decode(text)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except ValueError as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    rid = _peek_request_id(body)
    try:
        if not isinstance(body, dict) or len(body) != 1:
            raise ProtocolError("expected an object with exactly one key naming the variant")
        ((tag, payload),) = body.items()
        cls = variants.get(tag)
        if cls is None:
            allowed = ", ".join(f"`{n}`" for n in variants)
            raise ProtocolError(f"unknown variant `{tag}`, expected one of {allowed}")
        return _compiled(cls, tag)(payload)
    except ProtocolError as exc:
        raise ProtocolError(exc.message, request_id=rid) from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply", request_id=rid) from None


def decode_request(line: bytes | str) -> Request:
    """Decode one client line. Raises ProtocolError (with ``request_id`` if readable)."""
    result: Request = _decode(line, _REQUESTS)
    return result


def decode_event(line: bytes | str) -> ServerEvent:
    """Decode one daemon line. Raises ProtocolError."""
    result: ServerEvent = _decode(line, _EVENTS)
    return result


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

    def feed(self, data: bytes) -> list[bytes]:
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
