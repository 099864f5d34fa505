"""A minimal reader for a GGUF file's metadata header (no tensors, no llama.cpp).

Used to size a model's KV cache before deciding where to load it.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import InvalidRequestError

# GGUF value types -> struct format for the scalar ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_KV = 1 << 20


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated")
    return struct.unpack("<" + fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "Q")
    if n > 1 << 26:
        raise ValueError("string too long")
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated")
    return data.decode("utf-8", "replace")


def _value(f: BinaryIO, vtype: int, keep: bool) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, n = _read(f, "I"), _read(f, "Q")
        if etype in _SCALARS and not keep:
            f.seek(struct.calcsize(_SCALARS[etype]) * n, 1)
            return None
        items = [_value(f, etype, keep) for _ in range(n)]
        return items if keep else None
    raise ValueError(f"unknown value type {vtype}")


def read_metadata(path: Path, wanted: tuple[str, ...] = (),
                  wanted_suffixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF (arrays skipped unless their key is in
    ``wanted`` or ends with one of ``wanted_suffixes``).

    Raises InvalidRequestError for a file that is not a readable GGUF.
    """
    try:
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("not a GGUF file (bad magic)")
            version = _read(f, "I")
            if version < 2:
                raise ValueError(f"unsupported GGUF version {version}")
            _read(f, "Q")  # tensor count
            n_kv = _read(f, "Q")
            if n_kv > _MAX_KV:
                raise ValueError("implausible metadata count")
            out: dict[str, Any] = {}
            for _ in range(n_kv):
                key = _string(f)
                vtype = _read(f, "I")
                keep = key in wanted or (bool(wanted_suffixes) and key.endswith(wanted_suffixes))
                value = _value(f, vtype, keep)
                if value is not None:
                    out[key] = value
            return out
    except (OSError, ValueError, struct.error) as exc:
        raise InvalidRequestError(f"{path}: cannot read GGUF metadata: {exc}") from None
