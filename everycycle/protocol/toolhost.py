"""The daemon's MCP tools (an extension): ``ListTools`` asks which tools the user's MCP
servers offer, ``RunTool`` runs one. Only the daemon's own user (its socket, or the
daemon token) may ask: a tool runs as that user, on that host.

The daemon never runs a tool on a model's say-so: a client (``chat``, ``run``, the web
console) asks its user first, then sends ``RunTool``.
"""

from __future__ import annotations

from dataclasses import field

from .validation import message, parse_json

_EXT = {"skip_none": True}
MAX_TOOL_TIMEOUT_MS = 3_600_000


@message(names=("server", "name"))
class HostedTool:
    """One tool of an MCP server: ``name`` is what the model calls (the server's own
    name for it, or ``server__tool`` where two servers share one); ``parameters`` its
    JSON Schema, as text."""

    server: str
    name: str
    description: str
    parameters: str

    def _validate(self) -> None:
        parse_json("tool parameters", self.parameters, dict, "a JSON object", are=True)


@message()
class ListTools:
    """Which tools the configured MCP servers offer (starting those not yet running);
    answered by one ``ToolList``."""

    request_id: str


@message(names=("name",), ranges={"timeout_ms": (1, MAX_TOOL_TIMEOUT_MS)})
class RunTool:
    """Run tool ``name`` (as ``ToolList`` named it) with ``arguments`` (a JSON object,
    as text); answered by one ``ToolResult``, an error of the tool's included."""

    request_id: str
    name: str
    arguments: str
    timeout_ms: int | None = field(default=None, metadata=_EXT)
    """How long the call may take (absent: the daemon's limit, 120 s)."""

    def _validate(self) -> None:
        parse_json("tool arguments", self.arguments, dict, "a JSON object", are=True)


@message()
class ToolList:
    """The tools of every MCP server that started, and one sentence for each that
    did not (``problems``)."""

    request_id: str
    tools: tuple[HostedTool, ...]
    problems: tuple[str, ...]


@message()
class ToolResult:
    """What a tool returned, as text; ``is_error`` when the tool (or its server, or
    the time limit) failed it: that text, too, goes back to the model."""

    request_id: str
    content: str
    is_error: bool
