"""What every dialect reads from an HTTP request the same way: who asks (auth), the
JSON body (bounded), the model, the request id and the deadline."""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any

from starlette.requests import Request as HttpRequest

from ...errors import EverycycleError, ProtocolError, TooLargeError
from ...protocol import ContentPart, PartType, Priority, sampling, validate_request_id
from ..keys import LOCAL, KeyStore, Principal
from ..supervisor import Supervisor

MAX_BODY_BYTES = 8 << 20


def image_part(where: str, data: object, mime: object = None) -> ContentPart:
    """An image content part from a data URL (``data:image/png;base64,…``) or, with
    ``mime``, plain base64. A web address is refused: the daemon fetches nothing.
    Raises HttpError (400; 413 for an image over the size limit)."""
    if not isinstance(data, str):
        raise HttpError(400, f"{where}: an image is a data URL or base64 text", "invalid_image")
    if data.startswith(("http://", "https://")):
        raise HttpError(400, f"{where}: image URLs are not fetched (the daemon reaches no "
                        "network); send the image inline as a data URL, "
                        "data:image/png;base64,…", "image_url_not_supported")
    if data.startswith("data:"):
        head, comma, payload = data.partition(",")
        if not comma or not head.endswith(";base64"):
            raise HttpError(400, f"{where}: a data URL must be data:<mime>;base64,<data>",
                            "invalid_image")
        mime, data = head[5:].removesuffix(";base64") or None, payload
    try:
        return ContentPart(PartType.IMAGE, data=data,
                           mime=mime if isinstance(mime, str) else None)
    except ProtocolError as exc:
        status = 413 if isinstance(exc, TooLargeError) else 400
        raise HttpError(status, f"{where}: {exc.message}", "invalid_image") from None


def joined_text(where: str, content: object, kinds: tuple[str, ...], names: str,
                code: str) -> str:
    """A string, or a list of text blocks (each ``{type: one of kinds, text}``; a
    ``refusal`` block's text is its ``refusal``) joined.
    ``names`` names those blocks in the HttpError (400, ``code``) for anything else."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise HttpError(400, f"{where}: must be a string or a list of {names}", code)
    parts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        text = block.get("refusal" if kind == "refusal" else "text") \
            if isinstance(block, dict) else None
        if kind not in kinds or not isinstance(text, str):
            raise HttpError(400, f"{where}[{j}]: only {names} are supported here", code)
        parts.append(text)
    return "".join(parts)


class HttpError(Exception):
    """An HTTP error answer: status, message, an error code; each dialect shapes it."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


