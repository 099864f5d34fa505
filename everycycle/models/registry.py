"""The model registry: models.toml files, and resolving a model name to a local GGUF.

The shipped ``models.toml`` holds the defaults; ``<config_dir>/models.toml`` extends
and overrides it entry by entry; an explicit ``--models FILE`` replaces both. A model
names exactly one source: a local ``path`` (relative to its file), a pip ``package``
that ships the weights (its ``assemble()`` returns the GGUF path), or a Hugging Face
``hf_repo`` + ``hf_file`` pinned at a ``revision``.
"""

from __future__ import annotations

import importlib
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import (
    ChecksumMismatchError,
    ConfigError,
    InvalidRequestError,
    ProtocolError,
    UnknownModelError,
)
from ..protocol import MAX_TOKENS_LIMIT, Format, check_model_name, sampling
from . import adapters, budgets, drafting, hub, hubrepo
from .keepalive import KEEP_ALIVE_FORMS, parse_keep_alive

SHIPPED_MODELS = Path(__file__).parent.parent / "models.toml"

_KEYS = {
    "path": str,
    "package": str,
    "hf_repo": str,
    "hf_file": str,
    "revision": str,
    "sha256": str,
    "description": str,
    "context": int,
    "parallel": int,
    "executor": str,
    "format": str,
    "package_file": str,
    "kv_cache_type": str,
    "keep_alive": object,
    "gpu_layers": int,
    "speculative": bool,
    "mtp": bool,
    "threads": int,
    "pin": bool,
    "mmproj": str,
    "mmproj_sha256": str,
    "grammar": str,
    "grammar_after_tools": str,
    "kv_cache_disk": int,
    "kv_cache_ram": int,
    "aliases": list,
    "max_tokens": int,
}
_KEYS.update({p.name: object for p in sampling.PARAMS})  # (checked by the table)
_KEYS.update(budgets.KEYS)
_KEYS.update(adapters.KEYS)
_KEYS.update(drafting.KEYS)
_SOURCES = ("path", "package", "hf_repo")
KV_CACHE_TYPES = ("f16", "q8_0", "q4_0")
"""The kv_cache_type values the engine sizes and llama.cpp supports on every backend."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One registry entry, validated."""

    name: str
    origin: Path
    path: Path | None = None
    package: str | None = None
    hf_repo: str | None = None
    hf_file: str | None = None
    revision: str | None = None
    sha256: str | None = None
    description: str = ""
    context: int | None = None
    """Tokens a slot; None: chosen at load from what the model was trained for and the
    memory it has (``room.context_for``)."""
    parallel: int = 4
    executor: str = "auto"
    format: Format | None = None
    package_file: str | None = None
    """The GGUF's file name inside ``package`` (found without importing the package)."""
    kv_cache_type: str = "f16"
    """The KV cache's element type: f16, q8_0 or q4_0 (llama-server's -ctk/-ctv)."""
    sampling: Mapping[str, object] = field(default_factory=dict)
    """Sampling defaults for this model (temperature, top_k, …); requests override them."""
    keep_alive: float | None = None
    """Seconds it stays loaded once idle (-1: always); None: the daemon's default."""
    speculative: bool = True
    """Prompt-lookup decoding for greedy requests (``speculative = false`` turns it off)."""
    mtp: bool = True
    """Its own MTP heads draft for it, where the GGUF has them (``mtp = false``: they are
    not loaded)."""
    gpu_layers: int | None = None
    """At most this many layers on a GPU (llama.cpp's -ngl, Ollama's num_gpu); None:
    as many as its free memory holds."""
    threads: int | None = None
    """CPU threads for decoding (llama.cpp's -t, Ollama's num_thread); None: the
    engine's default for this machine."""
    pin: bool = False
    """Never unloaded to make room for another model (nor is a ``keep_alive = -1`` one)."""
    mmproj: str | None = None
    """Its vision projector: a GGUF path (relative to models.toml) or an
    ``hf://owner/repo/file.gguf@commit`` URL; the model then reads images."""
    mmproj_sha256: str | None = None
    grammar: str | None = None
    """GBNF that holds the model's replies to a user's turn (a request's own grammar,
    schema or forced tool choice comes first)."""
    grammar_after_tools: str | None = None
    """GBNF that holds its replies to tool results."""
    kv_cache_disk: int = 2048
    """MiB of cached prefixes kept on disk when it is unloaded (0: none)."""
    kv_cache_ram: int = -1
    """MiB of host RAM for the conversations its slots gave up (0: none; -1: a quarter
    of the memory available when it loads, at most 8 GiB)."""
    reasoning: budgets.ReasoningBudgets = field(default_factory=budgets.ReasoningBudgets)
    """A thinking model's budgets (``models/budgets.py``)."""
    lora: tuple[adapters.LoraEntry, ...] = ()
    """Its LoRA adapters (``models/adapters.py``)."""
    draft: drafting.DraftSpec | None = None
    """Its draft model for speculative decoding (``models/drafting.py``)."""
    max_tokens: int | None = None
    """The tokens an answer may have when its request says none (llama-server's ``-n``,
    Ollama's ``num_predict`` in a Modelfile); None: as many as the context holds."""
    aliases: tuple[str, ...] = ()
    """Other names requests may call it by (llama-swap's ``aliases``, llama-server's
    ``--alias``): clients with a model name of their own reach it."""

    @property
    def hub_ref(self) -> hub.HubRef:
        """Where a hub model lives. Raises InvalidRequestError for other sources."""
        if self.hf_repo is None or self.hf_file is None:
            raise InvalidRequestError(f"model '{self.name}' is not a hub model")
        return hub.HubRef(self.hf_repo, self.hf_file, self.revision)

    @property
    def source(self) -> str:
        """A one-line description of where the weights come from."""
        if self.path is not None:
            return str(self.path)
        if self.package is not None:
            return f"pip:{self.package}"
        rev = f"@{self.revision}" if self.revision else ""
        return f"hf://{self.hf_repo}/{self.hf_file}{rev}"


