"""The tool loop of a chat: the daemon's MCP tools offered to the model, and each call
it makes put to the user before it runs (allow once, allow that tool for this chat,
deny), then run by the daemon, its result going back to the model.

With no one to ask (no terminal), a call runs only when ``--yes`` or ``--allow TOOL``
allowed it; otherwise it is denied with one line on stderr. A denial, a tool's error
and a server's failure all go back to the model as the tool's result: the chat goes on.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, TextIO

from ..errors import EverycycleError
from ..protocol import HostedTool, Message, Role, ToolCall

if TYPE_CHECKING:
    from ..client.aio import BaseClient

__all__ = ["DENIED", "MAX_ROUNDS", "Toolbox"]

MAX_ROUNDS = 8
"""Tool rounds in one turn before the model must answer (a random model loops)."""
DENIED = "The user did not allow this tool call."
SHOWN_LINES = 4
"""Lines of a result shown under its call (the model gets all of it)."""

Ask = Callable[[str], Awaitable[str]]
"""Puts a question to the user; their answer (raises EOFError, KeyboardInterrupt)."""


class Toolbox:
    """One chat's MCP tools: what the model is offered and what the user allowed."""

    def __init__(self, client: BaseClient, notice: TextIO, *, ask: Ask | None = None,
                 allow: Iterable[str] = (), yes: bool = False) -> None:
        self._client = client
        self._notice = notice
        self._ask = ask
        self._allowed = set(allow)
        """Tools the user allowed for the whole chat (``--allow``, or "always")."""
        self._yes = yes
        self.tools: dict[str, HostedTool] = {}

    async def start(self) -> list[str]:
        """Ask the daemon for the tools (starting the user's MCP servers); what to tell
        the user (the servers that did not start). Raises EverycycleError."""
        listed = await self._client.list_tools()
        self.tools = {tool.name: tool for tool in listed.tools}
        notes = [f"everycycle: {problem}" for problem in listed.problems]
        unknown = sorted(self._allowed - set(self.tools))
        if unknown:
            notes.append(f"everycycle: --allow names no tool here: {', '.join(unknown)}")
        return notes

    @property
    def offered(self) -> str | None:
        """The tools as Generate's ``tools`` (OpenAI's shape); None when there are none."""
        if not self.tools:
            return None
        return json.dumps([{"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": json.loads(t.parameters)}} for t in self.tools.values()],
            ensure_ascii=False)

    async def run(self, call: ToolCall) -> Message:
        """The tool's answer to ``call``, as the conversation's next message: run if the
        user allows it, else the denial."""
        tool = self.tools.get(call.name)
        where = f" ({tool.server})" if tool else ""
        self._say(f"⚒ {call.name}{where} {_compact(call.arguments)}")
        if tool is None:
            return self._result(call, f"There is no tool named '{call.name}'.", True)
        if not await self._allows(call.name):
            return self._result(call, DENIED, True)
        try:
            result = await self._client.run_tool(call.name, call.arguments)
        except EverycycleError as exc:  # (the server, not the chat, failed)
            return self._result(call, exc.message, True)
        return self._result(call, result.content, result.is_error)

    async def _allows(self, name: str) -> bool:
        if self._yes or name in self._allowed:
            return True
        if self._ask is None:
            self._say(f"everycycle: the tool call {name} was denied: no terminal to ask "
                      f"(--yes, or --allow {name}, allows it)")
            return False
        while True:
            try:
                answer = (await self._ask(f"  allow {name}? [y]es once, [a]lways in this "
                                          "chat, [n]o: ")).strip().lower()
            except (EOFError, KeyboardInterrupt):
                answer = "n"
            if answer in ("y", "yes"):
                return True
            if answer in ("a", "always"):
                self._allowed.add(name)
                return True
            if answer in ("n", "no", ""):
                self._say("  (denied)")
                return False

    def _result(self, call: ToolCall, text: str, is_error: bool) -> Message:
        lines = text.splitlines() or [""]
        mark = "  ✗ " if is_error else "  → "
        for i, line in enumerate(lines[:SHOWN_LINES]):
            self._say((mark if i == 0 else "    ") + _clip(line))
        if len(lines) > SHOWN_LINES:
            self._say(f"    … ({len(lines) - SHOWN_LINES} more lines)")
        return Message(Role.TOOL, text or "(no output)", tool_call_id=call.id)

    def _say(self, line: str) -> None:
        self._notice.write(line + "\n")
        self._notice.flush()


def assistant_turn(text: str, calls: tuple[ToolCall, ...]) -> Message:
    """The model's turn that made ``calls`` (with what it said besides)."""
    return Message(Role.ASSISTANT, text, tool_calls=calls)


def _compact(arguments: str) -> str:
    try:
        return _clip(json.dumps(json.loads(arguments), ensure_ascii=False), 160)
    except ValueError:
        return _clip(arguments, 160)


def _clip(line: str, width: int = 120) -> str:
    return line if len(line) <= width else line[:width - 1] + "…"
