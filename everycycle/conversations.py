"""Saved chat conversations: one JSON file each under the state directory
(``conversations/ID.json``), written whole and atomically after every turn, so a chat
cut off at any moment leaves the last finished turn on disk.

A file holds the model, the system prompt and the messages (tool calls and results
included; an image as its base64 part), in the protocol's own field names.
"""

from __future__ import annotations

import datetime
import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import paths, statefile
from .errors import ConfigError, EverycycleError
from .protocol import ContentPart, Message, PartType, Role, ToolCall

__all__ = ["Saved", "as_json", "folder", "from_json", "latest", "listed", "load"]

ID = re.compile(r"^[0-9]{8}-[0-9]{6}-[0-9a-f]{4}$")
"""A conversation's id: when it began (sortable) and four random hex digits."""


def folder() -> Path:
    return paths.state_dir() / "conversations"


@dataclass
class Saved:
    """A conversation as kept on disk."""

    model: str
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    id: str = field(default_factory=lambda: _new_id())
    created: float = field(default_factory=lambda: datetime.datetime.now().timestamp())
    updated: float = 0.0

    @property
    def title(self) -> str:
        """Its first user message, on one line."""
        first = next((m.text for m in self.messages if m.role is Role.USER), "")
        line = " ".join(first.split())
        return line if len(line) <= 60 else line[:59] + "…"

    def save(self) -> None:
        """Write it whole (atomically). Raises EverycycleError (FileBusyError) or OSError."""
        self.updated = datetime.datetime.now().timestamp()
        statefile.write(folder() / f"{self.id}.json",
                        json.dumps(as_json(self), ensure_ascii=False, indent=1) + "\n")


def as_json(saved: Saved) -> dict[str, Any]:
    """The conversation as its file (and the console's API) has it."""
    return {"id": saved.id, "model": saved.model, "system": saved.system,
            "created": saved.created, "updated": saved.updated,
            "messages": [_message_out(m) for m in saved.messages]}


def from_json(doc: Any) -> Saved:
    """A conversation from its JSON (a file's, or the console's: ``id`` and the times
    may be absent). Raises ConfigError (ProtocolError for a message that is not one)."""
    try:
        if not isinstance(doc, dict) or not isinstance(doc["model"], str):
            raise ConfigError("a conversation is an object with a `model`")
        system = doc.get("system")
        if system is not None and not isinstance(system, str):
            raise ConfigError("`system` must be a string")
        if not isinstance(doc["messages"], list):
            raise ConfigError("`messages` must be a list")
        saved = Saved(model=doc["model"], system=system,
                      messages=[_message_in(m) for m in doc["messages"]])
        if doc.get("id") is not None:
            if not isinstance(doc["id"], str) or not ID.match(doc["id"]):
                raise ConfigError(f"'{doc['id']}' is not a conversation id")
            saved.id = doc["id"]
        for stamp in ("created", "updated"):
            if isinstance(doc.get(stamp), int | float):
                setattr(saved, stamp, float(doc[stamp]))
        return saved
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"not a conversation: {exc!r}") from None


def _new_id() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def _message_out(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role.value}
    if isinstance(m.content, str):
        out["content"] = m.content
    else:
        out["content"] = [{k: v for k, v in (("type", p.type.value), ("text", p.text),
                                             ("data", p.data), ("mime", p.mime))
                           if v is not None} for p in m.content]
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _message_in(raw: dict[str, Any]) -> Message:
    content = raw["content"]
    if not isinstance(content, str):
        content = tuple(ContentPart(PartType(p["type"]), p.get("text"), p.get("data"),
                                    p.get("mime")) for p in content)
    calls = raw.get("tool_calls")
    return Message(Role(raw["role"]), content,
                   tuple(ToolCall(c["id"], c["name"], c["arguments"]) for c in calls)
                   if calls else None, raw.get("tool_call_id"))


def load(conversation_id: str) -> Saved:
    """The saved conversation ``conversation_id``. Raises ConfigError (none such, or a
    file that is not one)."""
    if not ID.match(conversation_id):
        raise ConfigError(f"'{conversation_id}' is not a conversation id "
                          "(`everycycle chat --list` shows them)")
    path = folder() / f"{conversation_id}.json"
    try:
        return from_json(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise ConfigError(f"no saved conversation '{conversation_id}' "
                          "(`everycycle chat --list` shows them)") from None
    except (OSError, ValueError, EverycycleError) as exc:
        message = exc.message if isinstance(exc, EverycycleError) else str(exc)
        raise ConfigError(f"{path} is not a saved conversation: {message}") from None


def listed() -> list[Saved]:
    """Every saved conversation, the most recently updated first (unreadable files are
    left out)."""
    found: list[Saved] = []
    try:
        paths_ = sorted(folder().glob("*.json"))
    except OSError:
        return []
    for path in paths_:
        try:
            found.append(load(path.stem))
        except ConfigError:
            continue
    return sorted(found, key=lambda s: s.updated, reverse=True)


def latest() -> Saved:
    """The most recently updated conversation. Raises ConfigError when there is none."""
    every = listed()
    if not every:
        raise ConfigError("no saved conversation yet (a chat saves each one)")
    return every[0]
