"""The user's MCP servers, run by the daemon: started on first use, kept while it runs,
started again after a crash, stopped when it stops. Speaks MCP through the official SDK
(``mcp``), imported on first use only (it brings pydantic).

Each server lives in one task of the supervisor's group, which enters and leaves the
SDK's stdio transport and session (anyio's rule: one task does both); calls reach it
from other tasks through the session. A server's stderr goes to its own log file.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import anyio
import anyio.abc

from ..errors import ConfigError
from ..protocol import HostedTool
from .config import McpServer

if TYPE_CHECKING:
    from mcp import ClientSession

log = logging.getLogger(__name__)

__all__ = ["CALL_TIMEOUT_S", "McpHost"]

START_TIMEOUT_S = 60.0
"""A server that has not answered ``initialize`` and ``tools/list`` by then failed to
start (npx's first download of a package fits well within it)."""
CALL_TIMEOUT_S = 120.0
MAX_RESULT_CHARS = 200_000
"""A tool's text past this is cut (a file read whole must not fill the context)."""


def _innermost(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _one_line(exc: BaseException) -> str:
    """An exception (or a group of one) as the one sentence a user reads."""
    exc = _innermost(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text


@dataclass
class _Running:
    """One server's task and what it has published."""

    server: McpServer
    ready: anyio.Event = field(default_factory=anyio.Event)
    stop: anyio.Event = field(default_factory=anyio.Event)
    session: ClientSession | None = None
    tools: list[Any] = field(default_factory=list)
    problem: str | None = None
    ended: anyio.Event = field(default_factory=anyio.Event)


class McpHost:
    """The configured MCP servers, as tools a client may list and run."""

    def __init__(self, configured: Callable[[], dict[str, McpServer]],
                 log_dir: Path | None = None) -> None:
        self._configured = configured
        """Reads mcp.json again (``mcp add`` while the daemon runs takes effect)."""
        self._log_dir = log_dir
        self._running: dict[str, _Running] = {}
        self._names: dict[str, tuple[str, str]] = {}
        """The model's name for each tool: (server, the server's own name)."""
        self.group: anyio.abc.TaskGroup | None = None
        """Where servers' tasks run (the supervisor's group, set while it runs)."""

    # ------------------------------------------------------------------ listing

    async def tools(self) -> tuple[list[HostedTool], list[str]]:
        """Every started server's tools, and one sentence per server that is not
        running (it failed to start, or cannot be run here). Raises ConfigError (a
        broken mcp.json)."""
        configured = self._configured()
        for name in [n for n in self._running if n not in configured
                     or configured[n] != self._running[n].server]:
            self._running.pop(name).stop.set()  # removed or changed in mcp.json
        problems: list[str] = []
        wanted = []
        for server in configured.values():
            if server.problem is not None:
                problems.append(server.problem)
            else:
                wanted.append(self._start(server))
        for running in wanted:
            with anyio.move_on_after(START_TIMEOUT_S + 5):
                await running.ready.wait()
        listed: list[HostedTool] = []
        names: dict[str, tuple[str, str]] = {}
        for running in wanted:
            if running.problem is not None or not running.ready.is_set():
                problems.append(running.problem or f"MCP server '{running.server.name}' "
                                "did not start in time")
                continue
            for tool in running.tools:
                exposed = tool.name if tool.name not in names else \
                    f"{running.server.name}__{tool.name}".replace(".", "_")
                names[exposed] = (running.server.name, tool.name)
                listed.append(HostedTool(
                    running.server.name, exposed, (tool.description or "").strip(),
                    json.dumps(tool.input_schema or {"type": "object"})))
        self._names = names
        return listed, problems

    def _start(self, server: McpServer) -> _Running:
        """The server's running entry, starting it (again, after a crash) if needed."""
        running = self._running.get(server.name)
        if running is not None and not running.ended.is_set() and running.problem is None:
            return running
        if self.group is None:
            raise ConfigError("the daemon is stopping: no MCP server starts now")
        running = self._running[server.name] = _Running(server)
        self.group.start_soon(self._serve, running, name=f"mcp server {server.name}")
        return running

    # ------------------------------------------------------------------ calling

    async def call(self, name: str, arguments: dict[str, Any],
                   limit_s: float = CALL_TIMEOUT_S) -> tuple[str, bool]:
        """Run tool ``name`` as ``tools`` named it: (its result as text, whether it is
        an error). A failure of the server or of the time limit is an error result,
        never an exception (a tool's error goes back to the model as its result).
        Raises ConfigError for a name no server offers."""
        if name not in self._names:
            await self.tools()  # (a client that listed through another connection)
        if name not in self._names:
            raise ConfigError(f"no MCP tool '{name}' (`everycycle mcp tools` lists them)")
        server_name, tool = self._names[name]
        running = self._running.get(server_name)
        if running is None or running.ended.is_set():
            configured = self._configured().get(server_name)
            if configured is None:
                raise ConfigError(f"MCP server '{server_name}' is no longer configured")
            running = self._start(configured)
            with anyio.move_on_after(START_TIMEOUT_S):
                await running.ready.wait()
        session = running.session
        if session is None:
            return (f"MCP server '{server_name}' is not running: "
                    f"{running.problem or 'it did not start in time'}"), True
        try:
            with anyio.fail_after(limit_s):
                result = await session.call_tool(tool, arguments)
        except TimeoutError:
            return f"the tool '{name}' did not answer within {limit_s:g} s", True
        except Exception as exc:  # noqa: BLE001 - the server crashed or broke MCP
            running.stop.set()  # (started again on next use)
            log.warning("MCP server %s failed a call of %s: %s", server_name, tool, exc)
            return f"MCP server '{server_name}' failed: {_one_line(exc)}", True
        return _text(result), bool(result.is_error)

    # ------------------------------------------------------------------ running

    async def _serve(self, running: _Running) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        server = running.server
        assert server.command is not None
        params = StdioServerParameters(command=server.command, args=list(server.args),
                                       env=dict(server.env) or None, cwd=server.cwd)
        errlog = self._errlog(server.name)
        try:
            async with stdio_client(params, errlog=errlog) as streams, \
                    ClientSession(streams[0], streams[1]) as session:
                with anyio.fail_after(START_TIMEOUT_S):
                    await session.initialize()
                    tools: list[Any] = []
                    cursor: str | None = None
                    while True:
                        listed = await session.list_tools(
                            params=_page(cursor) if cursor else None)
                        tools += listed.tools
                        cursor = listed.next_cursor
                        if not cursor:
                            break
                running.session, running.tools = session, tools
                running.ready.set()
                log.info("MCP server %s started: %d tools", server.name, len(tools))
                await running.stop.wait()
        except Exception as exc:  # noqa: BLE001 - whatever stopped it is its problem
            if not running.ready.is_set():
                running.problem = (f"MCP server '{server.name}' did not start "
                                   f"({server.describe()}): {_problem(exc)}")
                log.info("%s", running.problem)  # (the client says it to its user)
        finally:
            running.session = None
            running.ready.set()
            running.ended.set()
            errlog.close()

    def _errlog(self, name: str) -> TextIO:
        """Where the server's stderr goes: its log file (else nowhere: never the
        terminal of a ``run``, whose stderr is the user's)."""
        if self._log_dir is not None:
            try:
                self._log_dir.mkdir(parents=True, exist_ok=True)
                return (self._log_dir / f"mcp-{name}.log").open("a", encoding="utf-8")
            except OSError:
                pass
        return open(os.devnull, "w", encoding="utf-8")

    async def close(self) -> None:
        """Stop every server (each gets a moment to exit)."""
        for running in self._running.values():
            running.stop.set()
        with anyio.move_on_after(15):
            for running in list(self._running.values()):
                await running.ended.wait()
        self._running.clear()


def _page(cursor: str) -> Any:
    from mcp import types

    return types.PaginatedRequestParams(cursor=cursor)


def _problem(exc: BaseException) -> str:
    """Why a server did not start, in words (not the SDK's exception names)."""
    exc = _innermost(exc)
    text = _one_line(exc)
    if isinstance(exc, TimeoutError) or "TimeoutError" in type(exc).__name__:
        return f"it did not answer within {START_TIMEOUT_S:g} s"
    if isinstance(exc, FileNotFoundError) or "No such file" in text:
        return "its command was not found"
    if "Connection closed" in text:
        return "it exited before answering"
    return text


def _text(result: Any) -> str:
    """A tool's result as the text the model reads: its text parts; other parts
    named; structured content when there is no text."""
    parts: list[str] = []
    for item in result.content:
        kind = getattr(item, "type", "")
        if kind == "text":
            parts.append(item.text)
        elif kind in ("image", "audio"):
            parts.append(f"[{kind} {getattr(item, 'mime_type', '')}]")
        elif kind == "resource":
            resource = item.resource
            parts.append(getattr(resource, "text", None) or f"[resource {resource.uri}]")
        elif kind == "resource_link":
            parts.append(f"[resource {item.uri}]")
    text = "\n".join(parts)
    if not text and getattr(result, "structured_content", None) is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
    if len(text) > MAX_RESULT_CHARS:
        text = (text[:MAX_RESULT_CHARS]
                + f"\n… (cut: {len(text) - MAX_RESULT_CHARS} more characters)")
    return text
