"""The daemon's HTTP API: every dialect's routes, health and Prometheus metrics, in one
Starlette app served by uvicorn inside the daemon's own task group and event loop.

Each dialect is one module whose routes map HTTP requests onto protocol requests for
the same Supervisor as the socket (``exchange``); this module only assembles them and
answers what belongs to no dialect.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import anyio.abc
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..keys import KeyStore
from ..metrics import CONTENT_TYPE, Metrics
from ..readiness import DRAINING, LOADING, READY
from ..supervisor import Supervisor
from . import (
    adapters,
    anthropic,
    console,
    consolechat,
    eventstream,
    llamacpp,
    ollama,
    ollama_meta,
    openai,
    openai_answer,
    rerank,
    responses,
    resume,
)
from .common import HttpError, Reader
from .exchange import Dialect, Receive, Scope, Send
from .guard import Guard
from .streams import Sessions

ErrorRenderer = Callable[[int, str, str | None, dict[str, str] | None], Response]
"""How a dialect shapes an error answer: (status, message, code, headers)."""


@dataclass(frozen=True)
class Registered:
    """One dialect as the app serves it: its routes (the class's), and the path prefixes
    whose errors it shapes and how."""

    dialect: type[Dialect]
    errors: tuple[str, ...] = ()
    render: ErrorRenderer = openai_answer.error_response


DIALECTS = (
    Registered(openai.OpenAI),
    Registered(anthropic.Anthropic, ("/v1/messages",), anthropic.error_response),
    Registered(responses.Responses),
    Registered(ollama.Ollama, ("/api/",), ollama_meta.error_response),
    Registered(llamacpp.LlamaCpp, llamacpp.PATHS, llamacpp.error_response),
    Registered(rerank.Rerank),
    Registered(eventstream.EventStream),
    Registered(resume.Resume),
    Registered(console.Console),
    Registered(consolechat.ConsoleChat),
    Registered(adapters.Adapters),
)
"""Every dialect the daemon speaks; errors elsewhere are OpenAI's."""

log = logging.getLogger(__name__)

OPEN_WHILE_DRAINING = frozenset({
    "/api/show", "/apply-template", "/tokenize", "/detokenize", "/v1/streams/lookup",
    "/chat/completions/input_tokens", "/v1/chat/completions/input_tokens",
    "/v1/messages/count_tokens", "/v1/chat/completions/render", "/chat/completions/render",
    "/v1/completions/render", "/v1/conversations"})
"""POST routes that start no work: answered while the daemon drains."""


def _open_while_draining(path: str) -> bool:
    return path in OPEN_WHILE_DRAINING or path.endswith(("/cancel", "/unload"))


class HttpApi:
    """The Starlette app over a Supervisor; ``spawn`` starts request tasks in the daemon's
    task group (a request outlives the HTTP exchange that asked for it only until the
    supervisor ends it)."""

    def __init__(self, supervisor: Supervisor, metrics: Metrics, *, keys: KeyStore,
                 require_key: bool, loopback: bool = True, allowed_hosts: Sequence[str] = (),
                 cors_origins: Sequence[str] = (), heartbeat_s: float) -> None:
        self.supervisor = supervisor
        self.heartbeat_s = heartbeat_s
        self.streams = Sessions()
        """Resumable streams (``X-Conversation-Id``), for resume.py's routes."""
        """Seconds of silence after which a stream gets a heartbeat (0: never)."""
        self.metrics = metrics
        self.reader = Reader(supervisor, keys, require_key=require_key)
        self._tg: anyio.abc.TaskGroup | None = None
        self.renderers = [(prefix, d.render) for d in DIALECTS for prefix in d.errors]
        """Error shapes by path prefix (the first that matches); OpenAI's elsewhere."""
        self.app = Starlette(routes=[
            *(route for d in DIALECTS for route in d.dialect(self, self.reader).routes()),
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/health", self.health, methods=["GET"]),
            Route("/readyz", self.health, methods=["GET"]),
            Route("/livez", self.alive, methods=["GET"]),
            Route("/get_load", self.load, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ])
        self.app.add_exception_handler(HttpError, self._http_error)  # type: ignore[arg-type]
        self.app.add_exception_handler(404, self._not_found)
        self.app.add_exception_handler(405, self._not_allowed)
        self.app.add_exception_handler(Exception, self._internal)
        self.asgi = Guard(self._admit, loopback=loopback, allowed_hosts=allowed_hosts,
                          cors_origins=cors_origins, error_body=self._error_body,
                          lenient=("/api/", *llamacpp.PATHS))
        """What the server serves: the app behind the browser guard (guard.py)."""

    async def _admit(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, or while the daemon drains, a 503 with Retry-After for a request
        that would start new work (a router sends it to another daemon)."""
        readiness = self.supervisor.readiness
        if (readiness.refusing and scope["type"] == "http" and scope["method"] == "POST"
                and not _open_while_draining(scope["path"])):
            response = self._error(HttpRequest(scope), 503, readiness.refusal(),
                                   "unavailable", {"retry-after": str(readiness.retry_after())})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _error_body(self, path: str, status: int, message: str) -> bytes:
        """An error body for ``path``'s dialect (the browser guard's refusals)."""
        code = "forbidden" if status == 403 else "unsupported_media_type"
        return bytes(self._render(path)(status, message, code, None).body)

    def bind(self, tg: anyio.abc.TaskGroup) -> None:
        self._tg = tg

    def spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        assert self._tg is not None, "HttpApi.bind was not called"
        self._tg.start_soon(fn, *args)

    def _error(self, request: HttpRequest, status: int, message: str, code: str | None,
               headers: dict[str, str] | None = None) -> Response:
        """An error answer in the shape of the dialect that ``request`` addressed."""
        return self._render(request.url.path)(status, message, code, headers)

    def _render(self, path: str) -> ErrorRenderer:
        return next((r for prefix, r in self.renderers if path.startswith(prefix)),
                    openai_answer.error_response)

    async def _http_error(self, request: HttpRequest, exc: HttpError) -> Response:
        headers = {"www-authenticate": "Bearer"} if exc.status == 401 else None
        return self._error(request, exc.status, exc.message, exc.code, headers)

    async def _internal(self, request: HttpRequest, exc: Exception) -> Response:
        """A bug costs one request a JSON 500, never a plain-text page."""
        log.exception("HTTP %s %s failed", request.method, request.url.path)
        return self._error(request, 500, f"internal error: {type(exc).__name__}",
                           "internal_error")

    async def _not_found(self, request: HttpRequest, exc: Exception) -> Response:
        return self._error(request, 404, f"no route {request.method} {request.url.path}",
                           "not_found")

    async def _not_allowed(self, request: HttpRequest, exc: Exception) -> Response:
        return self._error(request, 405,
                           f"{request.method} is not allowed on {request.url.path}",
                           "method_not_allowed")

    async def health(self, request: HttpRequest) -> Response:
        """Readiness, as llama-server answers it (routers probe it): 200 while the daemon
        takes work, 503 while it loads its only model or drains."""
        readiness = self.supervisor.readiness
        state = readiness.state()
        if state == READY:
            return JSONResponse({"status": "ok"})
        message = "Loading model" if state == LOADING else "Draining"
        headers = {"retry-after": str(readiness.retry_after())} if state == DRAINING else None
        return JSONResponse({"status": state, "error": {
            "code": 503, "message": message, "type": "unavailable_error"}},
            status_code=503, headers=headers)

    async def load(self, request: HttpRequest) -> Response:
        """vllm-router's load probe (its ``power_of_two`` policy): requests running or
        waiting here. Open, as ``/health`` is: routers send no key."""
        return JSONResponse({"load": len(self.supervisor.requests.active)})

    async def alive(self, request: HttpRequest) -> Response:
        """Liveness: the process answers (loading and draining included)."""
        return JSONResponse({"status": "alive"})

    async def prometheus(self, request: HttpRequest) -> Response:
        self.reader.auth(request)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
