"""Chat-template test helpers: the template fixtures, and the chat templates inside the
shipped models' GGUFs."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).parent / "data" / "templates"


def _shipped(name: str) -> Path:
    """Where a shipped registry model's GGUF is (a path that may not exist)."""
    from everycycle.errors import EverycycleError
    from everycycle.models.registry import load_registry, local_file

    try:
        return local_file(load_registry(None).get(name))
    except EverycycleError:
        return Path(f"/nonexistent/{name}.gguf")


SMOLLM2 = _shipped("smollm2-135m")
GEMMA3 = _shipped("gemma-3-270m")


def fixture_source(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


@functools.cache
def gguf_chat(path: Path) -> tuple[str | None, str, str]:
    """(tokenizer.chat_template or None, BOS text, EOS text) of a GGUF."""
    if not path.exists():
        pytest.skip(f"{path} is not on this machine")
    import gguf

    reader = gguf.GGUFReader(str(path))

    def text(field: gguf.ReaderField, i: int = 0) -> str:
        return bytes(field.parts[field.data[i]]).decode("utf-8")

    tokens = reader.fields["tokenizer.ggml.tokens"]

    def token(key: str) -> str:
        field = reader.fields[key]
        return text(tokens, int(field.parts[field.data[0]][0]))

    field = reader.fields.get("tokenizer.chat_template")
    source = text(field) if field is not None else None
    return source, token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
