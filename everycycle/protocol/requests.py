"""Client → daemon requests: the seed's, and the extensions (messages, Embed, Auth)."""

from __future__ import annotations

import base64
import binascii
import enum
from collections.abc import Sequence
from dataclasses import field

from ..errors import ProtocolError, TooLargeError
from . import sampling
from .sampling import Bias  # noqa: F401 - the extension fields' type, by name
from .toolhost import ListTools, RunTool
from .validation import (
    CONTEXT,
    DEADLINE,
    KEEP_ALIVE,
    MAX_EMBED_INPUTS,
    MAX_GRAMMAR_CHARS,
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TOKENS_LIMIT,
    MAX_TOOL_CALLS,
    TOKEN_ID_MAX,
    check_name,
    message,
    parse_json,
)

_EXT = {"skip_none": True}
MAX_INFILL_CHUNKS = 256
MAX_DRAIN_MS = 86_400_000
MAX_PROMPT_TOKENS = 1 << 20


class Format(enum.Enum):
    """How a Generate prompt is turned into tokens."""

    CHAT = "chat"
    """Apply the model's own chat template (the default where the GGUF has one)."""
    RAW = "raw"
    """Tokenize the prompt as is."""


class ThinkEffort(enum.Enum):
    """How hard a thinking model thinks: a budget per effort (an extension)."""

    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"


class Priority(enum.Enum):
    """Which lane a Generate or Embed waits in (an extension; absent: interactive)."""

    INTERACTIVE = "interactive"
    """A person waits for it: it takes the next free slot before any background
    request, and a running background request gives its slot up for it."""
    BACKGROUND = "background"
    """Batch work: served when no interactive request waits (or once it has waited
    longer than the daemon's ``--background-age``)."""


class Role(enum.Enum):
    """Who said a conversation message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"
    """A tool's result, answering the assistant's call ``tool_call_id``."""


class ToolChoice(enum.Enum):
    """Whether the model may, must or must not call one of a request's tools."""

    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"


@message(names=("name",))
class ToolCall:
    """A call of the tool ``name`` with ``arguments`` (a JSON object, as text)."""

    id: str
    name: str
    arguments: str

    def _validate(self) -> None:
        check_name("tool call id", self.id)
        parse_json("tool call arguments", self.arguments, dict, "a JSON object", are=True)


class PartType(enum.Enum):
    """What a part of a message's content is."""

    TEXT = "text"
    IMAGE = "image"


@message(ranges={"id": (0, 63), "scale": (-100.0, 100.0)})
class LoraScale:
    """One LoRA adapter's scale for a request (an extension; llama-server's ``lora``
    entries): ``id`` is its index in the model's ``lora`` list."""

    id: int
    scale: float


@message()
class ContentPart:
    """A part of a message's content (an extension): ``{"type": "text", "text"}`` or
    ``{"type": "image", "data": base64, "mime"}``. An image is at most MAX_IMAGE_BYTES."""

    type: PartType
    text: str | None = field(default=None, metadata=_EXT)
    data: str | None = field(default=None, metadata=_EXT)
    """The image file's bytes (PNG, JPEG, WebP, GIF), base64."""
    mime: str | None = field(default=None, metadata=_EXT)

    def _validate(self) -> None:
        if self.type is PartType.TEXT:
            if self.text is None or self.data is not None:
                raise ProtocolError("a text part has `text` and no `data`")
            return
        if self.data is None or self.text is not None:
            raise ProtocolError("an image part has base64 `data` and no `text`")
        if len(self.data) > (MAX_IMAGE_BYTES + 2) // 3 * 4 + 4:
            raise TooLargeError(f"an image is at most {MAX_IMAGE_BYTES >> 20} MiB")
        if self.mime is not None and not (0 < len(self.mime) <= 100):
            raise ProtocolError("`mime` must be 1-100 characters")

    def image_bytes(self) -> bytes:
        """The image's bytes. Raises ProtocolError for data that is not base64."""
        assert self.data is not None
        try:
            return base64.b64decode(self.data, validate=True)
        except (binascii.Error, ValueError):
            raise ProtocolError("an image's `data` is not base64") from None