class Reader:
    """Reads requests for one supervisor and key store."""

    def __init__(self, supervisor: Supervisor, keys: KeyStore, *, require_key: bool) -> None:
        self.supervisor = supervisor
        self.keys = keys
        self.require_key = require_key

    def auth(self, request: HttpRequest) -> Principal:
        """Who is asking: the key's principal (``Authorization: Bearer`` or
        ``x-api-key``). Without --http-auth on loopback, a request with no key (or one
        we do not know: OpenAI clients always send some) is "local"."""
        secret = presented_key(request)
        principal = self.keys.authenticate(secret) if secret else None
        if principal is None:
            if self.require_key:
                raise HttpError(401, "a valid bearer token is required "
                                "(`everycycle daemon --show-token` or `everycycle keys add`)",
                                "invalid_api_key")
            principal = self.keys.principal(LOCAL.name)
        request.state.principal = principal
        return principal

    async def json(self, request: HttpRequest) -> dict[str, Any]:
        """The authenticated request's body, a JSON object of at most MAX_BODY_BYTES."""
        data = await self.json_value(request)
        if not isinstance(data, dict):
            raise HttpError(400, "the body must be a JSON object", "invalid_json")
        return data

    async def json_value(self, request: HttpRequest) -> Any:
        """The authenticated request's body, any JSON value of at most MAX_BODY_BYTES."""
        self.auth(request)
        length = request.headers.get("content-length") or "0"
        size = int(length) if length.isascii() and length.isdigit() else MAX_BODY_BYTES + 1
        if size > MAX_BODY_BYTES:
            raise HttpError(413, f"request body over {MAX_BODY_BYTES} bytes", "too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise HttpError(413, f"request body over {MAX_BODY_BYTES} bytes", "too_large")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise HttpError(400, f"the body is not JSON: {exc}", "invalid_json") from None
        return data

    def model(self, request: HttpRequest, name: object, listing: str) -> str:
        """The model a request names (the default when none); ``listing`` says where
        the models are listed. Raises HttpError (400, or 404 for an unknown model)."""
        registry = self.supervisor.registry
        restricted = request.state.principal.limits.models is not None
        if name is None or name == "":
            try:
                return registry.default_name()
            except EverycycleError as exc:
                raise HttpError(400, exc.message, "model_required") from None
        if not isinstance(name, str):
            raise HttpError(400, "`model` must be a string", "invalid_type")
        if not registry.has(name) and not restricted and not self.supervisor.knows(name):
            # (A key limited to some models hears the same for every other model,
            # existing or not: the supervisor's Invalid.)
            raise HttpError(404, f"model '{name}' not found ({listing} lists them)",
                            "model_not_found")
        return name

    def visible(self, principal: Principal) -> list[str]:
        """The registry's models that ``principal`` may use."""
        registry = self.supervisor.registry
        allowed = principal.limits.models
        if allowed is None:
            return list(registry.models)
        names = set()
        for name in allowed:
            with contextlib.suppress(EverycycleError):
                names.add(registry.get(name).name)
        return [name for name in registry.models if name in names]


def presented_key(request: HttpRequest) -> str:
    """The secret a request presents (``Authorization: Bearer`` or ``x-api-key``), or ""."""
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    secret = secret.strip() if scheme.lower() == "bearer" else ""
    return secret or request.headers.get("x-api-key", "").strip()


def request_id(request: HttpRequest, prefix: str) -> str:
    """The ``x-request-id`` the client chose, else a fresh ``PREFIX-<hex>``."""
    given = request.headers.get("x-request-id")
    if given is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    try:
        return validate_request_id(given)
    except ProtocolError as exc:
        raise HttpError(400, f"x-request-id: {exc.message}", "invalid_request_id") from None


def deadline(request: HttpRequest) -> int | None:
    """The ``x-deadline-ms`` header. Raises HttpError (400) for a malformed one."""
    value = request.headers.get("x-deadline-ms")
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 12):
        raise HttpError(400, "x-deadline-ms must be a number of milliseconds (0-999999999999)",
                        "invalid_deadline")
    return int(value)


def priority(request: HttpRequest, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """The lane: the ``x-priority`` header (``interactive`` or ``background``), else
    OpenAI's ``service_tier``, whose ``flex`` (cheaper, slower) is read as background.
    Raises HttpError (400) for another header value."""
    value = request.headers.get("x-priority")
    if value is not None:
        try:
            return {"priority": Priority(value.strip().lower())}
        except ValueError:
            raise HttpError(400, "x-priority must be interactive or background",
                            "invalid_priority") from None
    if data is not None and data.get("service_tier") == "flex":
        return {"priority": Priority.BACKGROUND}
    return {}


def protocol_errors(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a protocol message; its ProtocolError as a 400."""
    try:
        return fn(*args, **kwargs)
    except ProtocolError as exc:
        raise HttpError(400, exc.message, "invalid_value") from None


def stream_flag(data: dict[str, Any]) -> bool:
    """The body's ``stream`` (false when absent). Raises HttpError (400) for a non-boolean."""
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, "`stream` must be a boolean", "invalid_type")
    return stream


def sampling_options(dialect: str, data: dict[str, Any], where: str = "") -> dict[str, Any]:
    """The sampling parameters ``dialect`` takes from ``data``, by name (the table's
    mapping, ``protocol.sampling``). Raises HttpError (400) naming a mistyped one."""
    try:
        return sampling.from_json(dialect, data, where)
    except ProtocolError as exc:
        raise HttpError(400, exc.message, "invalid_type") from None
