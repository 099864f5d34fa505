"""Structured output: a JSON Schema becomes a GBNF grammar for llama.cpp's grammar sampler.

The conversion is llama-cpp-python's port of llama.cpp's own json-schema-to-grammar
converter (``llama_cpp.llama_grammar``), not a new one; the grammar it writes is then
compiled by llama.cpp like any other (``Runner.check_grammar``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import InvalidRequestError

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""What OpenAI's ``response_format: {"type": "json_object"}`` asks for."""


def schema_to_gbnf(schema: str) -> str:
    """The GBNF grammar for the JSON Schema ``schema`` (JSON text).

    Raises InvalidRequestError naming what the converter could not handle.
    """
    json_schema_to_gbnf = _converter()
    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise InvalidRequestError(f"json_schema is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError("json_schema must be a JSON object")
    _refuse_unenforced(parsed, "json_schema")
    _refuse_huge_counts(parsed, "json_schema")
    try:
        grammar: str = json_schema_to_gbnf(json.dumps(parsed))
    except (AssertionError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            RecursionError, NotImplementedError) as exc:
        # The converter reports what it cannot handle with assertions, mostly.
        raise InvalidRequestError(f"json_schema: {exc}") from None
    grammar = _CHAR_RULE.sub(lambda _: _JSON_CHAR, grammar)
    check_size(grammar, "json_schema")
    return grammar


MAX_GRAMMAR_BYTES = 256 * 1024
"""The longest GBNF text a request may carry (or a schema become)."""
MAX_EXPANDED = 100_000
"""How many elements a grammar may hold once llama.cpp has expanded its repetitions
(``x{m,n}`` becomes up to n copies of x, nested counts multiply): a 100-byte schema with
``"minItems": 10000000`` would take over a gigabyte."""
COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties",
           "maxProperties", "minContains", "maxContains")


def _refuse_huge_counts(schema: object, where: str) -> None:
    """Refuse item and length counts past what a grammar can expand to, naming them."""
    for node, at in _walk(schema, where):
        for key in COUNTS:
            value = node.get(key)
            if isinstance(value, int | float) and value > MAX_EXPANDED:
                raise InvalidRequestError(
                    f"{at}.{key} is {value:g}: a grammar expands counts over "
                    f"{MAX_EXPANDED:,} past any bound (llama.cpp repeats the rule that "
                    "many times)")
        pattern = node.get("pattern")
        if isinstance(pattern, str) and _pattern_size(pattern) > MAX_EXPANDED:
            raise InvalidRequestError(
                f"{at}.pattern: its repetitions expand to over {MAX_EXPANDED:,} elements; "
                "use smaller counts")


_REGEX_TOKEN = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|\{\s*(\d+)\s*(?:(,)\s*(\d*)\s*)?\}|.",
                          re.DOTALL)


def _pattern_size(pattern: str) -> int:
    """``expanded_size`` for a regular expression (the converter expands its counts)."""
    return _expand(_REGEX_TOKEN.finditer(pattern), skip=("|", "*", "+", "?", "^", "$"))


_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|\{\s*(\d+)\s*'
                    r'(?:(,)\s*(\d*)\s*)?\}|[()]|[^\s()\[\]"{}#|*+?]+|.', re.DOTALL)


def expanded_size(gbnf: str) -> int:
    """About how many elements llama.cpp's parser makes of ``gbnf``: each literal, class
    or rule reference counts 1, a group its contents, ``{m,n}`` repeats what precedes it
    max(m, n) times (an open ``{m,}`` m + 1 times), nested counts multiply."""
    return _expand(_TOKEN.finditer(gbnf), skip=("|", "*", "+", "?"))


def _expand(tokens: Iterator[re.Match[str]], skip: tuple[str, ...]) -> int:
    stack = [0]
    last = 1
    for m in tokens:
        text = m.group(0)
        if text.startswith("#") or text.isspace() or text in skip:
            continue
        if text == "(":
            stack.append(0)
        elif text == ")":
            last = max(stack.pop() if len(stack) > 1 else 0, 1)
            stack[-1] += last
        elif m.group(1) is not None:
            low = int(m.group(1))
            high = int(m.group(3)) if m.group(3) else (low + 1 if m.group(2) else low)
            stack[-1] += last * (max(low, high) - 1)
        else:
            last = 1
            stack[-1] += 1
        if stack[-1] > MAX_EXPANDED * 10:
            break  # (far past the limit already)
    return sum(stack)


def check_size(gbnf: str, what: str = "grammar") -> None:
    """Refuse a grammar too long, or whose repetitions expand too far. Raises
    InvalidRequestError naming the limit."""
    if len(gbnf.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise InvalidRequestError(f"{what}: the grammar is over {MAX_GRAMMAR_BYTES} bytes")
    size = expanded_size(gbnf)
    if size > MAX_EXPANDED:
        raise InvalidRequestError(
            f"{what}: its repetitions expand to over {MAX_EXPANDED:,} elements "
            f"(about {size:,}); use smaller counts")


@functools.cache
def _converter() -> Callable[[str], str]:
    """llama-cpp-python's ``json_schema_to_gbnf``. Its module stands alone, so the
    daemon loads it by itself rather than through ``llama_cpp`` (which would bring the
    bindings and numpy, ~20 MB, into a process that never loads a model)."""
    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is not None and spec.submodule_search_locations:
            path = Path(next(iter(spec.submodule_search_locations))) / "llama_grammar.py"
            found = importlib.util.spec_from_file_location("everycycle._llama_grammar", path)
            if found is not None and found.loader is not None:
                module = importlib.util.module_from_spec(found)
                found.loader.exec_module(module)
                convert: Callable[[str], str] = module.json_schema_to_gbnf
                return convert
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    return json_schema_to_gbnf


# The Python converter's string characters admit raw control characters, which JSON
# does not; llama.cpp's own converter (common/json-schema-to-grammar.cpp) excludes them.
_CHAR_RULE = re.compile(r"^char ::= .*$", re.MULTILINE)
_JSON_CHAR = (r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | '
              r'"u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])')
_UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
"""Keywords whose value maps names to schemas: its keys are names, not keywords."""


def _walk(schema: object, where: str) -> Iterator[tuple[dict[str, object], str]]:
    """Every schema object in ``schema``, with where it is (``json_schema.properties.a``);
    a map of names to schemas (``properties``) is not itself one."""
    if isinstance(schema, dict):
        yield schema, where
        for key, value in schema.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _walk(sub, f"{where}.{key}.{name}")
            else:
                yield from _walk(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            yield from _walk(value, f"{where}[{i}]")


def _refuse_unenforced(schema: object, where: str) -> None:
    """Refuse numeric bounds: the converter drops them, and output would not validate."""
    for node, at in _walk(schema, where):
        for key in _UNENFORCED:
            if key in node:
                raise InvalidRequestError(
                    f"{at}.{key}: numeric bounds cannot be enforced by the grammar "
                    "converter; use an enum, or check the value after generation")
