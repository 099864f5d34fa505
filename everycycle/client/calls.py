"""Every client's request methods, written once: a ``Call`` is the request to send and
how its terminal event becomes the method's result. The async client awaits a Call
(``awaiting``), the blocking client runs it (``blocking``); neither repeats a method.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

from ..errors import EverycycleError, RequestFailedError
from ..protocol import (
    Cancel,
    DescribeFleet,
    Embed,
    Embeddings,
    Error,
    FleetDescription,
    FleetSnapshot,
    Generate,
    ListTools,
    Load,
    Message,
    Request,
    RunTool,
    ServerEvent,
    Shutdown,
    ToolList,
    ToolResult,
    Unload,
    ranked,
)
from .connection import new_request_id

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
P = ParamSpec("P")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """A request and what its terminal event means."""

    request: Request
    result: Callable[[ServerEvent], T]
    quiet: bool = False
    """Any failure (the daemon's Error, a lost connection) is the result None."""

    def finish(self, last: ServerEvent) -> T:
        """The result of the terminal event ``last``. Raises RequestFailedError."""
        if isinstance(last, Error):
            raise RequestFailedError(last.message, kind=last.kind, request_id=last.request_id)
        return self.result(last)

    def failed(self, exc: EverycycleError) -> T:
        """What the failure ``exc`` makes of this call: None when quiet, else raised."""
        if self.quiet:
            return None  # type: ignore[return-value]  # a quiet Call's T is None
        raise exc


def _nothing(event: ServerEvent) -> None:
    return None


def _vectors(event: ServerEvent) -> list[tuple[float, ...]]:
    assert isinstance(event, Embeddings)
    return list(event.vectors)


def _snapshot(event: ServerEvent) -> FleetSnapshot:
    assert isinstance(event, FleetDescription)
    return event.snapshot


def generate_request(model: str, prompt: str | None = None, *,
                     messages: tuple[Message, ...] | None = None,
                     request_id: str | None = None, **options: Any) -> Generate:
    """A Generate request (see protocol.Generate for ``options``)."""
    return Generate(request_id=request_id or new_request_id(), model=model, prompt=prompt,
                    messages=messages, **options)


def embed(model: str, texts: Sequence[str], **options: Any
          ) -> Call[list[tuple[float, ...]]]:
    """One normalized vector per text, in order. Raises RequestFailedError."""
    return Call(Embed(new_request_id(), model, tuple(texts), **options), _vectors)


def rerank(model: str, query: str, documents: Sequence[str], top_n: int | None = None,
           **options: Any) -> Call[list[tuple[int, float]]]:
    """``documents`` ranked against ``query`` by a reranker: (index, relevance score),
    best first, at most ``top_n``. Raises RequestFailedError."""
    return Call(Embed(new_request_id(), model, tuple(documents), query=query, **options),
                lambda event: ranked(_vectors(event), top_n))


def describe_fleet() -> Call[FleetSnapshot]:
    """The daemon's FleetSnapshot. Raises RequestFailedError."""
    return Call(DescribeFleet(new_request_id()), _snapshot)


def cancel(target: str) -> Call[None]:
    """Cancel request ``target``. Raises RequestFailedError (Invalid if not active)."""
    return Call(Cancel(new_request_id(), target), _nothing)


def cancel_if_active(target: str) -> Call[None]:
    """Cancel ``target`` if it is still running; never raises.

    The request may end on its own just before the cancel arrives (Ctrl-C as the last
    token streams, a reader closing the pipe): the daemon's "no active request"
    answer, or a connection already gone, is then the expected outcome.
    """
    return Call(Cancel(new_request_id(), target), _nothing, quiet=True)


def load(model: str, executor: str | None = None, *, keep_alive_ms: int | None = None,
         context: int | None = None, draft_model: str | None = None) -> Call[None]:
    """Make ``model`` resident (with at least ``context`` tokens a slot, and
    ``draft_model`` drafting for it, if given). Raises RequestFailedError."""
    return Call(Load(new_request_id(), model, executor, keep_alive_ms, context, draft_model),
                _nothing)


def unload(model: str) -> Call[None]:
    """Release ``model``. Raises RequestFailedError."""
    return Call(Unload(new_request_id(), model), _nothing)


def shutdown(drain_ms: int | None = None) -> Call[None]:
    """Ask the daemon to stop gracefully; with ``drain_ms``, once its running and
    queued requests end (at most that long), admitting none meanwhile. Raises
    RequestFailedError."""
    return Call(Shutdown(new_request_id(), drain_ms), _nothing)


def list_tools() -> Call[ToolList]:
    """The tools of the user's MCP servers (mcp.json), and a sentence for each server
    that did not start. Raises RequestFailedError."""
    return Call(ListTools(new_request_id()), lambda event: _expect(event, ToolList))


def run_tool(name: str, arguments: str, timeout_ms: int | None = None) -> Call[ToolResult]:
    """Run MCP tool ``name`` with ``arguments`` (a JSON object, as text): its result,
    an error of the tool's included. Raises RequestFailedError."""
    return Call(RunTool(new_request_id(), name, arguments, timeout_ms),
                lambda event: _expect(event, ToolResult))


E = TypeVar("E")


def _expect(event: ServerEvent, kind: type[E]) -> E:
    assert isinstance(event, kind)
    return event


class _Runs(Protocol):
    def run(self, call: Call[T]) -> T: ...


class _Awaits(Protocol):
    async def run(self, call: Call[T]) -> T: ...


S = TypeVar("S", bound=_Runs)
A = TypeVar("A", bound=_Awaits)


def blocking(factory: Callable[P, Call[T]]) -> Callable[Concatenate[S, P], T]:
    """A blocking client's method for ``factory``'s request."""
    def method(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.run(factory(*args, **kwargs))
    method.__doc__ = factory.__doc__
    method.__name__ = factory.__name__
    return method


def awaiting(factory: Callable[P, Call[T]]
             ) -> Callable[Concatenate[A, P], Coroutine[Any, Any, T]]:
    """An async client's method for ``factory``'s request."""
    async def method(self: A, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.run(factory(*args, **kwargs))
    method.__doc__ = factory.__doc__
    method.__name__ = factory.__name__
    return method
