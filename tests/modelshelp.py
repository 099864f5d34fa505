"""A models.toml as a user writes one, from typed entries: every test that needs models
writes its file through ``models_toml`` (one place that knows the format), not by
pasting TOML tables into strings."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

Value = (str | int | float | bool | Path | list[str] | list[int] | list[float]
         | Mapping[str, int] | Mapping[str, str] | list[Mapping[str, object]])


@dataclass(frozen=True)
class Entry:
    """One ``[models.NAME]`` table."""

    name: str
    path: Path | str
    context: int | None = None
    parallel: int | None = None
    more: Mapping[str, Value] = field(default_factory=dict)
    """Any other key of the entry (``executor``, ``speculative``, ``keep_alive``, …)."""

    def table(self) -> str:
        values: dict[str, Value | None] = {"path": self.path, "context": self.context,
                                           "parallel": self.parallel, **self.more}
        lines = [f"[models.{_key(self.name)}]"]
        lines += [f"{_key(k)} = {_value(v)}" for k, v in values.items() if v is not None]
        return "\n".join(lines) + "\n"


def _key(name: str) -> str:
    bare = name.replace("-", "").replace("_", "").isalnum()
    return name if bare else json.dumps(name)


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, Mapping):  # (an inline table)
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(str(v))  # (a TOML basic string: JSON's escapes are TOML's)


def models_toml(path: Path, *entries: Entry, default: str | None = None,
                top: Mapping[str, Value] | None = None) -> Path:
    """Write ``entries`` (``default`` first, then top-level keys such as ``rpc``) to
    ``path``; returns it."""
    head = [f"default = {_value(default)}\n"] if default is not None else []
    head += [f"{_key(k)} = {_value(v)}\n" for k, v in (top or {}).items()]
    path.write_text("".join(head) + "".join(e.table() for e in entries))
    return path
