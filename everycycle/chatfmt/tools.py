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
content and a recognised call, and between calls, is dropped.
"""

from __future__ import annotations

import copy
import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequestError
from .grammar import COUNTS, MAX_EXPANDED, check_size, schema_to_gbnf


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
LLAMA3_START = r'^\s*(\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:)[\s\S]*$'
"""LLAMA3's bare call, which only counts at the start of the output (anchored)."""


def triggers(fmt: ToolFormat) -> list[str]:
    """The words after which the output must follow ``call_grammar`` (a lazy grammar
    that starts at the word). GENERIC has none: its grammar holds from the first token.
    LLAMA3's bare JSON call at the start of the output is in ``trigger_patterns``."""
    return list(_TRIGGERS[fmt])


def trigger_patterns(fmt: ToolFormat) -> list[str]:
    """``triggers`` as llama.cpp's lazy-grammar patterns, plus LLAMA3's start-of-output
    call: llama.cpp searches the output so far for each pattern (one anchored with
    ``^...$`` must match all of it) and starts the grammar at the first capture group,
    or at the match when there is none."""
    patterns = [re.escape(word) for word in _TRIGGERS[fmt]]
    if fmt is ToolFormat.LLAMA3:
        patterns.append(LLAMA3_START)
    return patterns


def constrained_from_start(fmt: ToolFormat, *, forced: bool) -> bool:
    """Whether the grammar applies from the first token (else lazily, on a trigger)."""
    return forced or fmt is ToolFormat.GENERIC


# -- tools -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and parameters' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]


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
                        dict(params)))
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


# -- grammar -----------------------------------------------------------------------------

_UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else",
               "propertyNames", "additionalItems", "unevaluatedProperties")


def _strip_bounds(schema: object) -> object:
    """``schema`` without numeric bounds, which a grammar cannot hold a model to, nor
    counts past what a grammar can expand (Claude Code's ``maxLength: 524288``); the
    client still validates the arguments. Only schema keywords are touched."""
    if isinstance(schema, list):
        return [_strip_bounds(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, object] = {}
    for key, value in schema.items():
        if key in _UNENFORCED:
            continue
        if key in COUNTS and isinstance(value, int | float) and value > MAX_EXPANDED:
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _strip_bounds(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS or key in _SCHEMA_ONE:
            out[key] = _strip_bounds(value)
        else:
            out[key] = value
    return out


def _hoist(params: dict[str, Any], i: int, defs: dict[str, Any]) -> dict[str, Any]:
    """``params`` with its ``$defs``/``definitions`` moved into ``defs`` as ``t{i}-name``
    and its local ``$ref`` s rewritten, so that several tools share one root schema."""
    params = copy.deepcopy(params)
    own = f"t{i}-params"
    local: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        found = params.pop(key, None)
        if isinstance(found, dict):
            local.update(found)
    needs_self = False

    def rewrite(node: object) -> None:
        nonlocal needs_self
        if isinstance(node, list):
            for item in node:
                rewrite(item)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                parts = ref[2:].split("/") if ref != "#" else []
                if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
                    node["$ref"] = "/".join(["#", "$defs", f"t{i}-{parts[1]}", *parts[2:]])
                else:
                    needs_self = True
                    node["$ref"] = "/".join(["#", "$defs", own, *parts])
            for value in node.values():
                rewrite(value)

    rewrite(params)
    rewrite(local)
    for name, schema in local.items():
        defs[f"t{i}-{name}"] = schema
    if needs_self:
        defs[own] = params
    return params


_RULE_NAME = re.compile(r"^([a-zA-Z0-9-]+) ::=", re.MULTILINE)


def _fresh(base: str, taken: set[str]) -> str:
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}{n}"
    taken.add(name)
    return name


def call_grammar(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], *, forced: bool,
                 name: str | None = None, parallel: bool = True) -> str:
    """A GBNF grammar (root ``root``) for a well-formed call, in ``fmt``, of one of
    ``tools`` (only the one named ``name`` when given) whose arguments follow that
    tool's schema; ``parallel`` allows several calls. Unless ``forced`` (or a name is
    given), GENERIC's grammar also allows ``{"response": "..."}``. For the lazy formats
    the grammar starts at the trigger word (see ``triggers``).

    Raises InvalidRequestError for bad tools, an unknown ``name``, or a schema the
    converter cannot handle.
    """
    chosen = normalize_tools(tools)
    if name is not None:
        chosen = [t for t in chosen if t.name == name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools")
    if not chosen:
        raise InvalidRequestError("tools is empty: there is nothing to call")
    args_key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    defs: dict[str, Any] = {}
    alternatives: list[dict[str, Any]] = []
    for i, tool in enumerate(chosen):
        stripped = _strip_bounds(tool.parameters)
        assert isinstance(stripped, dict)
        params = _hoist(stripped, i, defs)
        props: dict[str, Any] = {"name": {"const": tool.name}, args_key: params}
        required = ["name", args_key]
        if fmt is ToolFormat.MISTRAL:
            props["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
            required.append("id")
        alternatives.append({"type": "object", "properties": props, "required": required})
    call: dict[str, Any] = {"oneOf": alternatives}
    array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    body: dict[str, Any]
    if fmt is ToolFormat.MISTRAL:
        body = array
    elif fmt is ToolFormat.GENERIC:
        calls = {"type": "object", "properties": {"tool_calls": array},
                 "required": ["tool_calls"]}
        response = {"type": "object", "properties": {"response": {"type": "string"}},
                    "required": ["response"]}
        body = calls if forced or name is not None else {"oneOf": [calls, response]}
    else:
        body = call
    if defs:
        body = {**body, "$defs": defs}
    gbnf = schema_to_gbnf(json.dumps(body))
    if fmt is ToolFormat.GENERIC:
        return gbnf
    taken = set(_RULE_NAME.findall(gbnf)) - {"root"}
    inner, ws, one = _fresh("tool-body", taken), _fresh("tool-ws", taken), ""
    gbnf = re.sub(r"^root ::=", f"{inner} ::=", gbnf, count=1, flags=re.MULTILINE)
    rules = [f"{ws} ::= [ \\t\\n]{{0,8}}"]
    if fmt is ToolFormat.HERMES:
        one = _fresh("tool-call", taken)
        rules.append(f'{one} ::= "<tool_call>" {ws} {inner} {ws} "</tool_call>"')
        more = f" ({ws} {one})*" if parallel else ""
        rules.insert(0, f"root ::= {one}{more}")
    elif fmt is ToolFormat.LLAMA3:
        more = f' ({ws} (";" {ws})? {inner})*' if parallel else ""
        rules.insert(0, f'root ::= ("<|python_tag|>" {ws})? {inner}{more}')
    else:
        rules.insert(0, f'root ::= "[TOOL_CALLS]" {ws} {inner}')
    grammar = "\n".join(rules) + "\n" + gbnf
    check_size(grammar, "tools")
    return grammar
