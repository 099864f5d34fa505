"""The console chat's routes beside the dialects': the daemon's MCP tools and the saved
conversations, as ``chat`` has them.

    GET  /v1/mcp/tools                   the MCP servers' tools, and what did not start
    POST /v1/mcp/tools/{name}/call       run one: {"arguments": {...}} →
                                         {"content": text, "is_error": bool}
    GET  /v1/conversations               the saved conversations (newest first)
    GET  /v1/conversations/{id}          one, whole
    POST /v1/conversations               save a new one → {"id"}
    PUT  /v1/conversations/{id}          save it again, whole

Only for the daemon's own user: a loopback visitor (no key needed there) or an admin
key. A tool runs as the daemon's user on its host and a conversation is that user's
file, so an API key's holder gets 403; the HTTP dialects never run MCP tools for their
clients (agents bring their own tools). The console asks its user before each call.
"""

from __future__ import annotations

import json
from typing import Any

import anyio.to_thread
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ... import conversations
from ...errors import EverycycleError
from ...tooluse.host import CALL_TIMEOUT_S
from ..keys import ADMINS
from .common import HttpError
from .exchange import STATUS, Dialect


class ConsoleChat(Dialect):
    """Tools and saved conversations for the console's chat."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/mcp/tools", self.tools, methods=["GET"]),
            Route("/v1/mcp/tools/{name}/call", self.call, methods=["POST"]),
            Route("/v1/conversations", self.listing, methods=["GET"]),
            Route("/v1/conversations", self.create, methods=["POST"]),
            Route("/v1/conversations/{cid}", self.one, methods=["GET"]),
            Route("/v1/conversations/{cid}", self.save, methods=["PUT"]),
        ]

    def _owner(self, request: HttpRequest) -> None:
        if self.reader.auth(request).name not in ADMINS:
            raise HttpError(403, "only the daemon's own user (on loopback, or with the "
                            "daemon's token) may use its tools and conversations",
                            "forbidden")

    async def tools(self, request: HttpRequest) -> Response:
        self._owner(request)
        try:
            listed, problems = await self.api.supervisor.mcp.tools()
        except EverycycleError as exc:
            raise HttpError(STATUS[exc.kind], exc.message, exc.kind.value) from None
        return JSONResponse({"tools": [
            {"server": t.server, "name": t.name, "description": t.description,
             "parameters": json.loads(t.parameters)} for t in listed],
            "problems": problems})

    async def call(self, request: HttpRequest) -> Response:
        self._owner(request)
        body = await self.reader.json(request)
        arguments = body.get("arguments", {})
        if not isinstance(arguments, dict):
            raise HttpError(400, "`arguments` must be a JSON object", "invalid_arguments")
        try:
            text, is_error = await self.api.supervisor.mcp.call(
                request.path_params["name"], arguments, CALL_TIMEOUT_S)
        except EverycycleError as exc:
            raise HttpError(404, exc.message, "unknown_tool") from None
        return JSONResponse({"content": text, "is_error": is_error})

    async def listing(self, request: HttpRequest) -> Response:
        self._owner(request)
        found = await anyio.to_thread.run_sync(conversations.listed)
        return JSONResponse({"conversations": [
            {"id": s.id, "model": s.model, "updated": s.updated, "title": s.title,
             "messages": len(s.messages)} for s in found]})

    async def one(self, request: HttpRequest) -> Response:
        self._owner(request)
        cid = request.path_params["cid"]
        try:
            saved = await anyio.to_thread.run_sync(conversations.load, cid)
        except EverycycleError as exc:
            raise HttpError(404, exc.message, "not_found") from None
        return JSONResponse(conversations.as_json(saved))

    async def create(self, request: HttpRequest) -> Response:
        return await self._write(request, None)

    async def save(self, request: HttpRequest) -> Response:
        return await self._write(request, request.path_params["cid"])

    async def _write(self, request: HttpRequest, cid: str | None) -> Response:
        self._owner(request)
        body: dict[str, Any] = await self.reader.json(request)
        try:
            saved = conversations.from_json({**body, **({"id": cid} if cid else {})})
            await anyio.to_thread.run_sync(saved.save)
        except EverycycleError as exc:
            raise HttpError(400, exc.message, "invalid_conversation") from None
        except OSError as exc:
            raise HttpError(500, f"the conversation was not saved: {exc}", "io") from None
        return JSONResponse({"id": saved.id})
