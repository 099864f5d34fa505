"""``ListTools`` and ``RunTool``: the daemon's MCP tools, for its own user only."""

from __future__ import annotations

import json

from .. import paths
from ..errors import InvalidRequestError
from ..protocol import ListTools, RunTool, ToolList, ToolResult
from ..tooluse import config
from ..tooluse.host import CALL_TIMEOUT_S, McpHost
from .keys import ADMINS
from .outcome import Peer


def host() -> McpHost:
    """The servers of the user's mcp.json (read again at each listing); their stderr
    in the log directory (``mcp-NAME.log``)."""
    return McpHost(config.load, paths.log_dir())


async def answer(host: McpHost, peer: Peer, request: ListTools | RunTool) -> None:
    """Answer ``request`` with its one event. Raises EverycycleError (ConfigError for
    a broken mcp.json or an unknown tool; InvalidRequestError for another user)."""
    if peer.principal.name not in ADMINS:
        # A tool runs as the daemon's user, on its host: never for an API key's holder.
        raise InvalidRequestError("only the daemon's own user or its token may use its "
                                  "MCP tools")
    if isinstance(request, ListTools):
        tools, problems = await host.tools()
        peer.emit(ToolList(request.request_id, tuple(tools), tuple(problems)))
        return
    limit = request.timeout_ms / 1000 if request.timeout_ms else CALL_TIMEOUT_S
    text, is_error = await host.call(request.name, json.loads(request.arguments), limit)
    peer.emit(ToolResult(request.request_id, text, is_error))
