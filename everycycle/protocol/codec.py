"""The one codec: messages to wire lines and back, as serde_json does for the seed's
Rust types (externally tagged enums, ``Option`` as value-or-null, newtypes as their
inner value, compact separators, UTF-8).

Encoders and decoders are compiled once per message type from its type hints, so a
line costs a walk over its fields and nothing more. The decoder follows serde's
rules: unknown fields are ignored; a missing required field is an error; an
``Option`` field may be absent or ``null``; a duplicate field, a bool where a number
is wanted, NaN/Infinity, lone surrogates, or a top-level object with other than one
key are errors. Every error is a ProtocolError (kind Invalid) that names the field's
path (``Generate.messages[2].role: …``) and carries the request id when one could be
read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import json.scanner
import math
import types
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin, get_type_hints

from ..errors import LineTooLongError, ProtocolError
from .events import EVENTS, ServerEvent, TokenChunk, Tokens
from .framing import MAX_LINE_BYTES
from .requests import REQUESTS, Request
from .validation import REQUEST_ID

__all__ = ["decode_event", "decode_request", "encode"]

_string: Callable[[str], str] = json.encoder.encode_basestring
"""How json writes a str with ensure_ascii off (in C where built)."""

_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    return hints


def _optional_inner(tp: Any) -> Any | None:
    """X for ``X | None``; None for any other type."""
    if get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
        (inner,) = (a for a in get_args(tp) if a is not type(None))
        return inner
    return None


def _text_or_list(tp: Any) -> Any | None:
    """X for ``str | tuple[X, ...]`` (serde's untagged enum of a string and a list:
    a message's content); None for any other type."""
    if get_origin(tp) in (Union, types.UnionType):
        args = get_args(tp)
        if len(args) == 2 and args[0] is str and get_origin(args[1]) is tuple:
            return args[1]
    return None


# --------------------------------------------------------------------------- encoding

_Encoder = Callable[[Any], str]


def _number(value: Any) -> str:
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is float:
        if not math.isfinite(value):
            raise ValueError(f"Out of range float values are not JSON compliant: {value!r}")
        return float.__repr__(value)
    return int.__repr__(value)


def _boolean(value: Any) -> str:
    return "true" if value else "false"


def _compile_encoder(tp: Any) -> _Encoder:
    inner = _optional_inner(tp)
    if inner is not None:
        enc = _compile_encoder(inner)
        return lambda v: "null" if v is None else enc(v)
    listed = _text_or_list(tp)
    if listed is not None:
        items = _compile_encoder(listed)
        return lambda v: _string(v) if type(v) is str else items(v)
    if tp is str:
        return _string
    if tp is bool:
        return _boolean
    if tp is int or tp is float:
        return _number
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda v: _string(v.value)
    if get_origin(tp) is tuple:
        (elem,) = (a for a in get_args(tp) if a is not Ellipsis)
        if elem is int:
            return lambda v: "[" + ",".join(map(int.__repr__, v)) + "]"
        each = _compile_encoder(elem)
        return lambda v: "[" + ",".join(map(each, v)) + "]"
    if dataclasses.is_dataclass(tp):
        return _struct_encoder(tp)  # type: ignore[arg-type]
    raise TypeError(f"no encoder for {tp!r}")  # pragma: no cover - a bug in this module


def _struct_encoder(cls: type[Any]) -> _Encoder:
    """An encoder for dataclass ``cls``, written out as Python source (as dataclasses
    writes ``__init__``): one concatenation, no loop over the fields at encoding time."""
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    if getattr(cls, "newtype", False):
        inner = _compile_encoder(hints[fields[0].name])
        name = fields[0].name
        return lambda v: inner(getattr(v, name))
    scope: dict[str, Any] = {}
    lines = ["def encode(obj):", "    parts = []"]
    for i, f in enumerate(fields):
        scope[f"e{i}"] = _compile_encoder(hints[f.name])
        if f.metadata.get("skip_none"):
            lines += [f"    if obj.{f.name} is not None:",
                      f"        parts.append('\"{f.name}\":' + e{i}(obj.{f.name}))"]
        else:
            lines.append(f"    parts.append('\"{f.name}\":' + e{i}(obj.{f.name}))")
    lines.append("    return '{' + ','.join(parts) + '}'")
    if not any(f.metadata.get("skip_none") for f in fields):  # one expression
        terms = " + ".join(f"'{',' if i else ''}\"{f.name}\":' + e{i}(obj.{f.name})"
                           for i, f in enumerate(fields))
        lines = ["def encode(obj):", f"    return '{{' + {terms or repr('')} + '}}'"]
    exec("\n".join(lines), scope)  # noqa: S102 - source built from field names only
    encoder: _Encoder = scope["encode"]
    return encoder


_ENCODERS: dict[type[Any], Callable[[Any], bytes]] = {}


def _line_encoder(cls: type[Any]) -> Callable[[Any], bytes]:
    body = _struct_encoder(cls)
    head = f'{{"{cls.__name__}":'
    return lambda obj: (head + body(obj) + "}\n").encode()


def encode(message: ServerEvent | Request) -> bytes:
    """One wire line (with its trailing newline) for ``message``."""
    cls = type(message)
    enc = _ENCODERS.get(cls)
    if enc is None:
        enc = _ENCODERS[cls] = _line_encoder(cls)
    return enc(message)


# --------------------------------------------------------------------------- decoding


class _Bad(Exception):
    """A value that does not fit; ``path`` collects the field names on the way out."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.path: list[str] = []


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


_Decoder = Callable[[Any], Any]


def _string_decoder(value: Any) -> str:
    if type(value) is not str:
        raise _Bad(f"expected a string, got {_describe(value)}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _Bad("string is not valid Unicode") from None
    return value


def _bool_decoder(value: Any) -> bool:
    if type(value) is not bool:
        raise _Bad(f"expected a boolean, got {_describe(value)}")
    return value


def _int_decoder(value: Any) -> int:
    if type(value) is not int:
        raise _Bad(f"expected an integer, got {_describe(value)}")
    return value


def _float_decoder(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is not int:
        raise _Bad(f"expected a number, got {_describe(value)}")
    try:
        return float(value)
    except OverflowError:
        raise _Bad("number out of range") from None


_SCALARS: dict[Any, _Decoder] = {str: _string_decoder, bool: _bool_decoder,
                                 int: _int_decoder, float: _float_decoder}


def _compile_decoder(tp: Any) -> _Decoder:
    inner = _optional_inner(tp)
    if inner is not None:
        dec = _compile_decoder(inner)
        return lambda v: None if v is None else dec(v)
    listed = _text_or_list(tp)
    if listed is not None:
        items = _compile_decoder(listed)

        def text_or_list(value: Any) -> Any:
            if type(value) is str:
                return _string_decoder(value)
            if type(value) is list:
                return items(value)
            raise _Bad(f"expected a string or an array of parts, got {_describe(value)}")

        return text_or_list
    if tp in _SCALARS:
        return _SCALARS[tp]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_decoder(tp)
    if get_origin(tp) is tuple:
        (elem,) = (a for a in get_args(tp) if a is not Ellipsis)
        return _array_decoder(elem)
    if dataclasses.is_dataclass(tp):
        return _struct_decoder(tp)  # type: ignore[arg-type]
    raise TypeError(f"no decoder for {tp!r}")  # pragma: no cover - a bug in this module


def _enum_decoder(tp: type[enum.Enum]) -> _Decoder:
    members = {m.value: m for m in tp}
    allowed = ", ".join(f"`{m.value}`" for m in tp)

    def variant(value: Any) -> Any:
        if type(value) is not str:
            raise _Bad(f"expected a string, got {_describe(value)}")
        member = members.get(value)
        if member is None:
            raise _Bad(f"unknown variant `{value}`, expected one of {allowed}")
        return member

    return variant


def _array_decoder(elem: Any) -> _Decoder:
    each = _compile_decoder(elem)
    plain = elem if elem in (int, str) else None

    def array(value: Any) -> tuple[Any, ...]:
        if type(value) is not list:
            raise _Bad(f"expected an array, got {_describe(value)}")
        if plain is not None and all(type(v) is plain for v in value) and (
                plain is int or all(v.isascii() for v in value)):
            return tuple(value)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(each(v))
            except _Bad as bad:
                bad.path.append(f"[{i}]")
                raise
        return tuple(out)

    return array


def _struct_decoder(cls: type[Any]) -> _Decoder:
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    if getattr(cls, "newtype", False):
        inner = _compile_decoder(hints[fields[0].name])
        return lambda v: cls(inner(v))
    # (name, decoder, absent): what an absent field means — a missing field (required),
    # nothing (it has a default), or None (an Option without one).
    required = object()
    plan = []
    for f in fields:
        tp = hints[f.name]
        absent = (None if f.default is not dataclasses.MISSING
                  else (None,) if type(None) in get_args(tp) else required)
        plan.append((f.name, _compile_decoder(tp), absent))

    def struct(value: Any) -> Any:
        if type(value) is not dict:
            raise _Bad(f"expected an object, got {_describe(value)}")
        kwargs: dict[str, Any] = {}
        for name, dec, absent in plan:
            if name in value:
                try:
                    kwargs[name] = dec(value[name])
                except _Bad as bad:
                    bad.path.append(f".{name}")
                    raise
            elif absent is required:
                raise _Bad(f"missing field `{name}`")
            elif absent is not None:
                kwargs[name] = None
        return cls(**kwargs)

    return struct


def _reject_constant(name: str) -> Any:
    raise ProtocolError(f"invalid number {name}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ProtocolError(f"duplicate field `{key}`")
            seen.add(key)
    return out


_JSON = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)

_EVENT_DECODERS = {tag: _struct_decoder(cls) for tag, cls in EVENTS.items()}
_REQUEST_DECODERS = {tag: _struct_decoder(cls) for tag, cls in REQUESTS.items()}


def _peek_request_id(body: Any) -> str:
    if isinstance(body, dict) and len(body) == 1:
        (inner,) = body.values()
        if isinstance(inner, dict):
            rid = inner.get("request_id")
            if isinstance(rid, str) and REQUEST_ID.fullmatch(rid):
                return rid
    return ""


def _decode(line: bytes | str, variants: dict[str, _Decoder]) -> Any:
    if isinstance(line, bytes | bytearray):
        if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:
            raise LineTooLongError(f"line longer than {MAX_LINE_BYTES} bytes")
        try:
            text = bytes(line).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("line is not valid UTF-8") from None
    else:
        text = line
    try:
        body = _JSON.decode(text)
    except ProtocolError:
        raise
    except RecursionError:
        raise ProtocolError("JSON nested too deeply") from None
    except ValueError as exc:
        raise ProtocolError(f"not JSON: {exc}") from None
    rid = _peek_request_id(body)
    try:
        if not isinstance(body, dict) or len(body) != 1:
            raise ProtocolError("expected an object with exactly one key naming the variant")
        ((tag, payload),) = body.items()
        decoder = variants.get(tag)
        if decoder is None:
            allowed = ", ".join(f"`{n}`" for n in variants)
            raise ProtocolError(f"unknown variant `{tag}`, expected one of {allowed}")
        try:
            return decoder(payload)
        except _Bad as bad:
            raise ProtocolError(f"{tag}{''.join(reversed(bad.path))}: {bad.message}") from None
    except ProtocolError as exc:
        raise ProtocolError(exc.message, request_id=rid) from None
    except RecursionError:
        raise ProtocolError("JSON nested too deeply", request_id=rid) from None


def decode_request(line: bytes | str) -> Request:
    """Decode one client line. Raises ProtocolError (with ``request_id`` if readable)."""
    result: Request = _decode(line, _REQUEST_DECODERS)
    return result


def decode_event(line: bytes | str) -> ServerEvent:
    """Decode one daemon line. Raises ProtocolError."""
    if type(line) is bytes and line.startswith(_TOKENS_HEAD) and len(line) <= MAX_LINE_BYTES:
        tokens = _plain_tokens(line)
        if tokens is not None:
            return tokens
    result: ServerEvent = _decode(line, _EVENT_DECODERS)
    return result


_TOKENS_HEAD = b'{"Tokens":{"request_id":'


def _plain_tokens(line: bytes) -> Tokens | None:
    """The per-token line (a Tokens event of text and ids only), decoded the short way
    when it is exactly what ``encode`` writes for the event it decodes to; None sends
    it the general way, which also says what is wrong with it. The round trip is what
    makes it as strict: a duplicate field, an escape written another way or anything
    else not canonical re-encodes to other bytes (a client sees this event a few
    thousand times a second; the general way's checks are most of its decoding)."""
    try:
        body, _ = _scan(line.decode(), 0)
        payload = body["Tokens"]
        chunk = payload["chunk"]
        event = Tokens(payload["request_id"], TokenChunk(chunk["text"], tuple(chunk["ids"])),
                       payload["finished"])
        return event if encode(event) == line.rstrip(b"\n") + b"\n" else None
    except Exception:  # noqa: BLE001 - anything odd: the general way says what
        return None


_scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(
    json.JSONDecoder())  # type: ignore[arg-type]  # (typeshed has the class as its own argument)
"""The C scanner alone (json.loads' detection of a bytes line's encoding is Python)."""
