"""``GET /v1/events``: the daemon's events (events.py) as Server-Sent Events.

Each event is ``event: TYPE`` and ``data: {JSON}``; ``?types=request,model_loaded``
keeps those types only (an unknown one is a 400). The same auth, Host and Origin rules
as every other route apply. While nothing happens a comment line comes every heartbeat
period; a reader that falls too far behind gets a last ``cut_off`` event and the stream
ends (events.LIMIT).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse
from starlette.routing import BaseRoute, Route

from ...errors import InvalidRequestError
from ..events import CutOff, dumps, types_of
from .common import HttpError
from .exchange import Dialect


class EventStream(Dialect):
    """``GET /v1/events`` over ``api`` (its supervisor's bus) and ``reader``."""

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/events", self.events, methods=["GET"])]

    async def events(self, request: HttpRequest) -> Any:
        self.reader.auth(request)
        given = request.query_params.get("types")
        try:
            types = types_of(given.split(",") if given else None)
        except InvalidRequestError as exc:
            raise HttpError(400, exc.message, "invalid_types") from None
        sub = self.api.supervisor.bus.subscribe(types)
        beat = self.api.heartbeat_s or 15.0

        async def lines() -> AsyncIterator[bytes]:
            try:
                yield b": everycycle events\n\n"
                while True:
                    with anyio.move_on_after(beat):
                        for event in await sub.next():
                            yield f"event: {event.TYPE}\ndata: {dumps(event)}\n\n".encode()
                            if isinstance(event, CutOff):
                                return
                        continue
                    yield b": keep-alive\n\n"
            except anyio.EndOfStream:
                return
            finally:
                sub.close()

        return StreamingResponse(lines(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
