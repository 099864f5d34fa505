"""The web console, and the routes it (or any client) uses beside the dialects':

    GET  /console/                  the page (webconsole/: index.html, app.js, chat.js,
                                    markdown.js, app.css),
                                    shipped in the package; no CDN, no network
    GET  /v1/fleet                  the FleetSnapshot as JSON (as `fleet --json`)
    POST /v1/requests/{id}/cancel   cancel a request by id (as `everycycle cancel`)
    POST /v1/models/{name}/load     load a model (as `everycycle load`)
    POST /v1/models/{name}/unload   unload it (as `everycycle unload`)
    GET  /v1/usage?by=key|model|hour  totals from the audit log (as `everycycle usage`)

A browser's ``GET /`` (it asks for ``text/html``) is sent to ``/console/``; every other
``GET /`` still answers "Ollama is running". The page is served under a strict
Content-Security-Policy (its own script and style only, no inline code, nothing but
this origin to connect to), and renders every name, prompt and answer as text. Its
calls follow the API's rules (key off loopback, Host allow-list, same origin only). A key
cancels only its own principal's requests and sees only its own usage, unless it is an
admin: the daemon's own token ("default") or the socket's user ("local").
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ...errors import EverycycleError
from ...protocol import FleetDescription, encode
from ..events import Cancelled
from ..keys import ADMINS, may_act_for
from .common import HttpError
from .exchange import STATUS, Dialect

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data: blob:; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
_FILES = {"": ("index.html", "text/html; charset=utf-8"),
          "app.js": ("app.js", "text/javascript; charset=utf-8"),
          "chat.js": ("chat.js", "text/javascript; charset=utf-8"),
          "markdown.js": ("markdown.js", "text/javascript; charset=utf-8"),
          "app.css": ("app.css", "text/css; charset=utf-8")}


class Console(Dialect):
    """The console's page and routes over ``api`` and ``reader``."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/console", self.to_console, methods=["GET"]),
            Route("/console/{name:path}", self.page, methods=["GET"]),
            Route("/v1/fleet", self.fleet, methods=["GET"]),
            Route("/v1/requests/{request_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/models/{model:path}/load", self.load, methods=["POST"]),
            Route("/v1/models/{model:path}/unload", self.unload, methods=["POST"]),
            Route("/v1/usage", self.usage, methods=["GET"]),
        ]

    async def to_console(self, request: HttpRequest) -> Response:
        return Response(status_code=307, headers={"location": "/console/"})

    async def page(self, request: HttpRequest) -> Response:
        found = _FILES.get(request.path_params["name"])
        if found is None:
            raise HttpError(404, f"no console file {request.path_params['name']!r}",
                            "not_found")
        name, kind = found
        body = resources.files(__package__).joinpath("webconsole", name).read_bytes()
        return Response(body, media_type=kind, headers={
            "content-security-policy": CSP, "x-content-type-options": "nosniff",
            "referrer-policy": "no-referrer", "cache-control": "no-cache"})

    async def fleet(self, request: HttpRequest) -> Response:
        self.reader.auth(request)
        snap = await self.api.supervisor.fleet.snapshot()
        line = json.loads(encode(FleetDescription(snap)))
        return JSONResponse(line["FleetDescription"])

    async def cancel(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        rid = request.path_params["request_id"]
        sup = self.api.supervisor
        target = sup.requests.active.get(rid)
        if target is None or not may_act_for(principal, target.peer.principal):
            # (The same words whether it is someone else's or none at all.)
            raise HttpError(404, f"no active request '{rid}'", "not_found")
        sup.requests.cancel(target, Cancelled.by(f"{principal.name} (HTTP)"))
        return JSONResponse({"request_id": rid, "cancelled": True})

    async def load(self, request: HttpRequest) -> Response:
        self.reader.auth(request)
        name = request.path_params["model"]
        sup = self.api.supervisor
        if not sup.knows(name):
            raise HttpError(404, f"model '{name}' not found", "model_not_found")
        try:
            spec = sup.residency.spec_for(name, allow_paths=False)
            model = await sup.residency.ensure_loaded(spec, None, retry_failed=True)
        except EverycycleError as exc:
            raise HttpError(STATUS[exc.kind], exc.message, exc.kind.value) from None
        return JSONResponse({"model": name, "loaded": True, "executor": model.executor})

    async def unload(self, request: HttpRequest) -> Response:
        self.reader.auth(request)
        name = request.path_params["model"]
        sup = self.api.supervisor
        if name not in sup.residency.models:
            raise HttpError(400, f"model '{name}' is not loaded", "not_loaded")
        await sup.residency.unload(name, f"model '{name}' unloaded")
        return JSONResponse({"model": name, "unloaded": True})

    async def usage(self, request: HttpRequest) -> Response:
        from ..usage import audit_records, summarize

        principal = self.reader.auth(request)
        by = request.query_params.get("by", "key")
        if by not in ("key", "model", "hour"):
            raise HttpError(400, "`by` must be key, model or hour", "invalid_by")
        audit = self.api.supervisor.audit
        records: Any = audit_records(audit.path) if audit is not None else iter(())
        if principal.name not in ADMINS:
            records = (r for r in records if r.get("principal") == principal.name)
        rows = summarize(records, by=by)
        return JSONResponse({"by": by, "rows": [r.as_json(by) for r in rows]})
