"""A minimal reader for a GGUF file's header: its metadata and where its tensors lie
(no tensor data, no llama.cpp).

Used to size a model's KV cache and each layer's weights before deciding where to
load it.
"""

from __future__ import annotations

import re
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


def _skip_metadata(f: BinaryIO, n_kv: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _string(f)
        out[key] = _value(f, _read(f, "I"), False)
    return out


_SPLIT = re.compile(r"(?P<stem>.+)-00001-of-(?P<n>\d{5})\.gguf")


def split_parts(first: Path) -> list[Path]:
    """The parts of a split GGUF (``name-00001-of-00003.gguf`` and the rest, beside it),
    or just ``first`` when it is not the first part of one."""
    split = _SPLIT.fullmatch(first.name)
    if split is None:
        return [first]
    n = split["n"]
    return [first.with_name(f"{split['stem']}-{i:05d}-of-{n}.gguf")
            for i in range(1, int(n) + 1)]


def model_bytes(first: Path) -> tuple[int, list[int], int]:
    """A model's file size, each repeating layer's bytes and the other tensors' bytes,
    over every part of a split GGUF."""
    size, other = 0, 0
    layers: list[int] = []
    for part in split_parts(first):
        part_layers, part_other = layer_bytes(part)
        size += part.stat().st_size
        layers += [0] * (len(part_layers) - len(layers))
        for i, n in enumerate(part_layers):
            layers[i] += n
        other += part_other
    return size, layers, other


def layer_bytes(path: Path) -> tuple[list[int], int]:
    """Bytes of each repeating layer's tensors (``blk.N.*``), and of all the others
    (token embeddings, output norm and head), read from the tensors' offsets.

    Raises InvalidRequestError for a file that is not a readable GGUF.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("not a GGUF file (bad magic)")
            if _read(f, "I") < 2:
                raise ValueError("unsupported GGUF version")
            n_tensors, n_kv = _read(f, "Q"), _read(f, "Q")
            if n_kv > _MAX_KV or n_tensors > _MAX_KV:
                raise ValueError("implausible header counts")
            meta = _skip_metadata(f, n_kv)
            infos: list[tuple[int, str]] = []
            for _ in range(n_tensors):
                name = _string(f)
                n_dims = _read(f, "I")
                if n_dims > 8:
                    raise ValueError("implausible tensor rank")
                f.seek(8 * n_dims + 4, 1)  # dims, type
                infos.append((_read(f, "Q"), name))
            align = meta.get("general.alignment")
            align = align if isinstance(align, int) and align > 0 else 32
            start = (f.tell() + align - 1) // align * align
    except (OSError, ValueError, struct.error) as exc:
        raise InvalidRequestError(f"{path}: cannot read GGUF tensors: {exc}") from None
    infos.sort()
    layers: dict[int, int] = {}
    other = 0
    for i, (offset, name) in enumerate(infos):
        end = infos[i + 1][0] if i + 1 < len(infos) else size - start
        nbytes = max(0, end - offset)
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 1 and parts[1].isdigit():
            layers[int(parts[1])] = layers.get(int(parts[1]), 0) + nbytes
        else:
            other += nbytes
    n_layer = max(layers) + 1 if layers else 0
    return [layers.get(i, 0) for i in range(n_layer)], other


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
