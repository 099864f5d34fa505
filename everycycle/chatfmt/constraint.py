"""Structured output: what a request's output must follow, compiled for llguidance.

Every constraint — a JSON Schema (``json_schema``, OpenAI's ``response_format``, Ollama's
``format``), a GBNF grammar (the ``grammar`` field, ``--grammar FILE``, models.toml's
``grammar``) and the tool-call grammars of ``tools.py`` — becomes one llguidance grammar
(its serialized form, a string), which the engine's matcher enforces token by token
(``engine/constraint.py``). llguidance is the constraint engine llama.cpp itself offers
as its grammar backend; we write no converter of our own: in a schema a client asked us
to enforce (``response_format``, a ``strict`` tool), a keyword it does not implement is
refused with a 400 naming it and its place, never dropped; a tool list's schemas are
compiled ``lenient`` instead (``tools.py``, ``schemacheck.py``).

Pure: no llama.cpp, no tokenizer. ``check`` compiles the grammar's rules (no vocabulary)
so that what is broken is refused before a model is asked.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from ..errors import InvalidRequestError, ProtocolError
from ..protocol.validation import parse_json
from .schemacheck import SCHEMA_MAPS as _SCHEMA_MAPS
from .schemacheck import VALUES as _VALUES
from .schemacheck import refusal

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""What OpenAI's ``response_format: {"type": "json_object"}`` asks for."""

WS_PATTERN = r"(?: |\n{1,2}[ \t]{0,20})?"
"""Whitespace between JSON tokens, in the constraints we compile (a regex)."""

JSON_OPTIONS: dict[str, Any] = {
    # Whitespace between tokens exactly as llama.cpp's converter allows it (its
    # ``space`` rule): one space, or a line break or two and an indent; never a run of
    # blank lines a sampled model can spend its whole budget on.
    "whitespace_pattern": WS_PATTERN,
}
"""llguidance's JSON compile options (its defaults otherwise: strict ``oneOf``, every
unimplemented keyword an error)."""

MAX_SCHEMA_NODES = 3_000
"""The most schema objects, properties and enum values one request's schemas may hold
together: compiling costs about 0.3 ms each (measured: 2,000 properties take 0.6 s, 10,000
take 3 s), and a request is answered, or refused, within a second. (Claude Code's 30
tools hold about 700.)"""
MAX_GRAMMAR_BYTES = 256 * 1024
"""The longest GBNF or Lark text a request may carry."""


def _llg() -> Any:
    """llguidance (a Rust extension: imported when first needed, never by the CLI)."""
    import llguidance

    return llguidance


LEXER_FUEL = 200_000
"""The lexer's fuel for a small grammar: a fifth of llguidance's default (measured: a
``pattern`` of ``^(a{1000}){1000}$`` took 34 s to its first mask with the default, and
fails in 0.5 s with this)."""
FUEL_PER_CHAR = 4
"""More fuel for each character of a grammar, so that a long tool list (measured: 300
tools of 30 properties, 1.2 MB, needs ~1.1M) compiles in time in proportion to its length
(~50k fuel a millisecond): 0.6 s for that list."""


@functools.lru_cache(maxsize=64)
def _limits(fuel: int) -> Any:
    return _llg().LLParserLimits(verbose_errors=False, initial_lexer_fuel=fuel,
                                 step_lexer_fuel=50_000)


