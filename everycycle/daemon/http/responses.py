"""The OpenAI Responses dialect: ``POST /v1/responses`` over the shared exchange.

    POST /v1/responses   instructions + input → Generate{messages}   (SSE when "stream")

The answer's ``output`` holds a ``reasoning`` item (a thinking model's thoughts), a
``message`` item with one ``output_text`` part, and a ``function_call`` item per tool
call; ``status`` is ``completed``, or ``incomplete`` (``max_output_tokens``) when the
token limit or the context cut it. Nothing is stored: ``store`` is always false and
``previous_response_id`` is refused (400). A stream is named events, each with its
``sequence_number``: ``response.created``, then ``response.queued`` (with the request's
``queue_position``) each time its queue moves and ``response.in_progress`` once it runs,
the items' ``output_item``/``content_part``/``output_text``/``function_call_arguments``
events, and ``response.completed`` (or ``response.incomplete``); a failure after the stream
began is ``response.failed``. The request id is the response's ``id`` and comes back in
``x-request-id``; errors before a stream are OpenAI error objects, as on chat completions.
"""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.routing import BaseRoute, Route

from ...protocol import Error, Generate, ToolCall
from ..keys import Principal
from ..outcome import Outcome
from . import responses_request as parse
from .answer import (
    Answer,
    Calls,
    Failed,
    Finished,
    FinishReason,
    Part,
    Prefill,
    Queued,
    Running,
    Text,
    Thinking,
    Usage,
)
from .common import protocol_errors, request_id, stream_flag
from .exchange import Dialect, Exchange, Spawner, sse_event
from .llamafields import timings
from .openai_answer import error_answer
from .responses_request import CUSTOM_INPUT

_PART = {"message": "output_text", "reasoning": "reasoning_text"}
"""Each streamed item kind's one content part."""


def _usage(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt, "input_tokens_details": {"cached_tokens": usage.cached},
            "output_tokens": usage.generated, "total_tokens": usage.total,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning or 0}}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _item(kind: str, item_id: str, text: str | None, status: str = "completed"
          ) -> dict[str, Any]:
    """A message or reasoning item, whole (``text`` None: with no content yet)."""
    content = [] if text is None else [_part(kind, text)]
    if kind == "message":
        return {"type": "message", "id": item_id, "status": status, "role": "assistant",
                "content": content}
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": content}


def _call_item(call: ToolCall, item_id: str, custom: frozenset[str],
               arguments: str | None = None, status: str = "completed") -> dict[str, Any]:
    """A ``function_call`` item (``{namespace, name}`` for a namespace's function), or a
    ``custom_tool_call`` for a custom tool (its one string argument as ``input``)."""
    namespace, dot, name = call.name.rpartition(".")
    names: dict[str, Any] = {"namespace": namespace, "name": name} if dot else {
        "name": call.name}
    if call.name in custom:
        text = "" if arguments == "" else _custom_input(call.arguments)
        return {"type": "custom_tool_call", "id": item_id, "call_id": call.id, **names,
                "input": text, "status": status}
    return {"type": "function_call", "id": item_id, "call_id": call.id, **names,
            "arguments": call.arguments if arguments is None else arguments,
            "status": status}


def _custom_input(arguments: str) -> str:
    try:
        value = json.loads(arguments).get(CUSTOM_INPUT, "")
    except (ValueError, AttributeError):
        return arguments
    return value if isinstance(value, str) else json.dumps(value)


