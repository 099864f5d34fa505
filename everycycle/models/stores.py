"""Other tools' model stores, read in place: never copied, never written.

- Ollama (``$OLLAMA_MODELS`` or ``~/.ollama/models``): ``manifests/<host>/<namespace>/
  <model>/<tag>`` is JSON whose layers name blobs by digest; the layer of media type
  ``application/vnd.ollama.image.model`` is the GGUF (``blobs/sha256-<hex>``, its name
  its own sha256), ``…image.projector`` a vision projector, ``…image.params`` sampling
  defaults. Its ``…image.template`` is Go ``text/template``, not Jinja: not converted;
  the GGUF's own chat template is used (``show`` says so).
  Named ``ollama:llama3.2:3b`` (tag ``latest`` when none), ``ollama:user/model:tag``,
  ``ollama:hf.co/owner/repo:Q4_K_M``, as ``ollama list`` names them.
- LM Studio (``~/.lmstudio/models`` and the older ``~/.cache/lm-studio/models``):
  ``<publisher>/<repo>/*.gguf``, an ``mmproj*.gguf`` beside being the projector. Named
  ``lmstudio:publisher/repo``, or ``lmstudio:publisher/repo/file.gguf`` where the
  folder holds several models.
- llama.cpp's ``-hf`` cache (``$LLAMA_CACHE``, or ``~/.cache/llama.cpp``): flat files
  of older versions (``owner_repo_file.gguf``: ``llamacpp:owner_repo_file``) and the
  Hugging Face layout newer ones keep under ``$LLAMA_CACHE``
  (``llamacpp:owner/repo/file.gguf``).
- The Hugging Face cache (the hub's, ours too): listed as ``hf://owner/repo/file@commit``,
  which ``run -m`` records as any pull.

A digest must be ``sha256:`` and 64 hex digits before it becomes a path, and a path that
leads out of its store (a symlink, ``..``) is refused. A missing store is empty.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import EverycycleError, InvalidRequestError, ProtocolError, UnknownModelError
from ..protocol import sampling
from . import hub, hubrepo
from .adapters import LoraEntry
from .registry import ModelSpec

OLLAMA, LMSTUDIO, LLAMACPP, HF = "ollama", "lmstudio", "llamacpp", "hf"
PREFIXES = (f"{OLLAMA}:", f"{LMSTUDIO}:", f"{LLAMACPP}:")
"""The prefixes of model names that resolve in another tool's store."""
TOOLS = {OLLAMA: "Ollama", LMSTUDIO: "LM Studio", LLAMACPP: "llama.cpp", HF: "Hugging Face"}

MEDIA = "application/vnd.ollama.image."
DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
"""One component of an Ollama name (host, namespace, model, tag), as a path part."""
MAX_MANIFEST = 1 << 20
MAX_PARAMS = 1 << 20
OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_LIBRARY = "library"


@dataclass(frozen=True, slots=True)
class StoreModel:
    """One GGUF found in another tool's store."""

    ref: str
    """The name a request gives it: ``ollama:llama3.2:3b``, ``lmstudio:pub/repo``, …"""
    store: str
    """``ollama``, ``lmstudio``, ``llamacpp`` or ``hf``."""
    root: Path
    path: Path
    sha256: str | None = None
    """Known without reading the file (Ollama's blob name)."""
    projector: Path | None = None
    projector_sha256: str | None = None
    context: int | None = None
    """Ollama's ``num_ctx`` parameter, if set."""
    sampling: Mapping[str, object] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    """What was not taken over (Ollama's Go template, parameters we do not take)."""
    adapters: tuple[tuple[Path, str], ...] = ()
    """Ollama's ``ADAPTER`` layers: LoRA GGUFs (and their digests), applied at scale 1."""

    @property
    def description(self) -> str:
        return f"{TOOLS[self.store]}'s store ({self.root})"


def is_ref(name: str) -> bool:
    """Whether ``name`` names a model in another tool's store."""
    return name.startswith(PREFIXES)


# ---------------------------------------------------------------------- the roots

def _env_path(var: str) -> Path | None:
    value = os.environ.get(var)
    return Path(value).expanduser() if value else None


def _cache_home() -> Path:
    return _env_path("XDG_CACHE_HOME") or Path.home() / ".cache"


