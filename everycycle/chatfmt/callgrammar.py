"""The constraint that holds a model to well-formed tool calls, compiled once per list.

Each tool's arguments follow its schema as far as the constraint engine can enforce it:
a tool list never refuses a turn. A tool's schema is compiled ``lenient`` (llguidance
relaxes what it does not implement where it stands: ``propertyNames``, ``not``,
``uniqueItems``, ``if``/``then``/``else``, ``contains``, ``dependentSchemas``, an unknown
``format``; a ``oneOf`` it cannot prove disjoint is read as ``anyOf``), and a schema it
cannot compile at all (a ``$ref`` to a remote document, a misspelt type) is any JSON
object; such a tool's calls are checked against its whole schema once written
(``schemacheck.ArgumentCheck``). A tool sent with ``strict: true`` is enforced whole or
refused with a 400 naming the tool, the keyword and its place.

No fixed cap on a list: its bound is the context (the rendered prompt must fit) and the
constraint engine's compile budget, which grows with the grammar's length
(``constraint.limits``). Agents send the same list every turn: ``CallGrammars`` keeps
what a list compiled to, by the text it was built from, within a budget of bytes.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError
from .constraint import (
    JSON_OPTIONS,
    WS_PATTERN,
    compile_messages,
    for_generation,
    fuel,
    json_schema,
)
from .schemacheck import SCHEMA_MAPS, VALUES, ArgumentCheck, Relaxed, keywords, places, pointer
from .tools import (
    HERMES_CLOSE,
    HERMES_OPEN,
    LLAMA3_START,
    MISTRAL_OPEN,
    PYTHON_TAG,
    Tool,
    ToolFormat,
    normalize_tools,
)

log = logging.getLogger(__name__)

LENIENT: dict[str, Any] = {**JSON_OPTIONS, "lenient": True}
"""A tool's schema: what the constraint engine does not implement is relaxed."""
STRICT_HINT = ("; without `strict: true` the tool is served, and its calls are checked "
               "against the whole schema once written")
ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""The arguments of a tool whose schema does not compile."""


@dataclass(frozen=True)
class CallGrammar:
    """A compiled tool list: the grammar (llguidance's), what each tool's grammar does
    not enforce (by tool name), and the check its calls get after generation."""

    grammar: str
    relaxed: Mapping[str, tuple[Relaxed, ...]] = field(default_factory=dict)
    check: ArgumentCheck = field(default_factory=lambda: ArgumentCheck({}))


def _lit(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _call_rules(fmt: ToolFormat, chosen: Sequence[Tool], patched: Patches) -> list[str]:
    """``call``: one call of one of ``chosen``, as ``fmt`` writes its JSON object (the
    name first, then the arguments, each tool's own schema on its arguments);
    ``bare``: the rest of a LLAMA3 call after its ``"name":``."""
    args_key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(chosen)))}",
             f"bare: {' | '.join(f'bare_{i}' for i in range(len(chosen)))}"]
    for i, tool in enumerate(chosen):
        rules += _rules(fmt, i, tool, args_key, patched)
    return rules


def _rules(fmt: ToolFormat, i: int, tool: Tool, args_key: str, patched: Patches
           ) -> list[str]:
    tail = ""
    if fmt is ToolFormat.MISTRAL:
        tail = f' WS "," WS {_lit(json.dumps("id"))} WS ":" WS MISTRAL_ID'
    return [f'call_{i}: "{{" WS {_lit(json.dumps("name"))} WS ":" bare_{i}',
            (f"bare_{i}: WS {_lit(json.dumps(tool.name, ensure_ascii=False))} WS \",\" WS "
             f"{_lit(json.dumps(args_key))} WS \":\" WS args_{i}{tail} WS \"}}\""),
            f"args_{i}: %json {json.dumps(_arguments(i, tool, patched), ensure_ascii=False)}"]


def _arguments(i: int, tool: Tool, patched: Patches) -> dict[str, Any]:
    if i in patched:
        return {**for_generation(patched[i][0], "tools"), "x-guidance": LENIENT}
    where = f"tool '{tool.name}'"
    options = JSON_OPTIONS if tool.strict else LENIENT
    return {**for_generation(tool.parameters, where), "x-guidance": options}


def call_grammar(fmt: ToolFormat, tools: Sequence[Mapping[str, Any]], *, forced: bool,
                 name: str | None = None, parallel: bool = True) -> CallGrammar:
    """The constraint for a well-formed call, in ``fmt``, of one of ``tools`` (only the
    one named ``name`` when given) whose arguments follow that tool's schema;
    ``parallel`` allows several calls. Unless ``forced`` (or a name is given), the output
    may be free text, and must be a call from the format's trigger on (``triggers``,
    LLAMA3's ``LLAMA3_START``); GENERIC then also allows ``{"response": "..."}``.

    Raises InvalidRequestError for bad tools, an unknown ``name``, a ``strict`` tool
    whose schema the constraint engine cannot enforce whole, or a list past the compile
    budget although each tool alone compiles.
    """
    chosen = normalize_tools(tools)
    if name is not None:
        chosen = [t for t in chosen if t.name == name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools")
    if not chosen:
        raise InvalidRequestError("tools is empty: there is nothing to call")
    for tool in chosen:
        if tool.strict:  # enforced whole, or refused naming the keyword and its place
            json_schema(tool.parameters, f"tool '{tool.name}' (strict)", STRICT_HINT)
    patched: dict[int, tuple[dict[str, Any], tuple[Relaxed, ...]]] = {}
    while True:
        grammar = _grammar(fmt, chosen, free=not forced and name is None, parallel=parallel,
                           patched=patched)
        error, warnings = compile_messages(grammar)
        if error is None:
            break
        alone = {i: _relaxed_until_it_compiles(t.parameters) for i, t in enumerate(chosen)
                 if i not in patched and not t.strict and _schema_error(t.parameters)}
        if not alone:
            raise InvalidRequestError(_past_budget(chosen, grammar, error))
        patched.update(alone)
    relaxed = {chosen[i].name: found for i, (_, found) in patched.items()}
    wanted = keywords(warnings)
    for i, tool in enumerate(chosen):
        if wanted and not tool.strict and (found := tuple(places(
                patched[i][0] if i in patched else tool.parameters, wanted))):
            relaxed[tool.name] = relaxed.get(tool.name, ()) + found
    return CallGrammar(grammar, relaxed, ArgumentCheck(
        {t.name: t.parameters for t in chosen if t.name in relaxed}))


Patches = Mapping[int, tuple[dict[str, Any], tuple[Relaxed, ...]]]
"""Tools (by index) whose schema does not compile: the schema with the parts that do not
relaxed to any value, and where they were."""
MAX_RELAXED_PARTS = 8
"""Parts of one schema relaxed one by one before the whole is taken for any object."""


def _schema_error(schema: Mapping[str, Any]) -> str | None:
    """The constraint engine's error for ``schema`` compiled ``lenient`` alone, if any:
    its first line, without llguidance's grammar dump."""
    try:
        body = {**for_generation(dict(schema), "tools"), "x-guidance": LENIENT}
    except InvalidRequestError as exc:
        return exc.message
    error = compile_messages(f"%llguidance {{}}\nstart: %json {json.dumps(body)}")[0]
    if error is None:
        return None
    return _without_dump(error)


def _without_dump(error: str) -> str:
    """llguidance's error without its place in our grammar, its preamble and the
    grammar's lines after it (``at 63(10): failed to compile JSON schema: … 61 |
    call_18: …``)."""
    error = re.sub(r"^at \d+\(\d+\): ", "", error).removeprefix("failed to compile JSON schema: ")
    return re.split(r" \d+ \| ", error, maxsplit=1)[0].strip()


def _relaxed_until_it_compiles(schema: dict[str, Any]
                               ) -> tuple[dict[str, Any], tuple[Relaxed, ...]]:
    """``schema`` with its smallest parts that do not compile (a regex llguidance cannot
    decide, an empty ``enum``) relaxed to ``{}``, any value, one by one; any object when
    that is not enough."""
    found: list[Relaxed] = []
    for _ in range(MAX_RELAXED_PARTS):
        error = _schema_error(schema)
        if error is None:
            return schema, tuple(found)
        path = _culprit(schema, schema, [])
        if not path:
            break
        schema = _replaced(schema, path)
        found.append(Relaxed(pointer(path), "", error))
    error = _schema_error(schema) or "too many parts that do not compile"
    return dict(ANY_OBJECT), (*found, Relaxed("#", "", error))


def _culprit(root: Mapping[str, Any], node: Any, path: list[str]) -> list[str]:
    """The path to the deepest subschema of ``node`` that does not compile alone (with
    ``root``'s definitions, for its ``$ref``s)."""
    defs = {k: root[k] for k in ("$defs", "definitions") if k in root}
    for key, child in _subschemas(node):
        if isinstance(child, dict) and _schema_error({**defs, **child}) is not None:
            return _culprit(root, child, [*path, *key])
    return path


def _subschemas(node: Any) -> list[tuple[list[str], Any]]:
    out: list[tuple[list[str], Any]] = []
    if not isinstance(node, dict):
        return out
    for k, v in node.items():
        if k in SCHEMA_MAPS and isinstance(v, dict):
            out += [([k, name], sub) for name, sub in v.items()]
        elif k in VALUES:
            continue
        elif isinstance(v, list):
            out += [([k, str(i)], sub) for i, sub in enumerate(v)]
        elif isinstance(v, dict):
            out.append(([k], v))
    return out


def _replaced(schema: Any, path: Sequence[str]) -> Any:
    """``schema`` (not changed) with the subschema at ``path`` replaced by ``{}``."""
    if not path:
        return {}
    head, rest = path[0], path[1:]
    if isinstance(schema, list):
        return [_replaced(v, rest) if str(i) == head else v for i, v in enumerate(schema)]
    return {k: _replaced(v, rest) if k == head else v for k, v in schema.items()}


def _past_budget(chosen: Sequence[Tool], grammar: str, error: str) -> str:
    largest = max(chosen, key=lambda t: len(json.dumps(t.parameters)))
    return (f"tools: the list is past the constraint engine's compile budget "
            f"({fuel(grammar):,} lexer fuel for {len(grammar):,} characters of grammar: "
            f"{_without_dump(error)}), though each tool compiles alone; the largest is "
            f"'{largest.name}' ({len(json.dumps(largest.parameters)):,} bytes of schema)")


def _grammar(fmt: ToolFormat, chosen: Sequence[Tool], *, free: bool, parallel: bool,
             patched: Patches) -> str:
    if fmt is ToolFormat.HERMES:
        close = f"WS call WS {_lit(HERMES_CLOSE)}"
        more = f" (WS {_lit(HERMES_OPEN)} {close})*" if parallel else ""
        start = f"lead {close}{more} | TEXT" if free else f"{_lit(HERMES_OPEN)} {close}{more}"
        rules = [f"lead[lazy]: TEXT {_lit(HERMES_OPEN)}"]
    elif fmt is ToolFormat.LLAMA3:
        more = ' (WS (";" WS)? call)*' if parallel else ""
        start = (f"py_lead WS call{more} | bare_lead bare{more} | TEXT" if free
                 else f"({_lit(PYTHON_TAG)} WS)? call{more}")
        rules = [f"py_lead[lazy]: TEXT {_lit(PYTHON_TAG)}",
                 f"bare_lead[lazy]: /{LLAMA3_START}/"]
    elif fmt is ToolFormat.MISTRAL:
        array = '"[" WS call (WS "," WS call)* WS "]"' if parallel else '"[" WS call WS "]"'
        start = "lead WS array | TEXT" if free else f"{_lit(MISTRAL_OPEN)} WS array"
        rules = [f"array: {array}", f"lead[lazy]: TEXT {_lit(MISTRAL_OPEN)}",
                 'MISTRAL_ID: /"[a-zA-Z0-9]{9}"/']
    else:
        listed = "call (WS \",\" WS call)*" if parallel else "call"
        response = {"type": "object", "properties": {"response": {"type": "string"}},
                    "required": ["response"], "additionalProperties": False,
                    "x-guidance": JSON_OPTIONS}
        start = "calls | response" if free else "calls"
        rules = [(f'calls: "{{" WS {_lit(json.dumps("tool_calls"))} WS ":" WS "[" WS '
                 f'{listed} WS "]" WS "}}"'),
                 f"response: %json {json.dumps(response)}"]
    lines = ["%llguidance {}", f"start: {start}", *rules, *_call_rules(fmt, chosen, patched),
             f"WS: /{WS_PATTERN}/", r"TEXT: /(.|\n)*/"]
    return "\n".join(lines)


class CallGrammars:
    """Compiled tool lists by what they were built from (the format, the list's JSON
    text as the client sent it, the choice), newest kept, within ``max_bytes`` of list
    and grammar text; one per daemon, shared by every model, slot and dialect. Any
    thread: a list compiling is waited for, not compiled twice."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._kept: OrderedDict[tuple[str, str, bool, str | None, bool], CallGrammar] = (
            OrderedDict())
        self._bytes = 0
        self._lock = threading.Lock()
        self._compiling: dict[tuple[str, str, bool, str | None, bool], threading.Lock] = {}
        self.hits = 0
        self.compiled = 0
        self._parsed: OrderedDict[str, tuple[list[dict[str, Any]], list[str]]] = OrderedDict()

    KEEP_PARSED = 8
    """Lists kept parsed (an agent's; a few agents at once)."""

    def parsed(self, tools_json: str) -> tuple[list[dict[str, Any]], list[str]]:
        """The list ``tools_json`` (a JSON array) parsed, and its tools' names (checked
        as ``normalize_tools`` checks them), once per text: the same objects for every
        request that sends it, never to be changed. Raises InvalidRequestError."""
        with self._lock:
            found = self._parsed.get(tools_json)
            if found is not None:
                self._parsed.move_to_end(tools_json)
                return found
        tools = json.loads(tools_json)
        names = [t.name for t in normalize_tools(tools)]
        with self._lock:
            self._parsed[tools_json] = (tools, names)
            while len(self._parsed) > self.KEEP_PARSED:
                self._parsed.popitem(last=False)
        return tools, names

    def get(self, fmt: ToolFormat, tools_json: str, *, forced: bool, name: str | None,
            parallel: bool) -> CallGrammar:
        """``call_grammar`` for the list ``tools_json``, compiled once. Raises
        InvalidRequestError as it does (a refusal is not kept)."""
        key = (fmt.value, tools_json, forced, name, parallel)
        with self._lock:
            found = self._kept.get(key)
            if found is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return found
            gate = self._compiling.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                found = self._kept.get(key)
                if found is not None:
                    self.hits += 1
                    return found
            try:
                compiled = call_grammar(fmt, self.parsed(tools_json)[0], forced=forced,
                                        name=name, parallel=parallel)
            except BaseException:
                with self._lock:
                    self._compiling.pop(key, None)
                raise
            _report(compiled)
            with self._lock:
                self.compiled += 1
                self._kept[key] = compiled
                self._bytes += _size(key, compiled)
                while len(self._kept) > 1 and self._bytes > self.max_bytes:
                    old_key, old = self._kept.popitem(last=False)
                    self._bytes -= _size(old_key, old)
                self._compiling.pop(key, None)
        return compiled


def _size(key: tuple[str, str, bool, str | None, bool], compiled: CallGrammar) -> int:
    return len(key[1]) + len(compiled.grammar)


def _report(compiled: CallGrammar) -> None:
    """One log line for a list whose grammar does not enforce all of its schemas."""
    if compiled.relaxed:
        log.info("tools: not enforced while generating, checked after: %s", "; ".join(
            f"'{name}': {', '.join(map(str, found))}"
            for name, found in compiled.relaxed.items()))
