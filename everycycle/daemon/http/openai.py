"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/embeddings and
/v1/models, over the shared exchange with the supervisor.

    POST /v1/chat/completions   messages → Generate{messages}   (SSE when "stream")
    POST /v1/completions        prompt   → Generate{prompt, format raw}
    POST /v1/embeddings         input    → Embed (float or base64 vectors)
    GET  /v1/models[/{id}]      the registry, with where each model is loaded

What the socket protocol offers stays reachable: the request id comes back in the
``x-request-id`` header (a client may also choose it by sending that header), so
``everycycle cancel ID`` stops it; a queued stream gets ``: queue_position N`` SSE comment
lines, which OpenAI clients ignore; ``x-deadline-ms`` sets the deadline. Errors are
OpenAI error objects: Invalid 400, unknown model 404, Rejected 429 (with Retry-After),
Cancelled 499, ModelNotLoaded 503, Internal 500; a stream that already began ends
with an error event and no ``[DONE]``. How answers and errors look: openai_answer.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ...protocol import Embed, Format, Generate, Infill, Role
from . import openai_request as parse
from .common import (
    HttpError,
    deadline,
    priority,
    protocol_errors,
    request_id,
    stream_flag,
)
from .exchange import Dialect, on_engine, text_biases
from .llamacpp import mixed_tokens
from .openai_answer import Generation, Shape