@dataclass(frozen=True, slots=True)
class Registry:
    """All known models and the default one."""

    models: Mapping[str, ModelSpec]
    default: str | None
    rpc: tuple[str, ...] = ()
    """Remote executors' RPC servers (``rpc = ["HOST:PORT", …]`` at the top level)."""
    max_loaded_models: int | None = None
    """At most this many models resident at once (``max_loaded_models = N`` at the top
    level); None: as many as memory holds."""

    def alias(self, name: str) -> str | None:
        """The entry ``name`` is an alias of (None: no entry's)."""
        return next((n for n, spec in self.models.items() if name in spec.aliases), None)

    def has(self, name: str) -> bool:
        """Whether ``name`` is an entry's name or one of its aliases."""
        return name in self.models or self.alias(name) is not None

    def get(self, name: str) -> ModelSpec:
        """The spec for ``name`` (an entry's name, or its alias). Raises UnknownModelError
        for an unknown name."""
        spec = self.models.get(name)
        if spec is None and (entry := self.alias(name)) is not None:
            spec = self.models[entry]
        if spec is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise UnknownModelError(f"unknown model '{name}' (known: {known})")
        return spec

    def default_name(self) -> str:
        """The model ``run`` uses without ``-m``. Raises ConfigError if none is set."""
        if self.default is None:
            raise ConfigError("no default model: set `default = \"NAME\"` in models.toml")
        return self.default


