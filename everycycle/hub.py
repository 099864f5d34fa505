"""Hugging Face hub access: pinned downloads into the shared HF cache.

Files go where every other tool looks for them (``HF_HOME`` / ``HF_HUB_CACHE``);
``HF_HUB_OFFLINE`` is respected by huggingface-hub itself.
"""

from __future__ import annotations

from pathlib import Path

from .errors import InvalidRequestError
from .registry import ModelSpec


def cached_file(spec: ModelSpec) -> Path:
    """The cached GGUF of a hub model at its pinned revision, with no network access.

    Raises InvalidRequestError when it is not in the cache yet.
    """
    from huggingface_hub import try_to_load_from_cache

    assert spec.hf_repo is not None and spec.hf_file is not None
    found = try_to_load_from_cache(spec.hf_repo, spec.hf_file, revision=spec.revision)
    if isinstance(found, str):
        return Path(found)
    raise InvalidRequestError(
        f"model '{spec.name}' is not downloaded yet: run `everycycle pull {spec.name}`"
    )