def ollama_root() -> Path:
    return _env_path("OLLAMA_MODELS") or Path.home() / ".ollama" / "models"


def lmstudio_roots() -> list[Path]:
    return [Path.home() / ".lmstudio" / "models", _cache_home() / "lm-studio" / "models"]


def llamacpp_root() -> Path:
    return _env_path("LLAMA_CACHE") or _cache_home() / "llama.cpp"


def _inside(path: Path, root: Path, what: str) -> Path:
    """``path`` resolved, if it stays inside ``root`` (resolved). Raises
    InvalidRequestError naming ``what``."""
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise InvalidRequestError(f"{what}: {path} leads out of the store ({root}): refused")
    return real


# ---------------------------------------------------------------------- Ollama

def ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The name ``ollama list`` shows for a manifest's place."""
    if host == OLLAMA_HOST and namespace == OLLAMA_LIBRARY:
        return f"{model}:{tag}"
    if host == OLLAMA_HOST:
        return f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def ollama_place(name: str) -> tuple[str, str, str, str]:
    """(host, namespace, model, tag) of an Ollama model name. Raises
    InvalidRequestError for a name that is not one."""
    base, colon, tag = name.rpartition(":")
    if not colon or "/" in tag:
        base, tag = name, "latest"
    parts = base.split("/")
    if len(parts) == 1:
        parts = [OLLAMA_HOST, OLLAMA_LIBRARY, *parts]
    elif len(parts) == 2:
        parts = [OLLAMA_HOST, *parts]
    if len(parts) != 3 or not all(_PART.fullmatch(p) for p in (*parts, tag)) or any(
            p in (".", "..") for p in (*parts, tag)):
        raise InvalidRequestError(f"ollama:{name}: not an Ollama model name (model, "
                                  "model:tag, namespace/model:tag or host/namespace/model:tag)")
    return parts[0], parts[1], parts[2], tag


def _blob(root: Path, layer: Mapping[str, Any], ref: str) -> tuple[Path, str]:
    digest = layer.get("digest")
    found = DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if found is None:
        raise InvalidRequestError(f"{ref}: its manifest names a blob by {str(digest)[:80]!r}, "
                                  "not sha256 and 64 hex digits: refused")
    path = root / "blobs" / f"sha256-{found[1]}"
    _inside(path, root, ref)
    if not path.is_file():
        raise InvalidRequestError(
            f"{ref}: its blob sha256-{found[1][:12]}… is missing from Ollama's store "
            f"({root}): `ollama pull {ref.removeprefix('ollama:')}` fetches it again")
    return path, found[1]


def _ollama_params(root: Path, layers: list[Mapping[str, Any]], ref: str
                   ) -> tuple[int | None, dict[str, object], list[str]]:
    """The params layer's context and sampling defaults, and notes on what was left."""
    notes: list[str] = []
    for layer in layers:
        if layer.get("mediaType") != MEDIA + "params":
            continue
        path, _ = _blob(root, layer, ref)
        try:
            raw = json.loads(path.read_bytes()[:MAX_PARAMS])
        except (OSError, ValueError):
            return None, {}, ["its parameters layer is not JSON: not used"]
        if not isinstance(raw, dict):
            return None, {}, ["its parameters layer is not a JSON object: not used"]
        ctx = raw.get("num_ctx")
        context = ctx if isinstance(ctx, int) and 16 <= ctx <= 1 << 20 else None
        taken: dict[str, object] = {}
        for key, value in raw.items():
            try:
                taken.update(sampling.checked(sampling.from_json(sampling.OLLAMA,
                                                                 {key: value})))
            except ProtocolError as exc:
                notes.append(f"parameter {exc.message}: not used")
        left = sorted(set(raw) - set(taken) - {"num_ctx"})
        if left:
            notes.append(f"parameters not taken: {', '.join(left)}")
        return context, taken, notes
    return None, {}, notes