def _parse_entry(name: str, raw: Any, origin: Path) -> ModelSpec:
    try:
        check_model_name(name)  # what a request can name, or the entry is useless
    except ProtocolError as exc:
        raise ConfigError(f"{origin}: model name {json.dumps(name)[:60]}: {exc.message}"
                          ) from None
    where = f"{origin}: [models.{name}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table")
    for key, value in raw.items():
        expected = _KEYS.get(key)
        if expected is None:
            allowed = ", ".join(sorted(_KEYS))
            raise ConfigError(f"{where}: unknown key '{key}' (expected one of {allowed})")
        if expected is object:  # checked by its own parser
            continue
        ok = isinstance(value, int | float) if expected is float else isinstance(value, expected)
        if not ok or (isinstance(value, bool) and expected is not bool):
            kind = {float: "number", int: "whole number", str: "string", bool: "boolean",
                    list: "list"}.get(expected, expected.__name__)
            raise ConfigError(f"{where}.{key} must be a {kind}")
    sources = [s for s in _SOURCES if s in raw]
    if len(sources) != 1:
        raise ConfigError(f"{where} needs exactly one source: path, package or hf_repo")
    if "hf_repo" in raw and "hf_file" not in raw:
        raise ConfigError(f"{where}: hf_repo needs hf_file")
    if "hf_repo" in raw:
        rev = raw.get("revision")
        try:  # the same rules as a pull's hf:// URL: nothing outside the repo
            hub.parse_hf_url(f"hf://{raw['hf_repo']}/{raw['hf_file']}"
                             + (f"@{rev}" if isinstance(rev, str) else ""))
        except InvalidRequestError as exc:
            raise ConfigError(f"{where}: {exc.message}") from None
    for key, lo, hi in (("context", 16, 1 << 20), ("parallel", 1, 256),
                        ("max_tokens", 1, MAX_TOKENS_LIMIT),
                        ("gpu_layers", 0, 100_000), ("threads", 1, 1024)):
        if key in raw and not lo <= raw[key] <= hi:
            raise ConfigError(f"{where}.{key} must be between {lo} and {hi}")
    try:
        given = sampling.checked(sampling.from_json(None, raw))
    except ProtocolError as exc:  # (its message starts with the key)
        raise ConfigError(f"{where}.{exc.message}") from None
    keep_alive = None
    if "keep_alive" in raw:
        try:
            keep_alive = parse_keep_alive(raw["keep_alive"])
        except ValueError:
            raise ConfigError(f"{where}.keep_alive = {raw['keep_alive']!r}: "
                              f"{KEEP_ALIVE_FORMS}") from None
    kv = raw.get("kv_cache_type", "f16")
    if kv not in KV_CACHE_TYPES:
        raise ConfigError(f"{where}.kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)} "
                          f"(got '{kv}')")
    if "package_file" in raw and "package" not in raw:
        raise ConfigError(f"{where}: package_file needs package")
    fmt = raw.get("format")
    if fmt is not None and fmt not in ("chat", "raw"):
        raise ConfigError(f"{where}.format must be \"chat\" or \"raw\"")
    for key in ("sha256", "mmproj_sha256"):
        sha = raw.get(key)
        if sha is not None and (len(sha) != 64 or any(c not in "0123456789abcdef"
                                                      for c in sha)):
            raise ConfigError(f"{where}.{key} must be 64 lowercase hex digits")
    sha = raw.get("sha256")
    mmproj = raw.get("mmproj")
    if isinstance(mmproj, str) and mmproj.startswith("hf:"):
        try:
            hub.parse_hf_url(mmproj)
        except InvalidRequestError as exc:
            raise ConfigError(f"{where}.mmproj: {exc.message}") from None
    elif isinstance(mmproj, str):
        mmproj = str(origin.parent / Path(mmproj).expanduser())
    try:
        path = Path(raw["path"]).expanduser() if "path" in raw else None
    except RuntimeError:  # ~someone who is not a user here
        raise ConfigError(f"{where}.path = {raw['path']!r}: no such user's home") from None
    if path is not None and not path.is_absolute():
        path = origin.parent / path
    aliases = raw.get("aliases", [])
    for alias in aliases:
        try:
            check_model_name(alias if isinstance(alias, str) else "")
        except ProtocolError as exc:
            raise ConfigError(f"{where}.aliases: {json.dumps(alias)[:60]}: {exc.message}"
                              ) from None
    return ModelSpec(
        name=name,
        origin=origin,
        path=path,
        package=raw.get("package"),
        hf_repo=raw.get("hf_repo"),
        hf_file=raw.get("hf_file"),
        revision=raw.get("revision"),
        sha256=sha,
        description=raw.get("description", ""),
        context=raw.get("context"),
        parallel=raw.get("parallel", 4),
        executor=raw.get("executor", "auto"),
        format=Format(fmt) if fmt else None,
        package_file=raw.get("package_file"),
        kv_cache_type=kv,
        sampling=given,
        keep_alive=keep_alive,
        gpu_layers=raw.get("gpu_layers"),
        threads=raw.get("threads"),
        speculative=raw.get("speculative", True),
        mtp=raw.get("mtp", True),
        pin=raw.get("pin", False),
        mmproj=mmproj,
        mmproj_sha256=raw.get("mmproj_sha256"),
        grammar=raw.get("grammar"),
        grammar_after_tools=raw.get("grammar_after_tools"),
        kv_cache_disk=raw.get("kv_cache_disk", 2048),
        kv_cache_ram=raw.get("kv_cache_ram", -1),
        reasoning=budgets.parse(raw, where),
        lora=adapters.parse(raw, where, origin),
        draft=drafting.parse(raw, where, origin),
        aliases=tuple(aliases),
        max_tokens=raw.get("max_tokens"),
    )


