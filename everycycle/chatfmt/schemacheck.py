"""What the constraint engine cannot enforce in a JSON Schema: where it stands, the
sentence that refuses it, and the check of a value against the whole schema afterwards.

llguidance implements most of JSON Schema; what it does not (``propertyNames``, ``not``,
``uniqueItems``, ``if``/``then``/``else``, ``contains``, ``dependentSchemas``, an unknown
``format``, a ``oneOf`` whose branches it cannot prove disjoint) it refuses, or, compiled
``lenient``, relaxes where it stands (``oneOf`` read as ``anyOf``) and says so by keyword.
Neither names the place: ``places`` finds it by our own walk of the schema, so that a
refusal (``response_format``, a ``strict`` tool) names the keyword and its JSON pointer,
and a tool whose schema was relaxed has its calls checked against the whole schema
(``ArgumentCheck``, by ``jsonschema``) once the model has written them.

Pure: no llama.cpp, no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[([^\]]*)\]')
_FORMAT = re.compile(r"Unknown format: (\S+)")
_ONE_OF = ("oneOf constraints are not supported", "oneOf not fully supported")

SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions",
                         "dependentSchemas"))
"""Keywords whose value maps names (never keywords) to schemas."""
VALUES = frozenset(("const", "enum", "default", "examples"))
"""Keywords whose value is data, not a schema."""


@dataclass(frozen=True, slots=True)
class Relaxed:
    """One keyword the constraint engine does not enforce, and where (a JSON pointer
    into the schema, ``#`` for its root)."""

    pointer: str
    keyword: str
    reason: str = ""
    """Why, where the keyword alone does not say (a subschema that does not compile)."""

    def __str__(self) -> str:
        what = f"`{self.keyword}`" if self.keyword else "the subschema"
        return f"{what} at {self.pointer}" + (f" ({self.reason})" if self.reason else "")


def keywords(messages: Iterable[str]) -> set[str]:
    """The keywords llguidance's messages (an error, or ``lenient``'s warnings) say it
    does not enforce; an unknown format as ``format:NAME``."""
    found: set[str] = set()
    for message in messages:
        for listed in _UNIMPLEMENTED.findall(message):
            found.update(k for k in json.loads(f"[{listed}]") if isinstance(k, str))
        found.update(f"format:{name}" for name in _FORMAT.findall(message))
        if any(m in message for m in _ONE_OF):
            found.add("oneOf")
    return found


def places(schema: object, wanted: set[str]) -> list[Relaxed]:
    """Where in ``schema`` the ``wanted`` keywords (as ``keywords`` names them) stand,
    in document order. Property names, ``$defs`` names and data (``enum``, ``const``,
    ``default``, ``examples``) are never taken for keywords."""
    return [Relaxed(pointer, keyword) for pointer, keyword in _walk(schema, "#", wanted)]


def _walk(node: object, pointer: str, wanted: set[str]) -> Iterator[tuple[str, str]]:
    stack: list[tuple[object, str]] = [(node, pointer)]
    while stack:
        node, pointer = stack.pop()
        if isinstance(node, list):
            stack.extend((v, f"{pointer}/{i}") for i, v in reversed(list(enumerate(node))))
            continue
        if not isinstance(node, dict):
            continue
        for k, v in node.items():
            if k in wanted or (k == "format" and f"format:{v}" in wanted):
                yield pointer, k if k != "format" else f"format: {v}"
        children: list[tuple[object, str]] = []
        for k, v in node.items():
            here = f"{pointer}/{_escape(k)}"
            if k in VALUES:
                continue
            if k in SCHEMA_MAPS and isinstance(v, dict):
                children.extend((sub, f"{here}/{_escape(name)}") for name, sub in v.items())
            elif isinstance(v, dict | list):
                children.append((v, here))
        stack.extend(reversed(children))


def _escape(token: str) -> str:
    """A JSON pointer's reference token (RFC 6901)."""
    return str(token).replace("~", "~0").replace("/", "~1")


def pointer(path: Iterable[object]) -> str:
    """The JSON pointer (as a URI fragment: ``#/properties/a``) of a path of keys."""
    return "#" + "".join(f"/{_escape(str(p))}" for p in path)


def refusal(where: str, schema: object, message: str, hint: str = "") -> str | None:
    """The one sentence that refuses ``schema`` for what the constraint engine's
    ``message`` says it does not implement, naming the keyword and its place; None when
    the message is about something else (a bad ``$ref``, a wrong type)."""
    named = keywords([message])
    if not named:
        return None
    found = places(schema, named) or [  # (e.g. in a metaschema its `$schema` refers to)
        Relaxed("# (in a schema it refers to)", min(named))]
    first = found[0]
    if first.keyword == "oneOf":
        what = (f"a `oneOf` (at {first.pointer}) has branches the constraint engine cannot "
                "prove disjoint")
    else:
        what = f"`{first.keyword}` (at {first.pointer}) is not enforced by the constraint engine"
    return f"{where}: {what}{hint}"


class ArgumentCheck:
    """Validates tool calls' arguments against the whole schemas of the tools whose
    grammar was relaxed (``relaxed``: tool name -> its parameters' schema)."""

    def __init__(self, relaxed: Mapping[str, Mapping[str, Any]]) -> None:
        self._schemas = dict(relaxed)
        self._validators: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self._schemas)

    def problem(self, name: str, arguments: str) -> str | None:
        """Why the call of ``name`` with ``arguments`` (JSON text) breaks its tool's
        schema (the first error, with its place); None when it does not, or when the
        tool's grammar enforced its whole schema."""
        schema = self._schemas.get(name)
        if schema is None:
            return None
        try:
            value = json.loads(arguments)
        except ValueError:
            return "the arguments are not JSON"
        validator = self._validators.get(name)
        if validator is None:
            import jsonschema

            cls = jsonschema.validators.validator_for(schema, jsonschema.Draft202012Validator)
            try:
                validator = self._validators[name] = cls(schema)
            except Exception as exc:  # noqa: BLE001 - a schema jsonschema cannot build
                return f"its schema could not be checked: {exc}"
        try:
            error = next(iter(validator.iter_errors(value)), None)
        except Exception as exc:  # noqa: BLE001 - e.g. a $ref jsonschema cannot resolve
            return f"its schema could not be checked: {type(exc).__name__}"
        if error is None:
            return None
        at = pointer(error.absolute_path)
        return f"{error.message[:200]} (at {at}, by `{error.validator}`)"