def ollama_model(root: Path, name: str) -> StoreModel:
    """The model Ollama's store at ``root`` calls ``name``. Raises UnknownModelError
    when it has none, InvalidRequestError for a manifest or blob that will not do."""
    host, namespace, model, tag = ollama_place(name)
    ref = f"{OLLAMA}:{ollama_name(host, namespace, model, tag)}"
    manifest = root / "manifests" / host / namespace / model / tag
    if not manifest.is_file():
        raise UnknownModelError(f"model '{ref}' not found in Ollama's store ({root})")
    _inside(manifest, root, ref)
    try:
        data = json.loads(manifest.read_bytes()[:MAX_MANIFEST])
    except (OSError, ValueError) as exc:
        raise InvalidRequestError(f"{ref}: its manifest {manifest} cannot be read: {exc}"
                                  ) from None
    layers = data.get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
        raise InvalidRequestError(f"{ref}: its manifest {manifest} has no list of layers")
    kinds = {str(x.get("mediaType", "")).removeprefix(MEDIA) for x in layers}
    models = [x for x in layers if x.get("mediaType") == MEDIA + "model"]
    if len(models) != 1:
        raise InvalidRequestError(f"{ref}: its manifest has {len(models)} model layers, "
                                  "not one")
    path, digest = _blob(root, models[0], ref)
    adapters = tuple(_blob(root, layer, ref) for layer in layers
                     if layer.get("mediaType") == MEDIA + "adapter")
    projector = projector_sha = None
    for layer in layers:
        if layer.get("mediaType") == MEDIA + "projector":
            projector, projector_sha = _blob(root, layer, ref)
    context, taken, notes = _ollama_params(root, layers, ref)
    if "template" in kinds:
        notes.insert(0, "Ollama's template (Go text/template) is not used: the GGUF's "
                        "own chat template is")
    return StoreModel(ref, OLLAMA, root, path, digest, projector, projector_sha,
                      context, taken, tuple(notes), adapters)


def ollama_models(root: Path) -> Iterator[StoreModel | str]:
    """Every model in Ollama's store at ``root``; a string says why one is left out."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for tag in sorted(manifests.glob("*/*/*/*")):
        host, namespace, model = tag.parts[-4:-1]
        try:
            yield ollama_model(root, ollama_name(host, namespace, model, tag.name))
        except InvalidRequestError as exc:
            yield exc.message


# ---------------------------------------------------------------------- GGUF folders

def _is_projector(path: Path) -> bool:
    return "mmproj" in path.name.lower()


def _models_in(folder: Path) -> list[Path]:
    """The loadable GGUFs of ``folder``: not projectors; a split model's first part."""
    found = []
    for path in sorted(folder.glob("*.gguf")):
        split = hubrepo.SPLIT.fullmatch(path.name)
        if _is_projector(path) or (split is not None and split["i"] != "00001"):
            continue
        found.append(path)
    return found


def _projector_in(folder: Path) -> Path | None:
    return next((p for p in sorted(folder.glob("*.gguf")) if _is_projector(p)), None)


def lmstudio_models(root: Path) -> Iterator[StoreModel | str]:
    """Every model in an LM Studio tree at ``root``."""
    if not root.is_dir():
        return
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        try:
            _inside(folder, root, f"{LMSTUDIO}:{folder.parent.name}/{folder.name}")
        except InvalidRequestError as exc:
            yield exc.message
            continue
        found = _models_in(folder)
        projector = _projector_in(folder)
        base = f"{LMSTUDIO}:{folder.parent.name}/{folder.name}"
        for path in found:
            ref = base if len(found) == 1 else f"{base}/{path.name}"
            yield StoreModel(ref, LMSTUDIO, root, path, projector=projector)


def llamacpp_models(root: Path) -> Iterator[StoreModel | str]:
    """Every model in llama.cpp's cache at ``root``: flat files, then the hub layout."""
    if not root.is_dir():
        return
    for path in _models_in(root):
        yield StoreModel(f"{LLAMACPP}:{path.stem}", LLAMACPP, root, path)
    for repo, _, path, projector in _hub_layout(root):
        yield StoreModel(f"{LLAMACPP}:{repo}/{path.name}", LLAMACPP, root, path,
                         projector=projector)


def _hub_layout(root: Path) -> Iterator[tuple[str, str, Path, Path | None]]:
    """(owner/repo, snapshot, path, projector) of each model in a Hugging Face-layout
    cache."""
    for repo in sorted(root.glob("models--*--*")):
        owner, _, name = repo.name.removeprefix("models--").partition("--")
        for snapshot in sorted((repo / "snapshots").glob("*")):
            for path in _models_in(snapshot):
                yield f"{owner}/{name}", snapshot.name, path, _projector_in(snapshot)


