"""Editing the user's models.toml: an entry added (`models add`), an entry removed
(`rm`), each checked by the registry's own parser before the file is replaced."""

from __future__ import annotations

import contextlib
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

from .. import paths, statefile
from ..errors import ConfigError
from .registry import SHIPPED_MODELS, _parse, _parse_entry, parse_file


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # (TOML's float forms, inf and nan included)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(str(value), ensure_ascii=False)  # a TOML basic string


def add_user_entry(name: str, fields: dict[str, object]) -> Path:
    """Append ``[models."name"]`` to the user's models.toml; returns that file.

    Raises ConfigError if the name is already there or the result would not parse.
    """
    target = paths.user_models_file()
    with _editing(target):
        _add(target, name, fields)
    return target


@contextlib.contextmanager
def _editing(target: Path) -> Iterator[None]:
    """``target``'s lock held for a read-modify-write; a file-system error becomes a
    ConfigError saying nothing was changed (the old file stays whole)."""
    try:
        with statefile.locked(target):
            yield
    except OSError as exc:
        raise ConfigError(f"cannot write {target}: {exc.strerror or exc}; nothing was "
                          "changed") from None


def _add(target: Path, name: str, fields: dict[str, object]) -> None:
    existing = target.read_text(encoding="utf-8") if target.exists() else ""
    if existing:
        entries, _ = parse_file(target)
        if name in entries:
            raise ConfigError(f"{target}: model '{name}' is already defined")
    block = f"\n[models.{json.dumps(name, ensure_ascii=False)}]\n" + "".join(
        f"{key} = {_toml_value(value)}\n" for key, value in fields.items() if value is not None
    )
    text = existing + block
    _parse_entry(name, tomllib.loads(text)["models"][name], target)  # validate before writing
    statefile.replace(target, text)


def remove_user_entry(name: str) -> Path:
    """Remove ``[models.name]`` from the user's models.toml; returns that file. Raises
    ConfigError when the user's file does not define it (a shipped entry, or none)."""
    target = paths.user_models_file()
    with _editing(target):
        _remove(target, name)
    return target


def _remove(target: Path, name: str) -> None:
    text = target.read_text(encoding="utf-8") if target.exists() else ""
    entries = parse_file(target)[0] if text else {}
    if name not in entries:
        shipped = name in _parse(SHIPPED_MODELS).models
        raise ConfigError(f"model '{name}' is shipped with everycycle, not in {target}: it "
                          "cannot be removed (an entry of yours with its name overrides it)"
                          if shipped else f"{target} has no model '{name}'")
    lines = text.splitlines(keepends=True)
    header = re.compile(r"^\s*\[\s*models\s*\.\s*(.+?)\s*\]\s*(#.*)?$")
    kept: list[str] = []
    dropping = False
    for line in lines:
        m = header.match(line)
        if m is not None or line.lstrip().startswith("["):
            key = m.group(1) if m is not None else None
            if key is not None and key.startswith('"'):
                key = json.loads(key)
            dropping = key == name
        if not dropping:
            kept.append(line)
    result = "".join(kept)
    if name in tomllib.loads(result).get("models", {}):  # (a form we did not recognise)
        raise ConfigError(f"{target}: could not remove model '{name}'; edit the file by hand")
    statefile.replace(target, result)