def parse_file(path: Path) -> tuple[dict[str, ModelSpec], str | None]:
    """Parse one models.toml. Raises ConfigError naming the file, line or model."""
    found = _parse(path)
    return found.models, found.default


@dataclass(frozen=True, slots=True)
class _File:
    """What one models.toml says."""

    models: dict[str, ModelSpec]
    default: str | None
    rpc: tuple[str, ...]
    max_loaded_models: int | None


def _parse(path: Path) -> _File:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    for key in data:
        if key not in ("default", "models", "rpc", "max_loaded_models"):
            raise ConfigError(f"{path}: unknown top-level key '{key}' "
                              "(expected default, models, rpc, max_loaded_models)")
    rpc = data.get("rpc", [])
    if not isinstance(rpc, list) or not all(
            isinstance(h, str) and h.rpartition(":")[0] and h.rpartition(":")[2].isdigit()
            for h in rpc):
        raise ConfigError(f"{path}: rpc must be a list of \"HOST:PORT\" strings")
    default = data.get("default")
    if default is not None and not isinstance(default, str):
        raise ConfigError(f"{path}: default must be a string")
    models_raw = data.get("models", {})
    if not isinstance(models_raw, dict):
        raise ConfigError(f"{path}: models must be a table of [models.NAME] entries")
    cap = data.get("max_loaded_models")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool)
                            or not 1 <= cap <= 1000):
        raise ConfigError(f"{path}: max_loaded_models must be a whole number from 1 to 1000")
    models = {name: _parse_entry(name, raw, path) for name, raw in models_raw.items()}
    return _File(models, default, tuple(rpc), cap)


def load_registry(models_file: Path | None = None) -> Registry:
    """The registry: ``models_file`` alone, or the shipped file plus the user's.

    Raises ConfigError for a malformed file or a default that names no model.
    """
    files = [models_file] if models_file else [SHIPPED_MODELS, paths.user_models_file()]
    models: dict[str, ModelSpec] = {}
    default: str | None = None
    used: list[Path] = []
    rpc: list[str] = []
    cap: int | None = None
    for i, f in enumerate(files):
        if i > 0 and not f.exists():
            continue
        found = _parse(f)
        if models_file is not None and not found.models and not found.rpc and not found.default:
            raise ConfigError(f"{f} is empty: it names no models (add a [models.NAME] table "
                              "with a path, package or hf_repo)")
        rpc.extend(h for h in found.rpc if h not in rpc)
        models.update(found.models)
        default = found.default or default
        cap = found.max_loaded_models or cap
        used.append(f)
    if default is not None and default not in models:
        raise ConfigError(f"{used[-1]}: default '{default}' is not a model in the registry")
    owner: dict[str, str] = {}
    for spec in models.values():
        for alias in spec.aliases:
            if alias in models or alias in owner:
                other = alias if alias in models else owner[alias]
                raise ConfigError(f"{spec.origin}: [models.{spec.name}].aliases: '{alias}' "
                                  f"already names model '{other}'")
            owner[alias] = spec.name
    return Registry(models=models, default=default, rpc=tuple(rpc), max_loaded_models=cap)


