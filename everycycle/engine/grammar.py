"""Structured output: a JSON Schema becomes a GBNF grammar for llama.cpp's grammar sampler.

The conversion is llama-cpp-python's port of llama.cpp's own json-schema-to-grammar
converter (``llama_cpp.llama_grammar``), not a new one; the grammar it writes is then
compiled by llama.cpp like any other (``Runner.check_grammar``).
"""

from __future__ import annotations

import json
import re

from ..errors import InvalidRequestError

JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""What OpenAI's ``response_format: {"type": "json_object"}`` asks for."""


def schema_to_gbnf(schema: str) -> str:
    """The GBNF grammar for the JSON Schema ``schema`` (JSON text).

    Raises InvalidRequestError naming what the converter could not handle.
    """
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        parsed = json.loads(schema)
    except ValueError as exc:
        raise InvalidRequestError(f"json_schema is not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError("json_schema must be a JSON object")
    _refuse_unenforced(parsed, "json_schema")
    try:
        grammar: str = json_schema_to_gbnf(json.dumps(parsed))
    except (AssertionError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            RecursionError, NotImplementedError) as exc:
        # The converter reports what it cannot handle with assertions, mostly.
        raise InvalidRequestError(f"json_schema: {exc}") from None
    return _CHAR_RULE.sub(lambda _: _JSON_CHAR, grammar)


# The Python converter's string characters admit raw control characters, which JSON
# does not; llama.cpp's own converter (common/json-schema-to-grammar.cpp) excludes them.
_CHAR_RULE = re.compile(r"^char ::= .*$", re.MULTILINE)
_JSON_CHAR = (r'char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | '
              r'"u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])')
_UNENFORCED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


def _refuse_unenforced(schema: object, where: str) -> None:
    """Refuse numeric bounds: the converter drops them, and output would not validate."""
    if isinstance(schema, dict):
        for key in _UNENFORCED:
            if key in schema:
                raise InvalidRequestError(
                    f"{where}.{key}: numeric bounds cannot be enforced by the grammar "
                    "converter; use an enum, or check the value after generation")
        for key, value in schema.items():
            _refuse_unenforced(value, f"{where}.{key}")
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            _refuse_unenforced(value, f"{where}[{i}]")
