"""Reranking over HTTP, in the shape llama-server, Jina and Cohere share:

    POST /v1/rerank, /rerank, /v1/reranking, /v2/rerank
        {"model", "query", "documents": [str | {"text": str}], "top_n"?, "return_documents"?}
      → {"id", "model", "object": "list", "results": [{"index", "relevance_score",
         "document"?: {"text"}}], "usage": {"prompt_tokens", "total_tokens"}}

Each runs as one Embed request with a query (queued, quota'd, audited and cancellable as
any request; ``x-request-id`` names it). Scores are the reranker's own, unnormalized, as
llama-server gives them; results are best first, at most ``top_n``. Errors are OpenAI
error objects (as llama-server's), a model that is not a reranker a 400.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request as HttpRequest
from starlette.routing import BaseRoute, Route

from ...protocol import Embed, Error, ranked
from ..outcome import Outcome
from .answer import Answer
from .common import HttpError, deadline, priority, protocol_errors, request_id
from .exchange import Dialect, Exchange, Spawner
from .openai_answer import error_answer


def documents(raw: object) -> list[str]:
    """The documents of a body: strings, or Cohere's and Jina's ``{"text": …}`` objects.
    Raises HttpError."""
    if not isinstance(raw, list) or not raw:
        raise HttpError(400, "`documents` must be a non-empty list of strings",
                        "invalid_documents")
    out = []
    for i, doc in enumerate(raw):
        text = doc.get("text") if isinstance(doc, dict) else doc
        if not isinstance(text, str):
            raise HttpError(400, f"documents[{i}] must be a string or an object with a "
                            "`text` string", "invalid_documents")
        out.append(text)
    return out


class _Ranking(Exchange):
    """One rerank answer, whole."""

    def __init__(self, api: Spawner, req: Embed, principal: Any, model: str,
                 top_n: int | None, return_documents: bool) -> None:
        super().__init__(api, req, principal)
        self.model = model
        self.top_n = top_n
        self.return_documents = return_documents
        self.docs = req.input

    def error_answer(self, event: Error, outcome: Outcome | None) -> tuple[int, bytes]:
        return error_answer(event, outcome)

    def whole(self, answer: Answer) -> dict[str, Any]:
        assert answer.vectors is not None  # (an Embed ends in vectors, else it failed)
        results = []
        for index, score in ranked(answer.vectors.vectors, self.top_n):
            row: dict[str, Any] = {"index": index, "relevance_score": score}
            if self.return_documents:
                row["document"] = {"text": self.docs[index]}
            results.append(row)
        tokens = answer.vectors.usage.prompt
        return {"id": self.req.request_id, "model": self.model, "object": "list",
                "results": results, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "meta": {"billed_units": {"search_units": 1}}}


class Rerank(Dialect):
    """The rerank routes over ``api`` (where requests run) and ``reader``."""

    def routes(self) -> list[BaseRoute]:
        return [Route(path, self.rerank, methods=["POST"])
                for path in ("/v1/rerank", "/rerank", "/v1/reranking", "/v2/rerank")]

    async def rerank(self, request: HttpRequest) -> Any:
        data = await self.reader.json(request)
        model = self.reader.model(request, data.get("model"), "GET /v1/models")
        query = data.get("query")
        if not isinstance(query, str):
            raise HttpError(400, "`query` must be a string", "invalid_query")
        docs = documents(data.get("documents", data.get("texts")))
        top_n = data.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)
                                  or top_n < 1):
            raise HttpError(400, "`top_n` must be a positive integer", "invalid_top_n")
        back = data.get("return_documents", False)
        if not isinstance(back, bool):
            raise HttpError(400, "`return_documents` must be a boolean", "invalid_type")
        rid = request_id(request, "rrk")
        req = protocol_errors(Embed, rid, model, tuple(docs), deadline_ms=deadline(request),
                              query=query, **priority(request, data))
        return _Ranking(self.api, req, request.state.principal, model, top_n, back)
