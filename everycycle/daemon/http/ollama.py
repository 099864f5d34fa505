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
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ...protocol import (
    Accepted,
    Embed,
    Embeddings,
    Error,
    Format,
    Generate,
    Load,
    Message,
    Role,
    Tokens,
    ToolCalls,
    Unload,
)
from ..keys import Principal
from ..outcome import Outcome
from . import ollama_request as parse
from . import openai_request
from .common import HttpError, Reader, deadline, priority, protocol_errors, queue_eta, request_id
from .exchange import STATUS, Dialect, Events, Exchange, Send, Spawner, dumps
from .ollama_meta import NDJSON, OllamaMeta, control, error_response, rfc3339


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


def _done_reason(outcome: Outcome | None) -> str:
    return "length" if outcome and outcome.finish_reason in ("length", "context") else "stop"


@dataclass
class _Shape:
    """How one route's lines look: a chat's ``message``, a generate's ``response``."""

    chat: bool
    model: str

    def line(self, text: str, thinking: str = "", calls: ToolCalls | None = None,
             **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": rfc3339()}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [
                    {"id": c.id, "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                    for c in calls.calls]
            body["message"] = message
        else:
            body["response"] = text
            if thinking:
                body["thinking"] = thinking
        return {**body, "done": False, **extra}

    def last(self, outcome: Outcome | None, text: str = "", thinking: str = "",
             calls: ToolCalls | None = None) -> dict[str, Any]:
        return self.line(text, thinking, calls, done=True, done_reason=_done_reason(outcome),
                         **statistics(outcome))


def _error(event: Error) -> bytes:
    return dumps({"error": event.message})


class _Answer(Exchange):
    """An Ollama answer: NDJSON lines when streaming, else one object."""

    def __init__(self, api: Spawner, req: Generate | Embed, principal: Principal,
                 shape: _Shape, *, stream: bool, legacy: bool = False) -> None:
        super().__init__(api, req, principal)
        self.shape = shape
        self.stream = stream
        self.legacy = legacy  # /api/embeddings: one vector, no statistics

    def _embeddings(self, event: Embeddings, outcome: Outcome | None) -> dict[str, Any]:
        if self.legacy:
            return {"embedding": list(event.vectors[0])}
        stats = statistics(outcome)
        return {"model": self.shape.model, "embeddings": [list(v) for v in event.vectors],
                **{k: stats[k] for k in ("total_duration", "load_duration",
                                         "prompt_eval_count") if k in stats}}

    async def collect(self, events: Events, send: Send) -> None:
        text: list[str] = []
        thought: list[str] = []
        calls: ToolCalls | None = None
        async for event, outcome in events:
            if isinstance(event, Error):
                await self.send_error(send, event, outcome, _error(event))
                return
            if isinstance(event, Embeddings):
                answer = self._embeddings(event, outcome)
            elif isinstance(event, ToolCalls):
                calls = event
                continue
            elif isinstance(event, Tokens):
                text.append(event.chunk.text)
                thought.append(event.chunk.reasoning or "")
                if not event.finished:
                    continue
                answer = self.shape.last(outcome, "".join(text), "".join(thought), calls)
            else:
                continue
            await self.send_json(send, 200, dumps(answer))
            return

    async def heartbeat(self, send: Send) -> None:
        await self._line(send, self.shape.line(""))  # (a line of no text, as a queued one)

    async def answer_stream(self, events: Events, send: Send) -> None:
        async for event, outcome in events:
            if isinstance(event, Error) and not self.started:
                await self.send_error(send, event, outcome, _error(event))
                return
            if not self.started:
                await self.start_stream(send, NDJSON)
                self.started = True
            if isinstance(event, Accepted) and event.queue_position:
                await self._line(send, self.shape.line("", queue_position=event.queue_position,
                                                       **queue_eta(event)))
            elif isinstance(event, ToolCalls):
                await self._line(send, self.shape.line("", calls=event))
            elif isinstance(event, Tokens):
                chunk = event.chunk
                if chunk.text or chunk.reasoning:
                    await self._line(send, self.shape.line(chunk.text, chunk.reasoning or ""))
                if event.finished:
                    await self._line(send, self.shape.last(outcome))
                    break
            elif isinstance(event, Error):
                await self.write(send, _error(event) + b"\n")
                break
        await self.end_stream(send)

    async def _line(self, send: Send, obj: dict[str, Any]) -> None:
        await self.write(send, dumps(obj) + b"\n")


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
        parse.refuse(data, "suffix", "template", "context", "logprobs")
        images = data.get("images")
        prompt, system, raw = data.get("prompt"), data.get("system"), data.get("raw", False)
        if prompt is None or prompt == "":
            return await self._load_or_unload(request, data, chat=False)
        if not isinstance(prompt, str):
            raise HttpError(400, "`prompt` must be a string", "invalid_prompt")
        if not isinstance(raw, bool) or not isinstance(system, str | None):
            raise HttpError(400, "`raw` must be a boolean and `system` a string",
                            "invalid_type")
        fields: dict[str, Any] = parse.think(data)
        if images not in (None, []):  # a one-turn chat: the images, then the prompt
            if raw:
                raise HttpError(400, "`images` need the chat template (not `raw`)",
                                "invalid_images")
            turn = [*parse.image_urls("images", images), {"type": "text", "text": prompt}]
            fields["messages"] = parse.messages(
                [*([{"role": "system", "content": system}] if system else []),
                 {"role": "user", "content": turn}])
        elif raw:
            fields.update(prompt=prompt, format=Format.RAW)
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
        spec = self.api.supervisor.registry.models.get(name)
        options = parse.options(request, data, spec.context if spec else None)
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