@message()
class Message:
    """One turn of a conversation (an extension: ``Generate.messages``). An assistant's
    turn may carry the ``tool_calls`` it made; a tool's turn answers ``tool_call_id``.
    ``content`` is text, or (an extension) a list of text and image parts."""

    role: Role
    content: str | tuple[ContentPart, ...]
    tool_calls: tuple[ToolCall, ...] | None = field(default=None, metadata=_EXT)
    tool_call_id: str | None = field(default=None, metadata=_EXT)

    @property
    def text(self) -> str:
        """The content's text (an image part counts as none)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    @property
    def images(self) -> tuple[ContentPart, ...]:
        """The content's image parts, in order."""
        if isinstance(self.content, str):
            return ()
        return tuple(p for p in self.content if p.type is PartType.IMAGE)

    def _validate(self) -> None:
        if not isinstance(self.content, str):
            if not 1 <= len(self.content) <= MAX_PARTS:
                raise ProtocolError(f"content must hold 1-{MAX_PARTS} parts")
            if self.images and self.role is not Role.USER:
                raise ProtocolError("only a user message carries images")
        if self.tool_calls is not None and self.role is not Role.ASSISTANT:
            raise ProtocolError("only an assistant message carries tool_calls")
        if self.tool_calls is not None and not 1 <= len(self.tool_calls) <= MAX_TOOL_CALLS:
            raise ProtocolError(f"tool_calls must hold 1-{MAX_TOOL_CALLS} calls")
        if self.tool_call_id is not None:
            if self.role is not Role.TOOL:
                raise ProtocolError("only a tool message answers a tool_call_id")
            check_name("tool_call_id", self.tool_call_id)


@message(names=("filename",))
class InfillChunk:
    """Repo-level context for fill-in-the-middle (an extension): another file's name and
    text, laid out before the prefix as llama-server lays out ``input_extra``."""

    filename: str
    text: str


@message()
class Infill:
    """Fill in the middle (an extension: ``Generate.infill``): the Generate's ``prompt``
    is the text before the cursor, ``suffix`` the text after it; ``middle`` is text
    already typed after the prefix (llama-server's ``/infill`` ``prompt``), ``extra``
    other files' text. Laid out with the model's own FIM tokens; a model without them
    refuses it (Invalid)."""

    suffix: str
    extra: tuple[InfillChunk, ...] = ()
    middle: str = ""

    def _validate(self) -> None:
        if len(self.extra) > MAX_INFILL_CHUNKS:
            raise ProtocolError(f"at most {MAX_INFILL_CHUNKS} extra chunks")


@message(ranges={
    "max_tokens": (1, MAX_TOKENS_LIMIT), **sampling.RANGES, "deadline_ms": DEADLINE,
    "keep_alive_ms": KEEP_ALIVE, "logprobs": (0, 20), "context": CONTEXT,
    "think_budget": (0, MAX_TOKENS_LIMIT), "n_indent": (0, 4096),
    "t_max_predict_ms": DEADLINE})
