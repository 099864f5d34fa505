"""The wire protocol: requests, events, and their one-line JSON encoding. No I/O.

Every message is a frozen dataclass whose constructor validates it (``validation``),
so an object that exists is an object that may go on the wire. ``encode`` turns one
into a line of bytes exactly as serde_json encodes the seed's Rust types;
``decode_request`` / ``decode_event`` turn one line back and raise
:class:`~everycycle.errors.ProtocolError` for anything else (``codec``).
``LineFramer`` splits a byte stream into lines and enforces the 1 MiB limit
(``framing``).
"""

from ..errors import ErrorKind
from .codec import decode_event, decode_request, encode
from .events import (
    Accepted,
    ActiveRequest,
    Done,
    Embeddings,
    Error,
    ExecutorSummary,
    FleetDescription,
    FleetSnapshot,
    LoadedModel,
    PrincipalLoad,
    Progress,
    ServerEvent,
    TokenChunk,
    TokenLogprob,
    Tokens,
    ToolCalls,
    TopLogprob,
    Usage,
    is_terminal,
)
from .framing import MAX_LINE_BYTES, LineFramer
from .requests import (
    Auth,
    Cancel,
    ContentPart,
    DescribeFleet,
    Embed,
    Format,
    Generate,
    Load,
    Message,
    PartType,
    Priority,
    Request,
    Role,
    Shutdown,
    ToolCall,
    ToolChoice,
    Unload,
)
from .validation import (
    MAX_EMBED_INPUTS,
    MAX_IMAGE_BYTES,
    MAX_IMAGES,
    MAX_TOKENS_LIMIT,
    check_model_name,
    validate_request_id,
)

__all__ = [
    "MAX_EMBED_INPUTS",
    "MAX_IMAGES",
    "MAX_IMAGE_BYTES",
    "MAX_LINE_BYTES",
    "MAX_TOKENS_LIMIT",
    "Accepted",
    "ActiveRequest",
    "Auth",
    "Cancel",
    "ContentPart",
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
    "PartType",
    "PrincipalLoad",
    "Priority",
    "Progress",
    "Request",
    "Role",
    "ServerEvent",
    "Shutdown",
    "TokenChunk",
    "TokenLogprob",
    "Tokens",
    "ToolCall",
    "ToolCalls",
    "ToolChoice",
    "TopLogprob",
    "Unload",
    "Usage",
    "check_model_name",
    "decode_event",
    "decode_request",
    "encode",
    "is_terminal",
    "validate_request_id",
]
