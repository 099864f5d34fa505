"""Tool calls: how a model writes them (its format), the grammar that holds it to a
well-formed call, and parsing them out of its output, whole or streamed.

Formats, in the spirit of llama.cpp's common/chat.cpp:

* HERMES (Qwen2.5, Qwen3, Hermes 2 Pro/3): ``<tool_call>{"name": .., "arguments": {..}}
  </tool_call>``, one block per call.
* LLAMA3 (Llama 3.1-3.3): ``{"name": .., "parameters": {..}}`` at the start of the
  output, or after ``<|python_tag|>`` anywhere; several calls may follow, split by ``;``.
* MISTRAL (Mistral Nemo and kin): ``[TOOL_CALLS][{"name": .., "arguments": {..},
  "id": ..}, ..]``.
* GENERIC (a template without tool support): the whole output is one JSON object,
  ``{"tool_calls": [{"name": .., "arguments": {..}}]}`` or ``{"response": "text"}``, as
  ``generic_system_prompt`` tells the model.

Parsing is one state machine (``StreamParser``); ``parse`` feeds it the whole text, so
streamed and whole results agree. A call that does not decode, or names an unknown tool,
goes back into the content verbatim and is counted in ``malformed``. Whitespace between
content and a recognised call, and between calls, is dropped. The grammar of calls is
``callgrammar.py``'s.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError


class ToolFormat(enum.Enum):
    """How a model family writes tool calls."""

    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    GENERIC = "generic"


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_OPEN = "[TOOL_CALLS]"


def detect_format(template_source: str | None) -> ToolFormat:
    """The tool-call format a chat template's model was trained on, from its markers.

    Qwen3-Coder's XML calls (``<tool_call><function=..>``) are not one of these formats:
    such templates get GENERIC.
    """
    src = template_source or ""
    if HERMES_OPEN in src:
        if "<function=" in src:
            return ToolFormat.GENERIC
        return ToolFormat.HERMES
    if MISTRAL_OPEN in src:
        return ToolFormat.MISTRAL
    if PYTHON_TAG in src or ("ipython" in src and "parameters" in src):
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC


_TRIGGERS: dict[ToolFormat, list[str]] = {
    ToolFormat.HERMES: [HERMES_OPEN],
    ToolFormat.LLAMA3: [PYTHON_TAG],
    ToolFormat.MISTRAL: [MISTRAL_OPEN],
    ToolFormat.GENERIC: [],
}
MARKERS = (HERMES_OPEN, HERMES_CLOSE, PYTHON_TAG, MISTRAL_OPEN)
"""The formats' marker words: a vocabulary's token for one of them is matched as its
text by the constraint engine (so ``"<tool_call>"`` in a grammar matches the token)."""
LLAMA3_START = r'\s*\{\s*("type"\s*:\s*"function"\s*,\s*)?"name"\s*:'
"""LLAMA3's bare call, which only counts at the start of the output: once the output
starts so, it must be a call."""


def triggers(fmt: ToolFormat) -> list[str]:
    """The words after which the output must be a call (``call_grammar`` starts there,
    lazily). GENERIC has none: its grammar holds from the first token. LLAMA3's bare
    JSON call at the start of the output (``LLAMA3_START``) is one too."""
    return list(_TRIGGERS[fmt])


# -- tools -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and parameters' JSON schema; ``strict``
    (only where a client says ``strict: true``): the schema is enforced whole, or the
    request refused."""

    name: str
    description: str
    parameters: dict[str, Any]
    strict: bool = False


def normalize_tools(tools: Sequence[Mapping[str, Any]]) -> list[Tool]:
    """OpenAI-style tools (``{"type": "function", "function": {...}}``, or the inner
    object alone) as Tools. Raises InvalidRequestError naming what is wrong."""
    out: list[Tool] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(f"{where} must be an object")
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise InvalidRequestError(f"{where}.type must be \"function\"")
            tool, where = tool["function"], f"{where}.function"
            if not isinstance(tool, Mapping):
                raise InvalidRequestError(f"{where} must be an object")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"{where}.name must be a non-empty string")
        if name in seen:
            raise InvalidRequestError(f"{where}.name: two tools are named {name!r}")
        seen.add(name)
        params = tool.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise InvalidRequestError(f"{where}.parameters must be a JSON schema object")
        description = tool.get("description")
        out.append(Tool(name, description if isinstance(description, str) else "",
                        dict(params), tool.get("strict") is True))
    return out


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The names of ``tools`` (validated as ``normalize_tools`` does)."""
    return [t.name for t in normalize_tools(tools)]


def generic_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that teaches a model without tool support the GENERIC format."""
    listed = "\n".join(
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                   ensure_ascii=False)
        for t in normalize_tools(tools))
    return (
        "You can call the following tools (their parameters are JSON schemas):\n"
        f"{listed}\n\n"
        "Respond with a single JSON object and nothing else. To call one or more tools:\n"
        '{"tool_calls": [{"name": "<tool name>", "arguments": {<the arguments>}}]}\n'
        "To answer the user directly:\n"
        '{"response": "<your answer>"}'
    )


def add_system_prompt(messages: Sequence[Mapping[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` appended to their system message (or a new one first)."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
    else:
        out.insert(0, {"role": "system", "content": text})
    return out