def fuel(grammar: str) -> int:
    """The lexer's fuel for ``grammar``: its compile budget grows with its length
    (``FUEL_PER_CHAR`` a character past the first 64k, rounded up to 64k characters so
    that few budgets exist)."""
    size = -(-len(grammar) // 65536) * 65536 if len(grammar) > 65536 else 0
    return LEXER_FUEL + FUEL_PER_CHAR * size


def limits(grammar: str = "") -> Any:
    """The parser's limits on what ``grammar`` may cost (llguidance's
    ``LLParserLimits``, with ``fuel``); errors stay short (no grammar dump)."""
    return _limits(fuel(grammar))


def json_schema(schema: str | dict[str, Any] | bool, where: str = "json_schema",
                hint: str = "") -> str:
    """The llguidance grammar for a JSON Schema (its JSON text, or parsed).

    Raises InvalidRequestError naming what is wrong: not JSON, not a schema, a keyword
    llguidance does not implement (and its place; ``hint`` follows that sentence), a
    schema too large.
    """
    written = _parse(schema, where)
    parsed = for_generation(written, where)
    count_nodes(parsed, where)
    try:
        grammar: str = _llg().LLMatcher.grammar_from_json_schema(parsed, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"{where}: {exc}") from None
    error = _llg().LLMatcher.validate_grammar(grammar, None, limits=limits(grammar))
    if error:
        raise InvalidRequestError(refusal(where, written, error, hint)
                                  or f"{where}: {short(error)}")
    return grammar


def for_generation(schema: dict[str, Any] | bool, where: str) -> dict[str, Any]:
    """``schema`` as the constraint engine is given it: ``true`` as ``{}``, counts
    written ``2.0`` as integers (llguidance wants them so), and objects closed to the
    properties they do not name (``closed_objects``). Raises InvalidRequestError for
    ``false`` (nothing matches it) and for nesting too deep to walk."""
    if schema is False:
        raise InvalidRequestError(f"{where}: the schema is `false`: no value matches it")
    try:
        return closed_objects({} if schema is True else schema)
    except RecursionError:
        raise InvalidRequestError(f"{where}: nested too deeply") from None


def closed_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with every object schema that names its ``properties`` and says nothing
    of other names (no ``additionalProperties``, ``patternProperties``,
    ``unevaluatedProperties``) closed to them (``additionalProperties: false``).

    JSON Schema lets such an object hold any other key, and a sampled model, given the
    choice, goes on inventing keys until ``max_tokens``; llama.cpp's converter and
    OpenAI's strict mode generate only the named properties, and so do we (a schema
    says ``"additionalProperties": true`` to allow others). Closing narrows what may be
    generated, so every output still validates against the schema as written; where it
    would not only narrow, the schema is left as it is: objects intersected (``allOf``,
    a ``$ref`` beside keywords of its own, ``if``, ``dependentSchemas``, dynamic refs:
    closing one part refuses names another allows) and schemas read in the negative or
    counted (``not``, ``oneOf``, ``contains``: a narrower branch there can let through
    a value the schema as written refuses). Counts are made integers in the same walk.
    """
    rewritten: dict[str, Any] = _rewrite(schema, close=not _unclosable(schema))
    return rewritten


_OPENING = frozenset(("additionalProperties", "patternProperties", "unevaluatedProperties"))
_UNCLOSABLE = frozenset(("allOf", "if", "dependentSchemas", "$dynamicRef", "$recursiveRef",
                         "unevaluatedProperties", "not", "oneOf", "contains"))


def _unclosable(schema: Any) -> bool:
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if _UNCLOSABLE & node.keys() or ("$ref" in node and _SIBLINGS & node.keys()):
                return True
            for k, v in node.items():
                if k in _SCHEMA_MAPS and isinstance(v, dict):
                    stack.extend(v.values())  # (its keys are names, not keywords)
                elif k not in _VALUES:
                    stack.append(v)
    return False


_SIBLINGS = frozenset(("properties", "required", "type", "items", "prefixItems",
                       "anyOf", "oneOf"))
"""Keywords beside a ``$ref`` that make it an intersection (annotations do not)."""


def lark(text: str, where: str = "grammar") -> str:
    """The llguidance grammar for Lark text (llguidance's dialect: ``%json {...}``
    embeds a schema, ``[lazy]`` rules start at their trigger). Raises InvalidRequestError."""
    return check(_llg().LLMatcher.grammar_from_lark(text), where)


def gbnf(text: str, where: str = "grammar") -> str:
    """The llguidance grammar for a llama.cpp GBNF grammar (root rule ``root``), by
    llguidance's own GBNF reader. Raises InvalidRequestError saying what is wrong."""
    if len(text.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(f"{where}: the grammar is over {MAX_GRAMMAR_BYTES} bytes")
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        converted = any_to_lark(text)
    except RecursionError:
        raise InvalidRequestError(f"{where}: nested too deeply") from None
    except Exception as exc:  # noqa: BLE001 - the reader raises plain Exceptions
        raise InvalidRequestError(f"{where}: {exc}") from None
    return lark(converted, where)


def check(grammar: str, where: str) -> str:
    """``grammar`` once llguidance has compiled its rules without error; else
    InvalidRequestError with llguidance's message (which names the keyword or rule)."""
    error = _llg().LLMatcher.validate_grammar(grammar, None, limits=limits(grammar))
    if error:
        raise InvalidRequestError(f"{where}: {short(error)}")
    return grammar


def compile_messages(grammar: str) -> tuple[str | None, list[str]]:
    """Compile ``grammar``'s rules (no vocabulary): (its error or None, and llguidance's
    warnings: what a ``lenient`` schema in it had relaxed)."""
    failed, messages = _llg().LLMatcher.validate_grammar_with_warnings(
        grammar, None, limits=limits(grammar))
    if failed:
        return short(messages[0] if messages else "the grammar does not compile"), []
    return None, [str(m) for m in messages]


def short(message: str, limit: int = 600) -> str:
    """llguidance's message on one line, without its "<non-verbose/>" mark, cut short."""
    message = " ".join(message.replace("<non-verbose/>", "").split())
    return message if len(message) <= limit else message[: limit - 1] + "…"


def _parse(schema: str | dict[str, Any] | bool, where: str) -> dict[str, Any] | bool:
    if not isinstance(schema, str):
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError(f"{where} must be {_SCHEMA_SHAPE}")
        return schema
    try:
        parsed: dict[str, Any] | bool = parse_json(where, schema, dict | bool, _SCHEMA_SHAPE)
    except ProtocolError as exc:
        raise InvalidRequestError(exc.message) from None
    return parsed


_SCHEMA_SHAPE = "a JSON Schema: an object or a boolean"


_COUNTS = frozenset(("minItems", "maxItems", "minLength", "maxLength", "minProperties",
                     "maxProperties", "minContains", "maxContains"))


def _rewrite(schema: Any, close: bool) -> Any:
    """``schema`` with counts written as integral numbers (``2.0``, which JSON Schema
    reads as the integer 2) written as integers, as llguidance expects them, and with
    ``close``, objects closed (``closed_objects``)."""
    if isinstance(schema, list):
        return [_rewrite(v, close) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _COUNTS and isinstance(v, float) and v.is_integer():
            out[k] = int(v)
        elif k in _VALUES:
            out[k] = v
        elif k in _SCHEMA_MAPS and isinstance(v, dict):  # names, then schemas
            out[k] = {name: _rewrite(sub, close) for name, sub in v.items()}
        else:
            out[k] = _rewrite(v, close)
    if close and isinstance(schema.get("properties"), dict) and not _OPENING & schema.keys():
        out["additionalProperties"] = False
    return out




def count_nodes(schema: object, where: str, limit: int = MAX_SCHEMA_NODES) -> int:
    """How many objects, list items and properties ``schema`` holds; InvalidRequestError
    past ``limit`` (compiling costs time in proportion)."""
    n = 0
    for _ in _nodes(schema):
        n += 1
        if n > limit:
            raise InvalidRequestError(
                f"{where}: the schema is too large to compile within a second (over "
                f"{limit:,} schemas, properties and enum values)")
    return n


def _nodes(value: object) -> Iterator[None]:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            yield None
            stack.extend(node.values())
        elif isinstance(node, list):
            for item in node:
                yield None
                stack.append(item)
