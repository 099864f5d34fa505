"""The routes of resumable streams (streams.py keeps their bytes), as llama-server's:

    GET    /v1/stream?conv_id=ID&from=N   the bytes from offset N, then live ones until
                                          the answer ends (text/event-stream)
    DELETE /v1/stream?conv_id=ID          stop it (cancels the request), forget it: 204
    POST   /v1/streams/lookup             {"conversation_ids": [...]}: those sessions'
                                          state (only ids the caller names)
"""

from __future__ import annotations

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from .common import HttpError
from .exchange import Dialect


class Resume(Dialect):
    """The routes that read, stop and look up resumable streams."""

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/stream", self.read, methods=["GET"]),
                Route("/v1/stream", self.stop, methods=["DELETE"]),
                Route("/v1/streams/lookup", self.lookup, methods=["POST"])]

    def _conv_id(self, request: HttpRequest) -> str:
        conv_id = request.query_params.get("conv_id", "")
        if not conv_id:
            raise HttpError(400, "Missing conversation id (`conv_id`)", "invalid_request")
        return conv_id

    async def read(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        session = self.api.streams.get(principal, self._conv_id(request))
        if session is None:
            raise HttpError(404, "Stream not found or expired", "not_found")
        given = request.query_params.get("from", "0")
        if not given.isdigit():
            raise HttpError(400, "Invalid 'from' offset", "invalid_request")
        if int(given) < session.dropped:
            raise HttpError(400, "Stream offset lost, please restart", "invalid_request")
        return StreamingResponse(session.read_from(int(given)),
                                 media_type=session.content_type,
                                 headers={"cache-control": "no-cache"})

    async def stop(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        self.api.streams.forget(principal, self._conv_id(request))
        return Response(status_code=204)

    async def lookup(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        data = await self.reader.json(request)
        ids = data.get("conversation_ids")
        if not isinstance(ids, list):
            raise HttpError(400, "`conversation_ids` must be a list of strings",
                            "invalid_request")
        wanted = [i for i in ids if isinstance(i, str) and i]
        return JSONResponse([s.state() for s in self.api.streams.matching(principal, wanted)])
