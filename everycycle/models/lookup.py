"""What a request's model name names: a registry entry, a model in another tool's store
(``ollama:llama3.2``, read in place), or a GGUF path of this user's."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ChecksumMismatchError, InvalidRequestError
from . import hub, stores
from .registry import ModelSpec, Registry, local_file


def spec_for(registry: Registry, name: str, *, allow_paths: bool) -> ModelSpec:
    """The entry ``name`` names; an absolute GGUF path only where ``allow_paths`` (the
    connection may name paths) and the file is this user's. Raises InvalidRequestError
    (UnknownModelError for a name nothing has)."""
    if registry.has(name):
        return registry.get(name)
    if stores.is_ref(name):
        return stores.spec_of(stores.find(name))
    if name.endswith(".gguf") and ("/" in name):
        if not allow_paths:
            raise InvalidRequestError("model paths are not allowed on this connection")
        path = Path(name)
        if not path.is_absolute():
            raise InvalidRequestError("a model path must be absolute")
        try:
            owner = path.stat().st_uid
        except OSError as exc:
            raise InvalidRequestError(f"{path}: {exc.strerror}") from None
        if owner != os.getuid():
            raise InvalidRequestError(f"{path} belongs to another user")
        return ModelSpec(name=name, origin=path, path=path)
    return registry.get(name)


def draft_file(registry: Registry, spec: ModelSpec, *, download: bool = False
               ) -> tuple[str, Path] | None:
    """``spec``'s draft model (None: it has none): its name and its GGUF on disk (a hub
    one downloaded first with ``download``, unless offline). Raises InvalidRequestError
    saying which draft model of which model is missing."""
    draft = spec.draft
    if draft is None:
        return None
    what = f"model '{spec.name}': its draft model"
    if draft.model == spec.name:
        raise InvalidRequestError(f"{what} is the model itself")
    try:
        if draft.model.startswith("hf:"):
            path = hub.resolved(draft.model, None, fetch=download, what="the file")
            return path.name, path
        found = spec_for(registry, draft.model, allow_paths=True)
        path = local_file(found, download=download)
        return path.name if found.name == draft.model == str(path) else found.name, path
    except ChecksumMismatchError:
        raise  # (it names the file and both hashes; its kind stays)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{what} '{draft.model}': {exc.message}") from None