def local_file(spec: ModelSpec, *, download: bool = False, progress: bool = False) -> Path:
    """The GGUF on disk for ``spec``, checked against its sha256 pin.

    A hub model not in the cache is downloaded when ``download`` is set and the hub
    is not offline (with a progress bar on stderr when ``progress``). Raises
    InvalidRequestError when the file is missing or not yet downloaded, ConfigError
    when the weights package is not installed, and the hub module's errors.
    """
    if spec.path is not None:
        if not spec.path.is_file():
            raise InvalidRequestError(f"model '{spec.name}': {spec.path} is not a file")
        if spec.sha256:
            hub.verify(spec.path, spec.sha256)
        return spec.path
    if spec.package is not None:
        return _package_file(spec)
    return hub_files(spec, download=download, progress=progress)[0]


def hub_files(spec: ModelSpec, *, download: bool = False, progress: bool = False,
              on_progress: hub.Progress | None = None) -> list[Path]:
    """A hub model's files in the cache: its GGUF, or every part of a split one (the
    first checked against the sha256 pin, the rest pinned by the commit). Downloads
    what is missing when ``download`` is set and the hub is not offline."""
    first = spec.hub_ref
    split = hubrepo.SPLIT.fullmatch(first.file)
    names = [first.file] if split is None or split["i"] != "00001" else [
        f"{split['stem']}-{i:05d}-of-{split['n']}.gguf" for i in range(1, int(split["n"]) + 1)]
    found = []
    for i, name in enumerate(names):
        ref = hub.HubRef(first.repo, name, first.revision)
        sha = spec.sha256 if i == 0 else None
        try:
            found.append(hub.cached_file(ref, sha256=sha, name=spec.name))
            continue
        except ChecksumMismatchError:
            raise
        except InvalidRequestError:
            if not download or hub.offline():
                raise
        found.append(hub.download(ref, sha256=sha, progress=progress, on_progress=on_progress))
    return found


def side_files(spec: ModelSpec, *, download: bool = False) -> Path | None:
    """What loads beside ``spec``'s GGUF, checked: its LoRA adapters (their pins) and its
    vision projector (returned; None: none). Raises as ``local_file`` does."""
    adapters.check(spec.lora, download=download)
    return projector_file(spec, download=download)


def projector_file(spec: ModelSpec, *, download: bool = False) -> Path | None:
    """``spec``'s vision projector on disk (None: it has none), checked against its
    pin; a hub one is downloaded when ``download`` is set and the hub is not offline.
    Raises as ``local_file`` does."""
    if spec.mmproj is None:
        return None
    return hub.resolved(spec.mmproj, spec.mmproj_sha256, fetch=download,
                        what=f"model '{spec.name}': its mmproj", name=spec.name)


def package_path(spec: ModelSpec) -> Path | None:
    """Where a ``package`` + ``package_file`` model's GGUF is, found without importing
    the package (a weights package may import heavy things); None if not installed."""
    import importlib.util

    assert spec.package is not None and spec.package_file is not None
    try:
        found = importlib.util.find_spec(spec.package)
    except (ImportError, ValueError):
        return None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations))) / spec.package_file


def _package_file(spec: ModelSpec) -> Path:
    assert spec.package is not None
    missing = ConfigError(
        f"model '{spec.name}' needs the package {spec.package}: "
        "pip install 'everycycle[default-model]'"
    )
    if spec.package_file is not None:
        path = package_path(spec)
        if path is None:
            raise missing
        if not path.is_file():
            raise ConfigError(f"model '{spec.name}': {spec.package} has no {spec.package_file}")
        if spec.sha256:
            hub.verify(path, spec.sha256)
        return path
    try:
        module = importlib.import_module(spec.package)
    except ImportError:
        raise missing from None
    path = Path(module.assemble())  # the package checks its own sha256
    if spec.sha256:
        hub.verify(path, spec.sha256)  # (remembered: `models` finds it again unimported)
    return path
