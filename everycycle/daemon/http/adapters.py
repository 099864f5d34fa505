"""``GET``/``POST /lora-adapters``, as llama-server has them: a model's LoRA adapters
(``[{"id", "path", "scale"}]``) and their scales for every request that names none
(``POST`` a list of ``{"id", "scale"}``). ``?model=NAME`` picks the model (default: the
registry's default model); a request's own ``lora`` field overrides these per request."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ...errors import EverycycleError
from ...models.registry import ModelSpec
from .common import HttpError
from .exchange import Dialect
from .openai_request import lora


class Adapters(Dialect):
    """The adapters routes over ``api`` (its supervisor's registry and scales)."""

    def routes(self) -> list[BaseRoute]:
        return [Route("/lora-adapters", self.listed, methods=["GET"]),
                Route("/lora-adapters", self.set_scales, methods=["POST"])]

    def _spec(self, request: HttpRequest) -> ModelSpec:
        registry = self.api.supervisor.registry
        try:
            return registry.get(request.query_params.get("model") or registry.default_name())
        except EverycycleError as exc:
            raise HttpError(404, exc.message, "model_not_found") from None

    def _answer(self, spec: ModelSpec) -> Response:
        scales = self.api.supervisor.lora_scales.of(spec)
        return JSONResponse([{"id": i, "path": a.source, "scale": scale}
                             for i, (a, scale) in enumerate(zip(spec.lora, scales,
                                                                strict=True))])

    async def listed(self, request: HttpRequest) -> Response:
        self.reader.auth(request)
        return self._answer(self._spec(request))

    async def set_scales(self, request: HttpRequest) -> Response:
        self.reader.auth(request)
        spec = self._spec(request)
        body: Any = await self.reader.json_value(request)
        asked = lora(body).get("lora", ())
        try:
            self.api.supervisor.lora_scales.update(spec, [(s.id, s.scale) for s in asked])
        except EverycycleError as exc:
            raise HttpError(400, exc.message, "invalid_value") from None
        return self._answer(spec)
