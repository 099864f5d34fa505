"""The Ollama dialect: /api/chat, /api/generate, /api/embed and /api/embeddings over
the shared exchange with the supervisor, and the model routes of ``ollama_meta``.

    POST /api/chat        messages → Generate{messages}    (NDJSON unless "stream": false)
    POST /api/generate    prompt   → Generate{prompt} (``raw``: as is; ``system``: a chat)
    POST /api/embed       input    → Embed   ·   POST /api/embeddings (legacy) prompt → Embed

A stream is NDJSON (``application/x-ndjson``): one object a line, the last with
``done: true`` and Ollama's statistics in nanoseconds: ``total_duration`` (admission to
the end), ``load_duration`` (the wait before decoding began: queue and load),
``prompt_eval_duration`` (to the first token), ``eval_duration`` (the rest). A queued
request gets lines with empty text and ``queue_position: N`` (Ollama clients ignore the
field). ``model`` is echoed as the client named it; names take an optional ``:latest``.
A generate with no prompt (a chat with no messages) loads the model, or with
``keep_alive: 0`` unloads it, as Ollama does. Errors are ``{"error": message}``: with
the dialect-independent statuses before a stream begins, as a last line after.
The request id, ``x-request-id`` and ``x-deadline-ms`` work as in the OpenAI dialect.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ...protocol import (
    Embed,
    Error,
    Format,
    Generate,
    Infill,
    Load,
    Message,
    Role,
    ToolCall,
    Unload,
)
from ..keys import Principal
from ..outcome import Outcome
from . import llamacpp, openai_request
from . import ollama_request as parse
from .answer import (
    Answer,
    Calls,
    Failed,
    Finished,
    FinishReason,
    Queued,
    Text,
    Thinking,
)
from .common import HttpError, Reader, deadline, priority, protocol_errors, request_id
from .exchange import STATUS, Dialect, Exchange, Spawner, control, dumps, on_engine
from .ollama_meta import NDJSON, OllamaMeta, error_response, rfc3339


def _ns(seconds: float | None) -> int:
    return max(0, round((seconds or 0.0) * 1e9))


def statistics(outcome: Outcome | None) -> dict[str, int]:
    """Ollama's final statistics (nanoseconds) from a request's Outcome."""
    if outcome is None:
        return {}
    first = outcome.ttft_s if outcome.ttft_s is not None else outcome.duration_s
    return {"total_duration": _ns(outcome.duration_s), "load_duration": _ns(outcome.queue_wait_s),
            "prompt_eval_count": outcome.prompt_tokens,
            "prompt_eval_duration": _ns(first - outcome.queue_wait_s),
            "eval_count": outcome.generated_tokens,
            "eval_duration": _ns(outcome.duration_s - first)}




@dataclass
class _Shape:
    """How one route's lines look: a chat's ``message``, a generate's ``response``."""

    chat: bool
    model: str

    def line(self, text: str, thinking: str = "", calls: Sequence[ToolCall] = (),
             **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": rfc3339()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [
                    {"id": c.id, "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                    for c in calls]
            body["message"] = message
        else:
            body["response"] = text
            if thinking:
                body["thinking"] = thinking
        return {**body, "done": False, **extra}

    def last(self, reason: FinishReason, outcome: Outcome | None, text: str = "",
             thinking: str = "", calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
        return self.line(text, thinking, calls, done=True,
                         done_reason="length" if reason.truncated else "stop",
                         **statistics(outcome))


class _Answer(Exchange):
    """An Ollama answer: NDJSON lines when streaming, else one object."""

    def __init__(self, api: Spawner, req: Generate | Embed, principal: Principal,
                 shape: _Shape, *, stream: bool, legacy: bool = False) -> None:
        super().__init__(api, req, principal)
        self.shape = shape
        self.stream = stream
        self.legacy = legacy  # /api/embeddings: one vector, no statistics
        self.content_type = NDJSON

    def error_answer(self, event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
        return STATUS[event.kind], dumps({"error": event.message})

    def whole(self, answer: Answer) -> dict[str, Any]:
        if answer.vectors is None:
            first = answer.first
            return self.shape.last(first.reason, first.outcome, first.text, first.reasoning,
                                   first.calls)
        if self.legacy:
            return {"embedding": list(answer.vectors.vectors[0])}
        stats = statistics(answer.vectors.outcome)
        return {"model": self.shape.model, "embeddings": [list(v) for v in
                                                          answer.vectors.vectors],
                **{k: stats[k] for k in ("total_duration", "load_duration",
                                         "prompt_eval_count") if k in stats}}

    def heartbeat(self) -> bytes:
        return _line(self.shape.line(""))  # (a line of no text, as a queued one)

    def on_queued(self, part: Queued) -> bytes:
        return _line(self.shape.line("", queue_position=part.position, **part.eta()))

    def on_calls(self, part: Calls) -> bytes:
        return _line(self.shape.line("", calls=part.calls))

    def on_thinking(self, part: Thinking) -> bytes:
        return _line(self.shape.line("", part.text))

    def on_text(self, part: Text) -> bytes:
        return _line(self.shape.line(part.text)) if part.text else b""

    def on_finished(self, part: Finished) -> bytes:
        return _line(self.shape.last(part.reason, part.outcome))

    def on_failed(self, part: Failed) -> bytes:
        return self.error_answer(part.error, part.outcome)[1] + b"\n"


def _line(obj: dict[str, Any]) -> bytes:
    return dumps(obj) + b"\n"


class Ollama(Dialect):
    """The Ollama routes over ``api`` (where requests run) and ``reader``."""

    def __init__(self, api: Spawner, reader: Reader) -> None:
        super().__init__(api, reader)
        self.meta = OllamaMeta(api, reader)

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/generate", self.generate, methods=["POST"]),
            Route("/api/embed", self.embed, methods=["POST"]),
            Route("/api/embeddings", self.embeddings, methods=["POST"]),
            *self.meta.routes(),
        ]

    async def chat(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        parse.refuse(data, "logprobs")
        raw = data.get("messages")
        if raw is None or raw == []:
            return await self._load_or_unload(request, data, chat=True)
        fields = {"messages": parse.messages(raw), **openai_request.tools(
            {"tools": data.get("tools")}), **parse.think(data)}
        return self._generation(request, data, "chat", chat=True, **fields)

    async def generate(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        parse.refuse(data, "template", "context", "logprobs")
        images = data.get("images")
        suffix = data.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise HttpError(400, "`suffix` must be a string", "invalid_type")
        prompt, system, raw = data.get("prompt"), data.get("system"), data.get("raw", False)
        if prompt is None or prompt == "":
            return await self._load_or_unload(request, data, chat=False)
        if not isinstance(prompt, str):
            raise HttpError(400, "`prompt` must be a string", "invalid_prompt")
        if not isinstance(raw, bool) or not isinstance(system, str | None):
            raise HttpError(400, "`raw` must be a boolean and `system` a string",
                            "invalid_type")
        fields: dict[str, Any] = parse.think(data)
        if suffix:  # fill in the middle, with the model's FIM tokens (as Ollama does)
            if images not in (None, []):
                raise HttpError(400, "`suffix` (fill-in-the-middle) takes no `images`",
                                "invalid_images")
            fields.update(prompt=prompt, format=Format.RAW, infill=Infill(suffix))
        elif images not in (None, []):  # a one-turn chat: the images, then the prompt
            if raw:
                raise HttpError(400, "`images` need the chat template (not `raw`)",
                                "invalid_images")
            turn = [*parse.image_urls("images", images), {"type": "text", "text": prompt}]
            fields["messages"] = parse.messages(
                [*([{"role": "system", "content": system}] if system else []),
                 {"role": "user", "content": turn}])
        elif raw:  # as Ollama reads a raw prompt: control tokens' text as those tokens
            model = parse.model(self.reader, request, data.get("model"))
            _, (ids,) = await on_engine(self.api, request, model, partial(
                llamacpp.mixed_tokens, prompts=[(prompt,)]))
            fields.update(prompt_tokens=tuple(ids))
        elif system:
            fields["messages"] = (Message(Role.SYSTEM, system), Message(Role.USER, prompt))
        else:
            fields["prompt"] = prompt
        return self._generation(request, data, "gen", chat=False, **fields)

    def _stream(self, data: dict[str, Any]) -> bool:
        stream = data.get("stream", True)
        if not isinstance(stream, bool):
            raise HttpError(400, "`stream` must be a boolean", "invalid_type")
        return stream

    def _generation(self, request: HttpRequest, data: dict[str, Any], prefix: str, *,
                    chat: bool, **fields: Any) -> _Answer:
        name = parse.model(self.reader, request, data.get("model"))
        options = parse.options(request, data)
        req = protocol_errors(Generate, request_id(request, prefix), name, **fields, **options)
        shape = _Shape(chat=chat, model=self._echo(data, name))
        return _Answer(self.api, req, request.state.principal, shape,
                       stream=self._stream(data))

    @staticmethod
    def _echo(data: dict[str, Any], name: str) -> str:
        given = data.get("model")
        return given if isinstance(given, str) and given else name

    async def _load_or_unload(self, request: HttpRequest, data: dict[str, Any], *,
                              chat: bool) -> Response:
        """Ollama's "load it" (no prompt) and "unload it" (no prompt, keep_alive 0)."""
        name = parse.model(self.reader, request, data.get("model"))
        self._stream(data)
        rid = request_id(request, "load")
        ms = parse.keep_alive(data).get("keep_alive_ms")
        req: Load | Unload = (Unload(rid, name) if ms == 0 else
                              protocol_errors(Load, rid, name, keep_alive_ms=ms))
        if isinstance(req, Unload) and name not in {
                m.name for m in self.api.supervisor.snapshot().loaded_models}:
            failed = None  # (nothing to unload: done, as Ollama says)
        else:
            failed = await control(self.api, request.state.principal, req)
        if failed is not None:
            return error_response(STATUS[failed.kind], failed.message)
        body = _Shape(chat=chat, model=self._echo(data, name)).line(
            "", done=True, done_reason="unload" if isinstance(req, Unload) else "load")
        return JSONResponse(body, headers={"x-request-id": rid})

    def _embed(self, request: HttpRequest, data: dict[str, Any], texts: tuple[str, ...], *,
               legacy: bool) -> _Answer:
        if data.get("dimensions") is not None:
            raise HttpError(400, "`dimensions` is not supported", "unsupported_dimensions")
        name = parse.model(self.reader, request, data.get("model"))
        req = protocol_errors(Embed, request_id(request, "embd"), name, texts,
                              deadline_ms=deadline(request), **priority(request),
                              **parse.keep_alive(data))
        return _Answer(self.api, req, request.state.principal,
                       _Shape(chat=False, model=self._echo(data, name)), stream=False,
                       legacy=legacy)

    async def embed(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        raw = data.get("input")
        texts = [raw] if isinstance(raw, str) else raw
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise HttpError(400, "`input` must be a string or a list of strings",
                            "invalid_input")
        return self._embed(request, data, tuple(texts), legacy=False)

    async def embeddings(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        prompt = data.get("prompt")
        if not isinstance(prompt, str):
            raise HttpError(400, "`prompt` must be a string", "invalid_prompt")
        if not prompt:  # (Ollama's answer to an empty prompt)
            parse.model(self.reader, request, data.get("model"))
            return JSONResponse({"embedding": []})
        return self._embed(request, data, (prompt,), legacy=True)

