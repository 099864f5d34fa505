"""What ``run``'s file options make of their files: ``--tools`` (with
``--tool-choice``), ``--json-schema`` and ``--grammar``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..protocol import ContentPart, Message, Role, ToolChoice
from .common import fail


def tool_fields(tools: Path | None, choice: str | None,
                 text: str | tuple[ContentPart, ...]) -> dict[str, Any]:
    """With ``--tools``: the prompt as the user's turn, the tools and the choice."""
    if tools is None:
        if choice is not None:
            fail("usage: --tool-choice needs --tools", 2)
        return {}
    raw = read_text(tools, "--tools")
    assert raw is not None
    try:
        listed = json.loads(raw)
    except ValueError as exc:
        fail(f"--tools {tools}: not JSON: {exc}", 2)
    if isinstance(listed, dict):
        listed = [listed]
    fields: dict[str, Any] = {"messages": (Message(Role.USER, text),),
                              "tools": json.dumps(listed)}
    if choice in ("auto", "required", "none"):
        fields["tool_choice"] = ToolChoice(choice)
    elif choice is not None:
        fields["tool_name"] = choice
    return fields


def read_text(path: Path | None, option: str) -> str | None:
    """A file's text for ``option``. Raises ConfigError naming the file."""
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{option} {path}: {getattr(exc, 'strerror', None) or exc}"
                          ) from None
