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
with an error event and no ``[DONE]``.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ...protocol import Embed, Error, Format, Generate, Infill, Role, TokenLogprob, ToolCall
from ..outcome import Outcome
from . import openai_request as parse
from .answer import (
    Answer,
    Calls,
    Choice,
    Failed,
    Finished,
    FinishReason,
    Prefill,
    Queued,
    Running,
    Text,
    Thinking,
    Usage,
    Vectors,
)
from .common import (
    HttpError,
    deadline,
    priority,
    protocol_errors,
    request_id,
    stream_flag,
)
from .exchange import STATUS, Dialect, Exchange, Spawner, dumps, on_engine, text_biases
from .llamacpp import mixed_tokens
from .llamafields import FINGERPRINT, timings

_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "model_not_loaded",
}


def error_body(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": _TYPE.get(status, "error"), "param": None,
                      "code": code}}


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status, headers=headers)


def error_answer(event: Error, outcome: Outcome | None = None) -> tuple[int, bytes]:
    """A terminal Error's status and OpenAI error object (``context_length_exceeded``,
    in OpenAI's words, for a prompt longer than the context, with llama-server's type
    ``exceed_context_size_error`` and its sizes)."""
    status = STATUS[event.kind]
    if outcome is not None and outcome.context_limit is not None:
        body = error_body(status, (
            f"This model's maximum context length is {outcome.context_limit} tokens. "
            f"However, your messages resulted in {outcome.prompt_tokens} tokens."),
            "context_length_exceeded")
        # llama-server's type and sizes beside OpenAI's code (each dialect's clients read
        # their own: OpenAI's the code, llama-server's the type)
        body["error"].update(type="exceed_context_size_error",
                             n_prompt_tokens=outcome.prompt_tokens,
                             n_ctx=outcome.context_limit)
        return status, dumps(body)
    return status, dumps(error_body(status, event.message, event.kind.value))


_FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
           FinishReason.CONTEXT: "length", FinishReason.TOOL_CALLS: "tool_calls"}