class OpenAI(Dialect):
    """The OpenAI routes over ``api`` (where requests run) and ``reader``."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/chat/completions/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/chat/completions/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
            Route("/chat/completions/render", self.render_chat, methods=["POST"]),
            Route("/v1/completions/render", self.render_completion, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
        ]

    def _generation(self, request: HttpRequest, data: dict[str, Any], req: Generate,
                    shape: Shape) -> Generation:
        stream = stream_flag(data)
        opts = data.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        first, *more = self._choices(req, data)
        return Generation(self.api, first, request.state.principal, shape, stream=stream,
                           include_usage=include_usage, more=more)

    def _choices(self, req: Generate, data: dict[str, Any]) -> list[Generate]:
        """``n`` requests for ``n`` choices: ``req``, and copies ``ID.1``, ``ID.2``, … with
        seeds ``seed+1``, … (distinct when sampled; greedy ones agree). At most the
        model's slots, so that they run at once."""
        n = data.get("n", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise HttpError(400, "`n` must be a positive integer", "invalid_value")
        if n == 1:
            return [req]
        registry = self.api.supervisor.registry
        spec = registry.models.get(registry.alias(req.model) or req.model)
        slots = spec.parallel if spec is not None else 1
        if n > slots:
            raise HttpError(400, f"n={n} is more than model '{req.model}' has slots ({slots}):"
                            " its choices run at once", "unsupported_n")
        if len(req.request_id) > 60:
            raise HttpError(400, "x-request-id: at most 60 characters with n > 1",
                            "invalid_request_id")
        return [req, *(replace(req, request_id=f"{req.request_id}.{i}",
                               seed=None if req.seed is None else (req.seed + i) % (2**32 - 1))
                       for i in range(1, n))]

    async def chat_completions(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        await self._text_biases(request, data)
        if data.get("add_generation_prompt") is True and data.get(
                "continue_final_message") is True:  # (llama-server's own check)
            raise HttpError(400, "`add_generation_prompt` and `continue_final_message` are "
                            "mutually exclusive", "invalid_value")
        messages = parse.messages(data.get("messages"))
        if len(messages) > 1 and all(m.role is Role.ASSISTANT for m in messages[-2:]):
            raise HttpError(400, "Cannot have 2 or more assistant messages at the end of the "
                            "list", "invalid_messages")
        tools, think = parse.tools(data), parse.thinking(data)
        exchange = self._completion(request, data, "chatcmpl", messages=messages, **tools,
                                    **think)
        if data.get("verbose") is True:  # (llama-server's debugging aid)
            listed = json.loads(tools["tools"]) if "tools" in tools else None
            _, prompt = await on_engine(
                self.api, request, exchange.req.model, lambda engine: engine.chat_prompt(
                    messages, listed, think.get("think"))[1].text)
            exchange.verbose = {"prompt": prompt}
        return exchange

    async def _text_biases(self, request: HttpRequest, data: dict[str, Any]) -> None:
        """A ``logit_bias`` keyed by text (llama-server's), as token ids."""
        if isinstance(data.get("logit_bias"), dict | list):
            model = self.reader.model(request, data.get("model"), "GET /v1/models")
            await text_biases(self.api, request, model, data)

    async def input_tokens(self, request: HttpRequest) -> Response:
        """The tokens a chat completion's prompt would read (llama-server's
        ``/chat/completions/input_tokens``): its messages and tools through the model's
        chat template, nothing generated."""
        return JSONResponse({"input_tokens": len(await self._chat_tokens(request))})

    async def render_chat(self, request: HttpRequest) -> Response:
        """vLLM's ``/v1/chat/completions/render``: the token ids a chat completion's
        prompt would be, which vllm-router's cache-aware and KV-aware policies key on
        (asked of every daemon behind it, each request)."""
        return JSONResponse({"token_ids": await self._chat_tokens(request)})

    async def _chat_tokens(self, request: HttpRequest) -> list[int]:
        data = await self.reader.json(request)
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        messages = parse.messages(data.get("messages"))
        tools = parse.tools(data).get("tools")
        listed = json.loads(tools) if tools is not None else None
        think = parse.thinking(data).get("think")
        _, ids = await on_engine(self.api, request, model, lambda engine: list(
            engine.chat_prompt(messages, listed, think)[0]))
        return ids

    async def render_completion(self, request: HttpRequest) -> Response:
        """vLLM's ``/v1/completions/render``: a text completion's prompt as the token
        ids it would read (a list of prompts: a list of answers)."""
        data = await self.reader.json(request)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return JSONResponse({"token_ids": prompt})
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not isinstance(texts, list) or not texts or not all(
                isinstance(t, str) for t in texts):
            raise HttpError(400, "`prompt` must be a string, a list of strings or a list "
                            "of token ids", "invalid_prompt")
        if data.get("suffix"):
            raise HttpError(501, "a fill-in-the-middle prompt is not rendered",
                            "not_implemented")
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        _, groups = await on_engine(self.api, request, model, partial(
            mixed_tokens, prompts=[(t,) for t in texts]))
        answers = [{"token_ids": list(ids)} for ids in groups]
        return JSONResponse(answers[0] if isinstance(prompt, str) else answers)

    async def completions(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        await self._text_biases(request, data)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return self._completion(request, data, "cmpl", prompt_tokens=tuple(prompt))
        if not isinstance(prompt, str):
            raise HttpError(400, "`prompt` must be a string or a list of token ids (one "
                            "prompt per request)", "invalid_prompt")
        suffix = data.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise HttpError(400, "`suffix` must be a string", "invalid_type")
        if suffix:  # (fill in the middle)
            return self._completion(request, data, "cmpl", prompt=prompt, format=Format.RAW,
                                    infill=Infill(suffix))
        # As llama-server and vLLM read a completion's text: control tokens' text as
        # those tokens (a client's own FIM or chat template works).
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        _, (ids,) = await on_engine(self.api, request, model, partial(
            mixed_tokens, prompts=[(prompt,)]))
        return self._completion(request, data, "cmpl", prompt_tokens=tuple(ids),
                                format=Format.RAW)

    def _completion(self, request: HttpRequest, data: dict[str, Any], prefix: str,
                    **fields: Any) -> Generation:
        """A chat completion (``messages``) or a text completion (``prompt``)."""
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        options = parse.options(request, data)
        options.update(parse.response_format(data.get("response_format")))
        options.update(parse.logprobs(data, chat="messages" in fields))
        if data.get("return_progress") is True and stream_flag(data):  # (llama-server's)
            options["progress"] = True
        rid = request_id(request, prefix)
        req = protocol_errors(Generate, rid, model, **fields, **options)
        shape = Shape(chat="messages" in fields, request_id=rid, model=model)
        return self._generation(request, data, req, shape)

    async def embeddings(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        raw = data.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise HttpError(400, "`input` must be a string or a list of strings "
                            "(token arrays are not supported)", "invalid_input")
        encoding = data.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise HttpError(400, "`encoding_format` must be float or base64",
                            "invalid_encoding_format")
        rid = request_id(request, "embd")
        shape = Shape(chat=False, request_id=rid, model=model, encoding=encoding)
        req = protocol_errors(Embed, rid, model, tuple(texts), deadline_ms=deadline(request),
                              **priority(request, data))
        return Generation(self.api, req, request.state.principal, shape, stream=False,
                           include_usage=False)

    def _model_objects(self, names: list[str]) -> list[dict[str, Any]]:
        sup = self.api.supervisor
        loaded = {m.name: m for m in sup.snapshot().loaded_models}  # (one snapshot)
        out = []
        for name in names:
            spec = sup.registry.models[name]
            here = loaded.get(name)
            # a slot's context as loaded; models.toml's before a load (null: chosen then)
            context = here.context if here is not None and here.context else spec.context
            out.append({"id": name, "object": "model", "created": 0, "owned_by": "everycycle",
                        "revision": spec.revision, "loaded": here is not None,
                        "executor": here.assigned_executor if here else None,
                        "default": name == sup.registry.default,
                        # a slot's context, under the names clients read it by
                        "context_length": context, "max_model_len": context,
                        "max_context_length": context})
        return out

    async def list_models(self, request: HttpRequest) -> Response:
        """The registry; in Anthropic's shape when asked with ``anthropic-version``."""
        principal = self.reader.auth(request)
        models = self._model_objects(self.reader.visible(principal))
        if "anthropic-version" in request.headers:
            data = [{"type": "model", "id": m["id"], "display_name": m["id"],
                     "created_at": "1970-01-01T00:00:00Z",
                     "max_input_tokens": m["context_length"],
                     "max_tokens": m["context_length"]} for m in models]
            return JSONResponse({"data": data, "has_more": False,
                                 "first_id": data[0]["id"] if data else None,
                                 "last_id": data[-1]["id"] if data else None})
        return JSONResponse({"object": "list", "data": models})

    async def get_model(self, request: HttpRequest) -> Response:
        principal = self.reader.auth(request)
        name = request.path_params["model_id"]
        if name not in self.reader.visible(principal):
            raise HttpError(404, f"model '{name}' not found", "model_not_found")
        return JSONResponse(self._model_objects([name])[0])