@sampling.with_extensions
class Generate:
    """Generate text with ``model`` from ``prompt`` or from a conversation, ``messages``.

    Exactly one of the two is given. ``messages`` (an extension) is rendered with the
    model's chat template; unset options take the model's defaults. The sampling
    parameters are ``sampling.PARAMS``: the seed's six are declared here in their wire
    places, the others (extensions) are added from the table.
    """

    request_id: str
    model: str
    prompt: str | None = field(default=None, metadata=_EXT)
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
    messages: tuple[Message, ...] | None = field(default=None, metadata=_EXT)
    json_schema: str | None = field(default=None, metadata=_EXT)
    """A JSON Schema (as JSON text) the output must validate against (an extension)."""
    grammar: str | None = field(default=None, metadata=_EXT)
    """A GBNF grammar the output must follow, root rule ``root`` (an extension)."""
    keep_alive_ms: int | None = field(default=None, metadata=_EXT)
    """How long the model stays loaded once idle, from now on (-1: always; an extension)."""
    speculative: bool | None = field(default=None, metadata=_EXT)
    """Prompt-lookup decoding for a greedy request (default: the model's, on; an
    extension); false also turns off a draft model's drafts for it. The output is the
    same either way; only the speed differs."""
    usage: bool | None = field(default=None, metadata=_EXT)
    """Send a ``Usage`` event before the last Tokens (an extension)."""
    progress: bool | None = field(default=None, metadata=_EXT)
    """Send ``Progress`` events while the prompt is read (an extension)."""
    tools: str | None = field(default=None, metadata=_EXT)
    """Function tools the model may call: a JSON array of OpenAI tool objects, as text
    (an extension; with ``messages``). Calls come back in a ``ToolCalls`` event."""
    tool_choice: ToolChoice | None = field(default=None, metadata=_EXT)
    """``auto`` (the default with tools), ``none`` or ``required``."""
    tool_name: str | None = field(default=None, metadata=_EXT)
    """The one tool the model must call (implies ``required``)."""
    parallel_tool_calls: bool | None = field(default=None, metadata=_EXT)
    """Whether one answer may make several calls (default: no, as llama-server)."""
    logprobs: int | None = field(default=None, metadata=_EXT)
    """Report each token's log-probability and this many likeliest alternatives (0-20)
    in ``TokenChunk.logprobs`` (an extension)."""
    think: bool | None = field(default=None, metadata=_EXT)
    """Whether a thinking model thinks first, where its template can say (the template's
    own ``enable_thinking``); its thoughts arrive in ``TokenChunk.reasoning``."""
    think_budget: int | None = field(default=None, metadata=_EXT)
    """Thinking tokens at most, for a thinking model (an extension): then its thinking
    ends as its template ends it, and it answers. Absent: ``think_effort``'s budget, else
    the model's (models.toml ``reasoning_budget``)."""
    think_effort: ThinkEffort | None = field(default=None, metadata=_EXT)
    """``low``, ``medium`` or ``high``: the model's budget for that effort (models.toml
    ``reasoning_efforts``; an extension)."""
    priority: Priority | None = field(default=None, metadata=_EXT)
    """Its lane (an extension; absent: interactive)."""
    context: int | None = field(default=None, metadata=_EXT)
    """The tokens a slot must hold for it (an extension; Ollama's ``num_ctx``): a model
    loaded with less is loaded again with at least this many, once, where the model was
    trained for them and memory allows; one loaded with more serves it as it is."""
    lora: tuple[LoraScale, ...] | None = field(default=None, metadata=_EXT)
    """Its model's LoRA adapters' scales (an extension): those it names, the model's
    own (``POST /lora-adapters``, models.toml) for the others."""
    prompt_tokens: tuple[int, ...] | None = field(default=None, metadata=_EXT)
    """The prompt as token ids, read as they are (an extension; llama-server's token
    prompts). Exactly one of ``prompt``, ``messages`` and ``prompt_tokens``."""
    infill: Infill | None = field(default=None, metadata=_EXT)
    """Fill in the middle between ``prompt`` (before) and ``infill.suffix`` (after)."""
    ignore_eos: bool | None = field(default=None, metadata=_EXT)
    """Never end by itself: generate until ``max_tokens``, a stop string or the full
    context (an extension; llama-server's, which benchmarks send)."""
    post_sampling_probs: bool | None = field(default=None, metadata=_EXT)
    """With ``logprobs``: report the probabilities after the sampler chain (its top
    candidates), as llama-server's ``post_sampling_probs``, not the model's own (an
    extension)."""
    n_indent: int | None = field(default=None, metadata=_EXT)
    """End before a line, after the first line break, indented less than this many
    spaces or tabs (an extension; llama-server's: a code completion ends with its
    block)."""
    t_max_predict_ms: int | None = field(default=None, metadata=_EXT)
    """End once the answer has a line break and this many ms have passed since its first
    token (an extension; llama-server's, for editors that want a line fast)."""

    def _validate(self) -> None:
        self._validate_tools()
        sampling.check(self)
        if self.prompt_tokens is None and (self.prompt is None) == (self.messages is None):
            raise ProtocolError("give exactly one of `prompt` and `messages`")
        if self.prompt_tokens is not None:
            if self.prompt is not None or self.messages is not None:
                raise ProtocolError("give `prompt_tokens` alone, without `prompt` or "
                                    "`messages`")
            if not self.prompt_tokens:
                raise ProtocolError("`prompt_tokens` must not be empty")
            if len(self.prompt_tokens) > MAX_PROMPT_TOKENS:
                raise ProtocolError(f"at most {MAX_PROMPT_TOKENS} prompt tokens")
            if any(not 0 <= t <= TOKEN_ID_MAX for t in self.prompt_tokens):
                raise ProtocolError("`prompt_tokens` must be token ids (0 or more)")
        if self.infill is not None and self.prompt is None:
            raise ProtocolError("`infill` fills after a `prompt`: give the text before the "
                                "cursor as `prompt`")
        if self.infill is not None and self.format is Format.CHAT:
            raise ProtocolError("`infill` reads the prompt raw: format `chat` is for chats")
        if self.messages is not None:
            if not self.messages:
                raise ProtocolError("`messages` must not be empty")
            if len(self.messages) > MAX_MESSAGES:
                raise ProtocolError(f"at most {MAX_MESSAGES} messages")
            if self.format is Format.RAW:
                raise ProtocolError("`messages` need the chat template: format `raw` is for "
                                    "`prompt`")
            if sum(len(m.images) for m in self.messages) > MAX_IMAGES:
                raise ProtocolError(f"at most {MAX_IMAGES} images in a request")
        if self.json_schema is not None and self.grammar is not None:
            raise ProtocolError("give at most one of `json_schema` and `grammar`")
        for name in ("json_schema", "grammar"):
            value = getattr(self, name)
            if value is not None and not 1 <= len(value) <= MAX_GRAMMAR_CHARS:
                raise ProtocolError(f"`{name}` must be 1-{MAX_GRAMMAR_CHARS} characters")
        if self.json_schema is not None:
            parse_json("`json_schema`", self.json_schema, dict, "a JSON object")
        if self.stop is not None:
            if len(self.stop) > MAX_STOPS:
                raise ProtocolError(f"at most {MAX_STOPS} stop strings")
            for s in self.stop:
                if not 1 <= len(s) <= MAX_STOP_CHARS:
                    raise ProtocolError(f"stop strings must be 1-{MAX_STOP_CHARS} characters")


    def _validate_tools(self) -> None:
        if self.tools is None:
            if self.tool_choice is not None or self.tool_name is not None:
                raise ProtocolError("`tool_choice` and `tool_name` need `tools`")
            return
        if self.messages is None:
            raise ProtocolError("`tools` need `messages`")
        if self.json_schema is not None or self.grammar is not None:
            raise ProtocolError("give `tools` or a `json_schema`/`grammar`, not both")
        # (no cap of its own: a request line's size bounds it, the context and the
        # constraint engine's compile budget bound what is served)
        if not parse_json("`tools`", self.tools, list, "a non-empty JSON array"):
            raise ProtocolError("`tools` must be a non-empty JSON array")
        if self.tool_name is not None:
            check_name("tool_name", self.tool_name)
            if self.tool_choice is ToolChoice.NONE:
                raise ProtocolError("`tool_name` forces a call: `tool_choice` none refuses it")