def hf_models(root: Path) -> Iterator[StoreModel | str]:
    """Every GGUF in the Hugging Face cache, as the hub URL that records it."""
    if not root.is_dir():
        return
    for repo, snapshot, path, projector in _hub_layout(root):
        yield StoreModel(f"hf://{repo}/{path.name}@{snapshot}", HF, root, path,
                         projector=projector)


# ---------------------------------------------------------------------- all of them

def discover() -> tuple[list[StoreModel], list[str]]:
    """Every store's models, and a line for each one left out (a broken manifest, a
    path out of its store). A store that is not there is empty."""
    found: list[StoreModel] = []
    left: list[str] = []
    sources: list[Iterator[StoreModel | str]] = [
        ollama_models(ollama_root()), *(lmstudio_models(r) for r in lmstudio_roots()),
        llamacpp_models(llamacpp_root()), hf_models(hub.cache_dir())]
    for source in sources:
        try:
            for item in source:
                if isinstance(item, StoreModel):
                    found.append(item)
                else:
                    left.append(item)
        except OSError as exc:  # (a store we may not read)
            left.append(f"{exc.filename}: {exc.strerror}")
    return found, left


def find(ref: str) -> StoreModel:
    """The store model ``ref`` names. Raises UnknownModelError when its store has none,
    InvalidRequestError for one that will not do (said with its source)."""
    store, _, name = ref.partition(":")
    if store == OLLAMA:
        return ollama_model(ollama_root(), name)
    if store == LMSTUDIO:
        candidates: list[StoreModel | str] = [
            m for root in lmstudio_roots() for m in lmstudio_models(root)]
    elif store == LLAMACPP:
        candidates = list(llamacpp_models(llamacpp_root()))
    else:
        raise UnknownModelError(f"model '{ref}': no such store (ollama:, lmstudio:, llamacpp:)")
    models = [m for m in candidates if isinstance(m, StoreModel)]
    for m in models:
        if m.ref == ref:
            return m
    several = [m.ref for m in models if m.ref.startswith(ref + "/")]
    if several:
        raise InvalidRequestError(f"'{ref}' holds several models: {', '.join(several)}")
    raise UnknownModelError(f"model '{ref}' not found in {TOOLS[store]}'s store")


def has(ref: str) -> bool:
    """Whether another tool's store has ``ref`` (one that will not load, a missing blob,
    is there: its request hears why)."""
    if not is_ref(ref):
        return False
    try:
        find(ref)
    except UnknownModelError:
        return False
    except EverycycleError:
        pass
    return True


def with_digest(m: StoreModel) -> StoreModel:
    """``m`` with its file's sha256 (read once: the hub's memo of verified files)."""
    if m.sha256 is not None:
        return m
    return replace(m, sha256=hub.file_sha256(m.path))


def spec_of(m: StoreModel) -> ModelSpec:
    """A registry entry for ``m``, named by its ref (its file pinned where the store
    names its digest)."""
    return ModelSpec(name=m.ref, origin=m.root, path=m.path, sha256=m.sha256,
                     description=m.description, context=m.context,
                     sampling=m.sampling,
                     mmproj=str(m.projector) if m.projector is not None else None,
                     mmproj_sha256=m.projector_sha256,
                     lora=tuple(LoraEntry(str(p), 1.0, sha) for p, sha in m.adapters))


def entry_of(m: StoreModel) -> dict[str, object]:
    """``m`` as a models.toml entry (``models add``): its file read in place, pinned
    by sha256 (Ollama's checked against its blob name once)."""
    if m.sha256 is not None:
        hub.verify(m.path, m.sha256)
    m = with_digest(m)
    entry: dict[str, object] = {"path": str(m.path), "sha256": m.sha256,
                                "description": f"{m.ref} in {m.description}"}
    if m.projector is not None:
        entry["mmproj"] = str(m.projector)
        entry["mmproj_sha256"] = m.projector_sha256 or hub.file_sha256(m.projector)
    if m.adapters:
        entry["lora"] = [{"path": str(p), "scale": 1.0, "sha256": sha} for p, sha in m.adapters]
    if m.context is not None:
        entry["context"] = m.context
    entry.update(sampling.to_json(m.sampling))
    return entry
