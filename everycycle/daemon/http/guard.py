"""What keeps web pages out of the daemon's HTTP API (an ASGI middleware).

A page in any browser tab can send requests to 127.0.0.1: a "simple" cross-origin POST
(``text/plain``) needs no CORS preflight, and DNS rebinding (``evil.example`` resolving
to 127.0.0.1) makes the page same-origin with the daemon, with full read access. So:

1. On a loopback listener, the ``Host`` header must name the loopback address,
   ``localhost``, or a name the operator allows (``--allow-host``): a rebinding page's
   requests carry its own name and get 403.
2. A request with an ``Origin`` is cross-origin unless that origin is allowed
   (``--cors-origin``, repeatable; ``*`` allows any) or is this daemon's own (the
   console's page: ``http://`` and the very Host checked by rule 1): 403 otherwise. Allowed origins get
   CORS headers, and their preflight (``OPTIONS``) is answered; nobody else's is.
3. A POST body with a Content-Type must say ``application/json``: 415 otherwise, so a
   form or a ``text/plain`` body never reaches a route. Under the ``lenient`` prefixes
   (Ollama's ``/api/`` and llama-server's native routes, whose documented usage is
   ``curl -d '{…}'``) a form type is let
   through from a request with no Origin: no browser sends one without it, and a
   rebinding page is refused by its Host already.

Clients that are not browsers (curl, the SDKs, editors) send no Origin and pass.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

ALLOWED_HEADERS = ("authorization, content-type, x-api-key, x-request-id, x-deadline-ms, "
                   "x-priority, "
                   "anthropic-version, openai-organization, openai-project")
ErrorBody = Callable[[str, int, str], bytes]
"""(path, status, message) -> the error body in the route's dialect."""


def _host_name(host: str) -> str:
    """``host`` without its port (``[::1]:8080`` -> ``::1``), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class Guard:
    """Wraps ``app``; ``loopback``: the listener is on loopback (rule 1 applies)."""

    def __init__(self, app: App, *, loopback: bool, allowed_hosts: Sequence[str] = (),
                 cors_origins: Sequence[str] = (), error_body: ErrorBody,
                 lenient: Sequence[str] = ()) -> None:
        self.app = app
        self.lenient = tuple(lenient)
        self.loopback = loopback
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.cors_origins = frozenset(o.rstrip("/") for o in cors_origins)
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await self._refuse(send, path, *refusal)
            return
        origin = headers.get("origin")
        cors = self._cors_headers(origin) if origin is not None else []
        if scope["method"] == "OPTIONS" and origin is not None:  # a preflight, allowed
            await send({"type": "http.response.start", "status": 200, "headers": [
                *cors, (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                (b"access-control-allow-headers", ALLOWED_HEADERS.encode()),
                (b"access-control-max-age", b"600")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if not cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str] | None:
        """(status, why) when the request is refused, else None."""
        if self.loopback:
            name = _host_name(headers.get("host", ""))
            if not (is_loopback_name(name) or name in self.allowed_hosts):
                return 403, (f"Host {name or '(none)'!r} is not this daemon's: on loopback it "
                             "answers 127.0.0.1, ::1 and localhost (`everycycle daemon "
                             "--allow-host NAME` adds a name)")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin) and not self._same_origin(
                origin, headers):
            return 403, (f"origin {origin!r} may not use this API (`everycycle daemon "
                         "--cors-origin ORIGIN` allows one)")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            # (None at all passes: a browser sends an Origin with such a body, or is
            # same-origin only by rebinding, both refused above.)
            curl = (kind == "application/x-www-form-urlencoded" and origin is None
                    and scope.get("path", "").startswith(self.lenient))
            if kind and kind != "application/json" and not kind.endswith("+json") and not curl:
                return 415, (f"the body must be JSON with Content-Type: application/json "
                             f"(got {kind or 'none'})")
        return None

    @staticmethod
    def _same_origin(origin: str, headers: dict[str, str]) -> bool:
        """The page this daemon serves (the console) calling its own API: the Origin is
        this very Host (which rule 1 has checked: a rebinding page's is not)."""
        host = headers.get("host", "").strip().lower()
        return bool(host) and origin.rstrip("/").lower() == f"http://{host}"

    def _origin_allowed(self, origin: str) -> bool:
        return "*" in self.cors_origins or origin.rstrip("/") in self.cors_origins

    def _cors_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        return [(b"access-control-allow-origin", origin.encode("latin-1")),
                (b"access-control-expose-headers", b"x-request-id, retry-after"),
                (b"vary", b"Origin")]

    async def _refuse(self, send: Send, path: str, status: int, why: str) -> None:
        body = self.error_body(path, status, why)
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
