"""A model entry's LoRA adapters (``lora = [{ path = "…", scale = 1.0 }, …]``, llama-server's
``--lora`` and ``--lora-scaled``): each adapter GGUF — a file beside the model or an
``hf://owner/repo/file.gguf@commit`` URL — its default scale, and optionally its sha256
pin, checked as a model file's is."""

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
    source: str
    """Its file (an absolute path) or its hub URL (``hf://…``)."""
    scale: float = 1.0
    """Its scale for requests that name none (``POST /lora-adapters`` changes it)."""
    sha256: str | None = None

    @property
    def name(self) -> str:
        """Its file's name."""
        return self.source.rpartition("/")[2].partition("@")[0]


def local(entry: LoraEntry, *, download: bool = False) -> Path:
    """The adapter's file on disk, checked against its pin (remembered once verified); a
    hub one from the HF cache, downloaded first with ``download`` unless offline. Raises
    InvalidRequestError, or ChecksumMismatchError naming both hashes."""
    return hub.resolved(entry.source, entry.sha256, fetch=download, what="LoRA adapter")


def check(entries: tuple[LoraEntry, ...], *, download: bool = False) -> None:
    """Each adapter is on disk (downloaded first with ``download``) and matches its pin.
    Raises as ``local``."""
    for entry in entries:
        local(entry, download=download)


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
        source = item["path"]
        if source.startswith("hf:"):
            try:
                hub.parse_hf_url(source)
            except InvalidRequestError as exc:
                raise ConfigError(f"{at}.path: {exc.message}") from None
        else:
            path = Path(source).expanduser()
            source = str(path if path.is_absolute() else origin.parent / path)
        out.append(LoraEntry(source, float(scale), sha))
    return tuple(out)