@message()
class DescribeFleet:
    """Ask for a FleetSnapshot."""

    request_id: str


@message()
class Cancel:
    """Cancel the active request ``target`` (any connection of the same user)."""

    request_id: str
    target: str


@message(names=("model", "executor"), ranges={"keep_alive_ms": KEEP_ALIVE,
                                              "context": CONTEXT})
class Load:
    """Make ``model`` resident, on ``executor`` if given."""

    request_id: str
    model: str
    executor: str | None = None
    keep_alive_ms: int | None = field(default=None, metadata=_EXT)
    """As Generate's (an extension)."""
    context: int | None = field(default=None, metadata=_EXT)
    """As Generate's (an extension): resident with at least this many tokens a slot."""
    draft_model: str | None = field(default=None, metadata=_EXT)
    """Load it with this draft model (another model's name, an absolute GGUF path or an
    hf:// URL) for speculative decoding (an extension)."""


@message()
class Unload:
    """Release ``model``; its active requests are cancelled first."""

    request_id: str
    model: str


@message(ranges={"drain_ms": (0, MAX_DRAIN_MS)})
class Shutdown:
    """Stop the daemon gracefully.

    With ``drain_ms`` (an extension) it drains first: no new Generate or Embed is
    admitted (``Error{Rejected}``; HTTP 503 with Retry-After), running and queued work
    may finish for up to that many milliseconds, then what is left is cancelled and the
    daemon stops. ``Done`` comes once it has drained."""

    request_id: str
    drain_ms: int | None = field(default=None, metadata=_EXT)


