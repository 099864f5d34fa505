"""A model entry's draft model for speculative decoding (llama-server's ``-md`` and its
``--spec-draft-n-max``, ``--spec-draft-n-min``, ``--draft-p-min``; LM Studio's
``draft_model``): ``draft_model`` names another entry, a GGUF path (relative to the
models.toml), an ``hf://owner/repo/file.gguf@commit`` URL or another tool's store name
(``ollama:qwen2.5:0.5b``); ``draft_max``, ``draft_min`` and ``draft_p_min`` bound its
drafts. It loads in the target's engine, on the target's devices."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, InvalidRequestError
from . import hub

KEYS = {"draft_model": str, "draft_max": int, "draft_min": int, "draft_p_min": object}
MAX_DRAFT = 64


@dataclass(frozen=True, slots=True)
class DraftSpec:
    model: str
    """Another entry's name, an absolute GGUF path, an ``hf://`` URL or a store name."""
    max: int = 3
    """Tokens drafted at most a step (llama-server's default)."""
    min: int = 0
    """Drafts shorter than this are dropped."""
    p_min: float = 0.0
    """A draft stops at a token the draft model is less sure of than this."""


def parse(raw: Mapping[str, object], where: str, origin: Path) -> DraftSpec | None:
    """The entry's draft model (None: none). Raises ConfigError naming the key."""
    model = raw.get("draft_model")
    bounds = [k for k in ("draft_max", "draft_min", "draft_p_min") if k in raw]
    if model is None:
        if bounds:
            raise ConfigError(f"{where}.{bounds[0]} needs draft_model")
        return None
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(f"{where}.draft_model must name a model: an entry, a GGUF path "
                          "or an hf:// URL")
    return checked(source(model, origin), raw.get("draft_max", 3), raw.get("draft_min", 0),
                   raw.get("draft_p_min", 0.0), where=f"{where}.")


def source(model: str, origin: Path) -> str:
    """``model`` as a draft source: a relative GGUF path made absolute (from ``origin``'s
    folder), anything else as given."""
    if model.startswith("hf:") or not model.endswith(".gguf"):
        return model
    path = Path(model).expanduser()
    return str(path if path.is_absolute() else origin.parent / path)


def checked(model: str, n_max: object, n_min: object, p_min: object, *,
            where: str) -> DraftSpec:
    """A DraftSpec from given values. Raises ConfigError naming the key (``where``: its
    prefix, the entry's)."""
    if model.startswith("hf:"):
        try:
            hub.parse_hf_url(model)
        except InvalidRequestError as exc:
            raise ConfigError(f"{where}draft_model: {exc.message}") from None
    for key, value, low in (("draft_max", n_max, 1), ("draft_min", n_min, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_DRAFT:
            raise ConfigError(f"{where}{key} must be {low} to {MAX_DRAFT} tokens")
    if isinstance(p_min, bool) or not isinstance(p_min, int | float) or not 0 <= p_min <= 1:
        raise ConfigError(f"{where}draft_p_min must be a probability from 0 to 1")
    assert isinstance(n_max, int) and isinstance(n_min, int)
    if n_min > n_max:
        raise ConfigError(f"{where}draft_min ({n_min}) is more than draft_max ({n_max})")
    return DraftSpec(model, n_max, n_min, float(p_min))
