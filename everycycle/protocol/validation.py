"""What makes a message valid, written once: request ids, names, ranges, Unicode.

Every message class is declared with :func:`message`, which makes it a frozen slotted
dataclass whose constructor runs the checks all messages share — each string encodes
as UTF-8, ``request_id`` and ``target`` are RequestIds, ``model`` is a name, and the
numeric fields named in ``ranges`` lie in theirs — and then the class's own
``_validate``, if it has one. So an object that exists may go on the wire.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from types import UnionType
from typing import Any, TypeVar, dataclass_transform

from ..errors import ProtocolError

MAX_TOKENS_LIMIT = 32768
U32_MAX = 2**32 - 1
TOKEN_ID_MAX = 2**31 - 1
I64_MAX = 2**63 - 1
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
MAX_NAME = 256
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_KEEP_ALIVE_MS = 10**12
MAX_DEADLINE_MS = 7 * 24 * 3600 * 1000
MAX_MESSAGES = 4096
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_EMBED_INPUTS = 2048
MAX_TOOL_CALLS = 128
MAX_PARTS = 64
MAX_IMAGE_BYTES = 4 << 20
"""An image's file, at most (base64 on the wire: a third more)."""
MAX_IMAGES = 8
"""Images in one request, at most."""

Range = tuple[float, float]
U32: Range = (0, U32_MAX)
COUNT: Range = (0, I64_MAX)
KEEP_ALIVE: Range = (-1, MAX_KEEP_ALIVE_MS)
DEADLINE: Range = (1, MAX_DEADLINE_MS)
CONTEXT: Range = (16, 1 << 20)
"""Tokens a slot (models.toml's ``context`` takes the same)."""

T = TypeVar("T")


def validate_request_id(value: str) -> str:
    """Return ``value`` if it is a valid RequestId; raises ProtocolError otherwise."""
    if not REQUEST_ID.fullmatch(value):
        raise ProtocolError("request_id must be 1-64 characters of [A-Za-z0-9._:-]")
    return value


def check_range(name: str, value: float | None, lo: float, hi: float) -> None:
    """Raises ProtocolError unless ``value`` is None or a finite number in [lo, hi]."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{name} must be a finite number")
    if not lo <= value <= hi:
        lo_s = int(lo) if float(lo).is_integer() else lo
        hi_s = int(hi) if float(hi).is_integer() else hi
        raise ProtocolError(f"{name} must be between {lo_s} and {hi_s}")


def check_name(what: str, value: str) -> str:
    """``value`` if a request can name it (1-256 characters, no control characters)."""
    if not 1 <= len(value) <= MAX_NAME:
        raise ProtocolError(f"{what} must be 1-{MAX_NAME} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ProtocolError(f"{what} must not contain control characters")
    return value


def check_model_name(name: str) -> str:
    """``name`` if a request can name it as its model. Raises ProtocolError."""
    return check_name("model", name)


def parse_json(what: str, text: str, kind: type | UnionType, shape: str, *,
               are: bool = False) -> Any:
    """``text`` parsed as JSON, which must be a ``kind`` (``shape`` names it in the
    error, e.g. "a JSON object"; ``are``: ``what`` is plural). Raises ProtocolError."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ProtocolError(f"{what} {'are' if are else 'is'} not JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"{what}: nested too deeply") from None
    if not isinstance(value, kind):
        raise ProtocolError(f"{what} must be {shape}")
    return value


def check_text(name: str, value: object) -> None:
    """A string (or tuple of strings) field must encode as UTF-8 (no lone surrogates)."""
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if isinstance(v, str) and not v.isascii():
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ProtocolError(f"{name} is not valid Unicode") from None


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def message(*, ranges: Mapping[str, Range] | None = None, empty_id: bool = False,
            names: tuple[str, ...] = ("model",)) -> Callable[[type[T]], type[T]]:
    """Declare a message class: a frozen slotted dataclass with the shared checks.

    ``ranges`` bounds numeric fields by name; ``empty_id`` lets ``request_id`` be ""
    (an Error the daemon could not attribute); ``names`` are the fields checked as
    names (1-256 characters, no control characters).
    """
    bounds = dict(ranges or {})

    def wrap(cls: type[T]) -> type[T]:
        own: Callable[[Any], None] | None = cls.__dict__.get("_validate")
        declared = [n for n, tp in cls.__annotations__.items()
                    if not str(tp).startswith("ClassVar")]
        ids = [n for n in ("request_id", "target") if n in declared]
        named = [n for n in names if n in declared]

        def __post_init__(self: Any) -> None:
            for field_name in declared:
                check_text(field_name, getattr(self, field_name))
            for field_name in ids:
                value = getattr(self, field_name)
                if not (empty_id and value == ""):
                    validate_request_id(value)
            for field_name in named:
                value = getattr(self, field_name)
                if value is not None:
                    check_name(field_name, value)
            for field_name, (lo, hi) in bounds.items():
                check_range(field_name, getattr(self, field_name), lo, hi)
            if own is not None:
                own(self)

        cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
        return dataclasses.dataclass(frozen=True, slots=True)(cls)

    return wrap