@message()
class Auth:
    """First line on a TCP connection: the bearer token."""

    token: str


@message(ranges={"keep_alive_ms": KEEP_ALIVE, "deadline_ms": DEADLINE})
class Embed:
    """Embed each string of ``input`` with ``model`` (an extension); answered by one
    Embeddings event, after Accepted like a Generate.

    With a ``query`` (an extension) it ranks instead: ``model`` must be a reranker, each
    string of ``input`` is a document scored against the query, and each "vector" of
    the Embeddings event is that document's scores (the first its relevance score, as
    llama-server's ``/rerank`` reports it; ``ranked`` sorts them)."""

    request_id: str
    model: str
    input: tuple[str, ...]
    auto_load: bool | None = None
    deadline_ms: int | None = None
    keep_alive_ms: int | None = field(default=None, metadata=_EXT)
    priority: Priority | None = field(default=None, metadata=_EXT)
    """Its lane (an extension; absent: interactive)."""
    query: str | None = field(default=None, metadata=_EXT)

    def _validate(self) -> None:
        what = "`input`" if self.query is None else "`documents`"
        if not self.input:
            raise ProtocolError(f"{what} must hold at least one string")
        if len(self.input) > MAX_EMBED_INPUTS:
            raise ProtocolError(f"at most {MAX_EMBED_INPUTS} {what} per request")
        if any(not s for s in self.input):
            raise ProtocolError(f"{what} strings must not be empty")
        if self.query is not None and not self.query:
            raise ProtocolError("`query` must not be empty")


def ranked(vectors: Sequence[Sequence[float]], top_n: int | None = None
           ) -> list[tuple[int, float]]:
    """A rerank's answer (an Embed with a query): (document index, relevance score),
    best first, at most ``top_n``."""
    order = sorted(((i, float(v[0])) for i, v in enumerate(vectors)),
                   key=lambda pair: -pair[1])
    return order if top_n is None else order[:max(0, top_n)]


@message()
class Subscribe:
    """The daemon's events as they happen (an extension): ``Accepted`` once subscribed,
    then a ``Notice`` for each event of ``types`` (all when absent), until a Cancel of
    this request id (then ``Done``) or the connection ends. A subscriber that falls far
    behind is cut off with ``Error{Rejected}``."""

    request_id: str
    types: tuple[str, ...] | None = None


Request = (Generate | DescribeFleet | Cancel | Load | Unload | Shutdown | Auth | Embed | Subscribe
           | ListTools | RunTool)

REQUESTS: dict[str, type[Request]] = {
    c.__name__: c for c in (Generate, DescribeFleet, Cancel, Load, Unload, Shutdown, Auth,
                            Embed, Subscribe, ListTools, RunTool)
}
