"""A model entry's LoRA adapters (``lora = [{ path = "…", scale = 1.0 }, …]``, llama-server's
``--lora`` and ``--lora-scaled``): each adapter GGUF beside the model, its default scale,
and optionally its sha256 pin."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, InvalidRequestError
from . import hub

KEYS = {"lora": list}
MAX_ADAPTERS = 64


@dataclass(frozen=True, slots=True)
class LoraEntry:
    path: Path
    scale: float = 1.0
    """Its scale for requests that name none (``POST /lora-adapters`` changes it)."""
    sha256: str | None = None


def check(entries: tuple[LoraEntry, ...]) -> None:
    """Each adapter is on disk and, where pinned, its sha256 (remembered once verified).
    Raises InvalidRequestError, or ChecksumMismatchError naming both hashes."""
    for entry in entries:
        if not entry.path.is_file():
            raise InvalidRequestError(f"LoRA adapter {entry.path}: no such file")
        if entry.sha256:
            hub.verify(entry.path, entry.sha256)


def parse(raw: Mapping[str, object], where: str, origin: Path) -> tuple[LoraEntry, ...]:
    """The entry's adapters, paths relative to the models.toml at ``origin``. Raises
    ConfigError naming the key."""
    given = raw.get("lora", [])
    if not isinstance(given, list) or len(given) > MAX_ADAPTERS:
        raise ConfigError(f"{where}.lora must be a list of at most {MAX_ADAPTERS} "
                          '{ path = "adapter.gguf", scale = 1.0 } tables')
    out = []
    for i, item in enumerate(given):
        at = f"{where}.lora[{i}]"
        if isinstance(item, str):
            item = {"path": item}
        if not isinstance(item, Mapping) or not isinstance(item.get("path"), str) or (
                set(item) - {"path", "scale", "sha256"}):
            raise ConfigError(f'{at} must be {{ path = "adapter.gguf", scale = 1.0 }} '
                              "(sha256 optional)")
        scale = item.get("scale", 1.0)
        if isinstance(scale, bool) or not isinstance(scale, int | float) or abs(scale) > 100:
            raise ConfigError(f"{at}.scale must be a number from -100 to 100")
        sha = item.get("sha256")
        if sha is not None and (not isinstance(sha, str) or len(sha) != 64):
            raise ConfigError(f"{at}.sha256 must be 64 lowercase hex digits")
        path = Path(item["path"]).expanduser()
        out.append(LoraEntry(path if path.is_absolute() else origin.parent / path,
                             float(scale), sha))
    return tuple(out)
