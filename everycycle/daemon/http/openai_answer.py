"""How the OpenAI dialect answers (openai.py's routes): its error objects, and a
completion's or chat completion's answer, whole or streamed as SSE chunks."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse

from ...protocol import Embed, Error, Generate, TokenLogprob, ToolCall
from ..outcome import Outcome
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
from .exchange import STATUS, Exchange, Spawner, dumps
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
class Shape:
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


class Generation(Exchange):
    """An OpenAI answer: SSE chunks when streaming, else one object; with ``n`` > 1, one
    protocol request per choice, answered together."""

    def __init__(self, api: Spawner, req: Generate | Embed, principal: Any, shape: Shape,
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