"""OpenAI's ``finish_reason`` for each of ours."""


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: OpenAI's ``content`` list."""
    return {"content": [{"token": e.token, "logprob": e.logprob,
                         "bytes": list(e.token.encode()),
                         "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                                           "bytes": list(t.token.encode())} for t in e.top]}
                        for e in entries], "refusal": None}


def text_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A completion choice's ``logprobs``: the legacy parallel lists."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets}


def tool_calls(calls: Sequence[ToolCall], *, indexed: bool = False) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` (with ``index`` for a streamed delta)."""
    return [{**({"index": i} if indexed else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


def _usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage; drafts verified (speculative decoding) as its Predicted Outputs'
    accepted and rejected prediction tokens."""
    details: dict[str, int] = {}
    if usage.reasoning is not None:
        details["reasoning_tokens"] = usage.reasoning
    if usage.drafted:
        details["accepted_prediction_tokens"] = usage.draft_accepted
        details["rejected_prediction_tokens"] = usage.drafted - usage.draft_accepted
    return {"prompt_tokens": usage.prompt, "completion_tokens": usage.generated,
            "total_tokens": usage.total,
            "prompt_tokens_details": {"cached_tokens": usage.cached},
            **({"completion_tokens_details": details} if details else {})}


@dataclass
class _Shape:
    """How one endpoint's objects look (chat.completion vs text_completion)."""

    chat: bool
    request_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    encoding: str = "float"

    def chunk(self, text: str | None, finish: str | None, *, role: bool = False,
              usage: dict[str, Any] | None | bool = False,
              delta: dict[str, Any] | None = None, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        if self.chat:
            delta = dict(delta or {})
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta,
                                      "logprobs": chat_logprobs(logprobs) if logprobs else None,
                                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "",
                      "logprobs": text_logprobs(logprobs) if logprobs else None,
                      "finish_reason": finish}
            obj = "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": obj, "created": self.created,
                                "model": self.model, "system_fingerprint": FINGERPRINT,
                                "choices": [choice]}
        if usage is not False:
            body["usage"] = usage
        return body

    def embeddings(self, part: Vectors) -> dict[str, Any]:
        """OpenAI's embeddings list; ``base64`` packs little-endian float32s."""
        data = []
        for i, vector in enumerate(part.vectors):
            value: Any = list(vector)
            if self.encoding == "base64":
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": value})
        tokens = part.usage.prompt
        return {"object": "list", "data": data, "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def choice(self, index: int, answer: Choice, asked: bool) -> dict[str, Any]:
        """One whole choice of a non-streamed answer (``asked``: for logprobs)."""
        finish = _FINISH[answer.reason]
        if not self.chat:
            return {"index": index, "text": answer.text, "finish_reason": finish,
                    "logprobs": text_logprobs(answer.logprobs) if asked else None}
        message: dict[str, Any] = {"role": "assistant", "content": (
            None if answer.calls and not answer.text else answer.text)}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = tool_calls(answer.calls)
        return {"index": index, "message": message, "finish_reason": finish,
                "logprobs": chat_logprobs(answer.logprobs) if asked else None}


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else dumps(obj).decode()
    return f"data: {data}\n\n".encode()


class _Generation(Exchange):
    """An OpenAI answer: SSE chunks when streaming, else one object; with ``n`` > 1, one
    protocol request per choice, answered together."""

    def __init__(self, api: Spawner, req: Generate | Embed, principal: Any, shape: _Shape,
                 *, stream: bool, include_usage: bool, more: Sequence[Generate] = ()) -> None:
        super().__init__(api, req, principal, more)
        self.shape = shape
        self.stream = stream
        self.include_usage = include_usage
        self.asked = [isinstance(r, Generate) and r.logprobs is not None for r in self.reqs]
        self.usage: dict[str, Any] | None | bool = None if include_usage else False
        """Each chunk's ``usage``: null until the last when the client asked for it."""
        self.role_sent: set[int] = set()
        self.usages: list[Usage] = []
        self.verbose: dict[str, Any] | None = None
        """llama-server's ``__verbose`` (asked with ``"verbose": true``): the prompt as
        the template rendered it, and the answer in its own words."""

    def error_answer(self, event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
        return error_answer(event, outcome)

    def whole(self, answer: Answer) -> dict[str, Any]:
        if answer.vectors is not None:
            return self.shape.embeddings(answer.vectors)
        shape = self.shape
        return {"id": shape.request_id, "object": "chat.completion" if shape.chat
                else "text_completion", "created": shape.created, "model": shape.model,
                "system_fingerprint": FINGERPRINT,
                "choices": [shape.choice(i, c, self.asked[i])
                            for i, c in enumerate(answer.choices)],
                "usage": _usage(answer.usage),
                "timings": timings(answer.usage, answer.first.outcome),
                **({"__verbose": {**self.verbose, "content": answer.first.text,
                                  "tokens_evaluated": answer.usage.prompt,
                                  "tokens_predicted": answer.usage.generated}}
                   if self.verbose is not None else {})}

    def _chunk(self, text: str | None, finish: str | None = None, **fields: Any) -> bytes:
        return _sse(self.shape.chunk(text, finish, usage=self.usage, **fields))

    def on_queued(self, part: Queued) -> bytes:
        eta = "" if part.eta_ms is None else f" eta_ms {part.eta_ms}"
        return f": queue_position {part.position}{eta}\n\n".encode()

    def on_running(self, part: Running) -> bytes:
        if part.index in self.role_sent or not self.shape.chat:
            return b""
        self.role_sent.add(part.index)
        # (the role alone, its content null: as llama-server and OpenAI begin a stream)
        return self._chunk(None, role=True, delta={"content": None}, index=part.index)

    def on_prefill(self, part: Prefill) -> bytes:
        """llama-server's shape, as its clients read it."""
        line = self.shape.chunk(None, None, role=True, usage=self.usage, index=part.index)
        line["choices"][0]["delta"]["content"] = None
        line["prompt_progress"] = {"total": part.total, "cache": part.cached,
                                   "processed": part.processed, "time_ms": part.time_ms}
        return _sse(line)

    def on_calls(self, part: Calls) -> bytes:
        return self._chunk(None, delta={"tool_calls": tool_calls(part.calls, indexed=True)},
                           index=part.index)

    def on_thinking(self, part: Thinking) -> bytes:
        if not self.shape.chat:
            return b""
        return self._chunk(None, delta={"reasoning_content": part.text}, index=part.index)

    def on_text(self, part: Text) -> bytes:
        return self._chunk(part.text, index=part.index,
                           logprobs=list(part.logprobs) if part.logprobs else None)

    def on_finished(self, part: Finished) -> bytes:
        self.usages.append(part.usage)
        finish = self.shape.chunk(None if self.shape.chat else "", _FINISH[part.reason],
                                  usage=self.usage, index=part.index)
        finish["timings"] = timings(part.usage, part.outcome)
        out = _sse(finish)
        if not part.last:
            return out
        if self.include_usage:
            together = Usage.together(self.usages)
            last = self.shape.chunk(None, None, usage=_usage(together))
            last["choices"] = []
            last["timings"] = timings(together, part.outcome)
            out += _sse(last)
        return out + _sse("[DONE]")

    def on_failed(self, part: Failed) -> bytes:
        return b"data: " + error_answer(part.error, part.outcome)[1] + b"\n\n"


class OpenAI(Dialect):
    """The OpenAI routes over ``api`` (where requests run) and ``reader``."""

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/chat/completions/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/chat/completions/input_tokens", self.input_tokens, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
        ]

    def _generation(self, request: HttpRequest, data: dict[str, Any], req: Generate,
                    shape: _Shape) -> _Generation:
        stream = stream_flag(data)
        opts = data.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        first, *more = self._choices(req, data)
        return _Generation(self.api, first, request.state.principal, shape, stream=stream,
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
        data = await self.reader.json(request)
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        messages = parse.messages(data.get("messages"))
        tools = parse.tools(data).get("tools")
        listed = json.loads(tools) if tools is not None else None
        think = parse.thinking(data).get("think")
        _, count = await on_engine(self.api, request, model, lambda engine: len(
            engine.chat_prompt(messages, listed, think)[0]))
        return JSONResponse({"input_tokens": count})

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
                    **fields: Any) -> _Generation:
        """A chat completion (``messages``) or a text completion (``prompt``)."""
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        options = parse.options(request, data)
        options.update(parse.response_format(data.get("response_format")))
        options.update(parse.logprobs(data, chat="messages" in fields))
        if data.get("return_progress") is True and stream_flag(data):  # (llama-server's)
            options["progress"] = True
        rid = request_id(request, prefix)
        req = protocol_errors(Generate, rid, model, **fields, **options)
        shape = _Shape(chat="messages" in fields, request_id=rid, model=model)
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
        shape = _Shape(chat=False, request_id=rid, model=model, encoding=encoding)
        req = protocol_errors(Embed, rid, model, tuple(texts), deadline_ms=deadline(request),
                              **priority(request, data))
        return _Generation(self.api, req, request.state.principal, shape, stream=False,
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
