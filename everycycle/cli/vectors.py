"""``everycycle embed`` and ``everycycle rerank``: texts to vectors, documents ranked
against a query. Each prints JSON lines on stdout, and nothing else."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import EverycycleError
from ..protocol import Embed, Priority
from .common import (
    ModelOpt,
    ModelsOpt,
    NoDaemonOpt,
    OfflineOpt,
    SocketOpt,
    Status,
    VerboseOpt,
    app,
    exit_for,
    fail,
    hub_model,
    open_client,
    prepull,
    refuse_completion_model,
    registry_default,
    report,
)

if TYPE_CHECKING:
    from ..client.aio import BaseClient


def _lines(given: list[str] | None, what: str) -> list[str]:
    """``given``, or else the non-empty lines of stdin. Exits 2 when there are none."""
    items = list(given or [])
    if not items and not sys.stdin.isatty():
        items = [ln for ln in sys.stdin.read().splitlines() if ln.strip()]
    if not items:
        fail(f"usage: give {what}… or pipe lines on stdin", 2)
    return items


def _run(model: str | None, models: Path | None, offline: bool, probe: Embed,
         ask: Callable[[BaseClient, str], Awaitable[list[dict[str, Any]]]],
         socket: Path | None, no_daemon: bool, verbose: bool) -> None:
    """Resolve the model, check ``probe`` (the request, validated before a daemon is
    asked), ask, and print each row ``ask`` returns as a JSON line."""
    status = Status(verbose)
    try:
        name = hub_model(model or registry_default(models), models, offline)
        refuse_completion_model(name, models)
        prepull(name, models, offline)
        dataclasses.replace(probe, model=name)  # (validated again, with its model)
    except EverycycleError as exc:
        exit_for(exc)
    import anyio

    async def go() -> int:
        try:
            async with open_client(socket, models, no_daemon, status) as client:
                rows = await ask(client, name)
        except EverycycleError as exc:
            status.clear()
            return report(exc)
        out = sys.stdout
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
        out.flush()
        return 0

    raise typer.Exit(anyio.run(go))


@app.command()
def embed(
    texts: Annotated[list[str] | None, typer.Argument(
        metavar="[TEXT]...", help="Texts to embed; with none, each line of stdin is one.")] = None,
    model: ModelOpt = None,
    background: Annotated[bool, typer.Option(
        "--background/--interactive", help="Wait behind interactive requests (the "
        "default: indexing is batch work), or not.")] = True,
    no_daemon: NoDaemonOpt = False,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Print one JSON line {"index", "embedding"} per text (L2-normalized).

    \b
    Example:
      printf 'a cat\\na dog\\n' | everycycle embed > vectors.jsonl
    """
    items = _lines(texts, "TEXT")
    lane = Priority.BACKGROUND if background else None

    async def ask(client: BaseClient, name: str) -> list[dict[str, Any]]:
        vectors = await client.embed(name, items, priority=lane)
        return [{"index": i, "embedding": list(v)} for i, v in enumerate(vectors)]

    _run(model, models, offline, _probe(items), ask, socket, no_daemon, verbose)


@app.command()
def rerank(
    query: Annotated[str, typer.Argument(metavar="QUERY", help="What to rank by.")],
    documents: Annotated[list[str] | None, typer.Argument(
        metavar="[DOCUMENT]...", help="Documents to rank; with none, each line of stdin "
        "is one.")] = None,
    model: ModelOpt = None,
    top_n: Annotated[int | None, typer.Option(
        "--top-n", min=1, help="Print only the best N.")] = None,
    background: Annotated[bool, typer.Option(
        "--background/--interactive", help="Wait behind interactive requests, or not "
        "(the default: a search waits on it).")] = False,
    no_daemon: NoDaemonOpt = False,
    offline: OfflineOpt = False,
    models: ModelsOpt = None,
    socket: SocketOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Rank documents against a query with a reranker model: one JSON line
    {"index", "relevance_score", "document"} per document, best first.

    \b
    Example:
      everycycle rerank -m bge-reranker "What is a panda?" < docs.txt
    """
    items = _lines(documents, "DOCUMENT")
    lane = Priority.BACKGROUND if background else None

    async def ask(client: BaseClient, name: str) -> list[dict[str, Any]]:
        order = await client.rerank(name, query, items, top_n, priority=lane)
        return [{"index": i, "relevance_score": score, "document": items[i]}
                for i, score in order]

    _run(model, models, offline, _probe(items, query), ask, socket, no_daemon, verbose)


def _probe(items: list[str], query: str | None = None) -> Embed:
    """The request checked before anything is asked (exits 2 for a bad one)."""
    try:
        return Embed(request_id="probe", model="probe", input=tuple(items), query=query)
    except EverycycleError as exc:
        exit_for(exc)