class _Response(Exchange):
    """A response: named SSE events when streaming, else one response object."""

    def __init__(self, api: Spawner, req: Generate, principal: Principal, *, stream: bool,
                 echo: dict[str, Any], custom: frozenset[str] = frozenset()) -> None:
        super().__init__(api, req, principal)
        self.custom = custom
        self.model = req.model
        self.stream = stream
        self.echo = echo
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []  # output items, whole once done
        self.open: str | None = None  # the kind of the item streaming now (the last one)
        self.text: list[str] = []  # its text so far
        self.seq = 0
        self.per_token = False
        """llama-server's ``timings_per_token``: each text delta carries the timings."""
        self.read: Prefill | None = None  # the prompt's reading, as last reported
        self.first: float | None = None  # when its first token came
        self.made = 0  # tokens generated so far

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{self.req.request_id}_{len(self.items)}"

    def _object(self, status: str, ended: tuple[FinishReason, Usage] | None = None,
                error: dict[str, str] | None = None) -> dict[str, Any]:
        """The response object now (``ended``: how it finished, and its usage)."""
        incomplete = None
        if ended is not None and ended[0].truncated:
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {"id": self.req.request_id, "object": "response", "created_at": self.created,
                "status": status, "error": error, "incomplete_details": incomplete,
                "model": self.model, "output": list(self.items), **self.echo,
                "usage": None if ended is None else _usage(ended[1])}

    def whole(self, answer: Answer) -> dict[str, Any]:
        self.items.extend(answer.first.parts(
            lambda thought: _item("reasoning", self._id("rs"), thought),
            lambda text: _item("message", self._id("msg"), text),
            lambda call: _call_item(call, self._id("fc"), self.custom)))
        return self._object("completed", (answer.first.reason, answer.usage))

    # ------------------------------------------------------------------ streaming

    def _emit(self, name: str, /, **fields: Any) -> bytes:
        out = sse_event(name, {**fields, "sequence_number": self.seq})
        self.seq += 1
        return out

    def _added(self, item: dict[str, Any]) -> bytes:
        self.items.append(item)
        return self._emit("response.output_item.added", output_index=len(self.items) - 1,
                          item=item)

    def _done(self, item: dict[str, Any]) -> bytes:
        self.items[-1] = item
        return self._emit("response.output_item.done", output_index=len(self.items) - 1,
                          item=item)

    def _where(self) -> dict[str, Any]:
        """Where the last item's one content part is, as its events say."""
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1,
                "content_index": 0}

    def _text(self, kind: str, delta: str, more: dict[str, Any] | None = None) -> bytes:
        """Stream ``delta`` into the open item of ``kind`` (opening one if need be), its
        event with ``more`` fields."""
        out = b""
        if self.open != kind:
            out = self._close()
            self.open, self.text = kind, []
            out += self._added(_item(kind, self._id("msg" if kind == "message" else "rs"),
                                     None, "in_progress"))
            out += self._emit("response.content_part.added", **self._where(),
                              part=_part(kind, ""))
        self.text.append(delta)
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return out + self._emit(f"response.{_PART[kind]}.delta", **self._where(),
                                delta=delta, **extra, **(more or {}))

    def _close(self) -> bytes:
        """End the item streaming now: its text's done, its part's done, its own done."""
        kind = self.open
        if kind is None:
            return b""
        self.open = None
        text = "".join(self.text)
        where = self._where()
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        return (self._emit(f"response.{_PART[kind]}.done", **where, text=text, **extra)
                + self._emit("response.content_part.done", **where, part=_part(kind, text))
                + self._done(_item(kind, where["item_id"], text)))

    def on_calls(self, part: Calls) -> bytes:
        out = self._close()
        for call in part.calls:
            item_id = self._id("fc")
            out += self._added(_call_item(call, item_id, self.custom, "", "in_progress"))
            where = {"item_id": item_id, "output_index": len(self.items) - 1}
            whole = _call_item(call, item_id, self.custom)
            if whole["type"] == "custom_tool_call":
                out += self._emit("response.custom_tool_call_input.delta", **where,
                                  delta=whole["input"])
                out += self._emit("response.custom_tool_call_input.done", **where,
                                  input=whole["input"])
            else:
                out += self._emit("response.function_call_arguments.delta", **where,
                                  delta=call.arguments)
                out += self._emit("response.function_call_arguments.done", **where,
                                  name=whole["name"], arguments=call.arguments)
            out += self._done(whole)
        return out

    def error_answer(self, event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
        return error_answer(event, outcome)

    def begin(self, part: Part) -> bytes:
        return self._emit("response.created", response=self._object(
            "queued" if isinstance(part, Queued) else "in_progress"))

    def heartbeat(self) -> bytes:
        return self._emit("response.in_progress", response=self._object("in_progress"))

    def on_queued(self, part: Queued) -> bytes:
        return self._emit("response.queued", response=self._object("queued"),
                          queue_position=part.position, **part.eta())

    def on_running(self, part: Running) -> bytes:
        return self._emit("response.in_progress", response=self._object("in_progress"))

    def on_thinking(self, part: Thinking) -> bytes:
        return self._text("reasoning", part.text)

    def on_prefill(self, part: Prefill) -> bytes:
        """llama-server's progress report (``return_progress``) as an in-progress event."""
        self.read = part
        return self._emit("response.in_progress", response=self._object("in_progress"),
                          prompt_progress={"total": part.total, "cache": part.cached,
                                           "processed": part.processed,
                                           "time_ms": part.time_ms})

    def on_text(self, part: Text) -> bytes:
        self.first = self.first or time.monotonic()
        self.made += len(part.ids)
        if not part.text:
            return b""
        return self._text("message", part.text, {"timings": self._running()}
                          if self.per_token else None)

    def _running(self) -> dict[str, Any]:
        """The timings so far (llama-server's names)."""
        usage = Usage(self.read.total if self.read else 0, self.read.cached if self.read
                      else 0, self.made)
        elapsed = time.monotonic() - (self.first or time.monotonic())
        out = timings(usage, None)
        if self.read is not None and self.read.time_ms:
            read = max(1, self.read.processed - self.read.cached)
            out.update(prompt_ms=float(self.read.time_ms),
                       prompt_per_second=read / (self.read.time_ms / 1000))
        if self.made > 1 and elapsed > 0:
            out.update(predicted_ms=elapsed * 1000,
                       predicted_per_second=(self.made - 1) / elapsed)
        return out

    def on_finished(self, part: Finished) -> bytes:
        out = self._close()
        final = self._object("completed", (part.reason, part.usage))
        return out + self._emit(f"response.{final['status']}", response=final,
                                timings=timings(part.usage, part.outcome))

    def on_failed(self, part: Failed) -> bytes:
        error = json.loads(error_answer(part.error, part.outcome)[1])["error"]
        return self._emit("response.failed", response=self._object(
            "failed", error={"code": error["code"], "message": error["message"]}))


class Responses(Dialect):
    """The Responses route over ``api`` (where requests run) and ``reader``."""

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/responses", self.create, methods=["POST"])]

    async def create(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        messages = parse.messages(data)
        stream = stream_flag(data)
        progress = {"progress": True} if stream and data.get("return_progress") is True else {}
        req = protocol_errors(Generate, request_id(request, "resp"), model, messages=messages,
                              **parse.tools(data), **parse.options(request, data), **progress)
        exchange = _Response(self.api, req, request.state.principal, stream=stream,
                             echo=parse.summary(data), custom=parse.custom_tools(data))
        exchange.per_token = stream and data.get("timings_per_token") is True
        return exchange
