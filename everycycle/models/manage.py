"""Model management in one place, for the CLI and the daemon's Ollama routes alike: a
hub URL fetched (by quantization or one file) and recorded, pinned, in the user's
models.toml; a hub URL given as a model name resolved to its entry, pulling it the first
time (``run -m hf://owner/repo:Q8_0``); what a pull of a name or URL downloads
(``plan_pull``: ``everycycle pull``, ``POST /api/pull``); removing an entry and, with
``purge``, its downloaded files (``everycycle rm``, ``DELETE /api/delete``).

``models add`` and ``run``/``chat``/``launch -m hf://…`` all go through here.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, EverycycleError, InvalidRequestError, UnknownModelError
from . import hub, hubrepo
from .registry import (
    SHIPPED_MODELS,
    Registry,
    hub_files,
    load_registry,
    local_file,
    projector_file,
)


@dataclass(frozen=True, slots=True)
class Fetched:
    """A downloaded model: its repo, the file llama.cpp loads, the commit, and the
    repo's vision projector if any."""

    repo: str
    path: Path
    commit: str
    projector: Path | None = None


def fetch(url: str, *, progress: bool) -> Fetched:
    """Download ``url`` (a repo by quantization, or one file). Raises the hub's errors."""
    by_quant = hubrepo.parse_repo_url(url)
    if by_quant is not None:
        pulled = hubrepo.pull(by_quant, progress=progress)
        if len(pulled.paths) > 1:
            sys.stderr.write(f"everycycle: {pulled.choice.first} and its "
                             f"{len(pulled.paths) - 1} other parts\n")
        if pulled.projector is not None:
            sys.stderr.write(f"everycycle: its vision projector {pulled.projector.name}\n")
        return Fetched(by_quant.repo, pulled.path, pulled.commit, pulled.projector)
    ref = hub.parse_hf_url(url)
    path = hub.download(ref, progress=progress)
    return Fetched(ref.repo, path, hub.commit_of(path) or ref.revision or "")


def repo_path(path: Path, commit: str) -> str:
    """A cached snapshot file's path inside its repo."""
    parts = path.parts
    return "/".join(parts[parts.index(commit) + 1:]) if commit in parts else path.name


def add(name: str, url: str, *, context: int | None = None, parallel: int = 4,
        progress: bool = False) -> tuple[Path, Fetched, str]:
    """Fetch ``url`` and record it as ``name`` (file, commit and sha256 pinned): (the
    models.toml written, what was fetched, its sha256). Raises ConfigError when the name
    is taken, and the hub's errors."""
    from ..protocol import check_model_name
    from .userfile import add_user_entry

    check_model_name(name)  # before a download, not after it
    got = fetch(url, progress=progress)
    digest = hub.sha256_of(got.path)
    where = add_user_entry(name, {
        "hf_repo": got.repo, "hf_file": repo_path(got.path, got.commit),
        "revision": got.commit, "sha256": digest, "parallel": parallel,
        # (no context unless asked: chosen at load from the model and the memory)
        **({"context": context} if context is not None else {}),
        **({"mmproj": f"hf://{got.repo}/{repo_path(got.projector, got.commit)}@{got.commit}",
            "mmproj_sha256": hub.sha256_of(got.projector)} if got.projector else {}),
    })
    return where, got, digest


def add_store_model(name: str, ref: str, *, context: int | None = None,
                    parallel: int | None = None) -> tuple[Path, dict[str, object]]:
    """Record ``ref`` (a model in another tool's store, ``ollama:llama3.2``) as ``name``:
    its file where it is, pinned by sha256 (an Ollama blob checked against its name
    once). (The models.toml written, the entry.) Raises ConfigError when the name is
    taken, UnknownModelError / InvalidRequestError naming the store."""
    from ..protocol import check_model_name
    from . import stores
    from .userfile import add_user_entry

    check_model_name(name)
    entry = stores.entry_of(stores.find(ref))
    if context is not None:
        entry["context"] = context
    if parallel is not None:
        entry["parallel"] = parallel
    return add_user_entry(name, entry), entry


def short_name(url: str) -> str:
    """The registry name a hub URL is recorded under: the repo's name, lower-case,
    without a ``-GGUF`` suffix, with its quantization (``hf://acme/Tiny-GGUF:Q8_0`` →
    ``tiny:q8_0``). Raises InvalidRequestError for what is not a hub URL."""
    by_quant = hubrepo.parse_repo_url(url)
    if by_quant is not None:
        base, quant = by_quant.repo.split("/", 1)[1], by_quant.quant
    else:
        ref = hub.parse_hf_url(url)
        base, quant = ref.repo.split("/", 1)[1], hubrepo.quant_of(ref.file)
    base = re.sub(r"[-_.]gguf$", "", base, flags=re.IGNORECASE).lower()
    return f"{base}:{quant.lower()}" if quant else base


_HUB_HOSTS = ("hf.co/", "huggingface.co/")


def is_hub_url(name: str) -> bool:
    """``hf://owner/repo[:QUANT]`` (or a malformed ``hf:…``), or Ollama's
    ``hf.co/owner/repo[:QUANT]``."""
    return name.startswith(("hf:", *_HUB_HOSTS))  # (hf:/x: a malformed one, said so)


def _as_hf(name: str) -> str:
    for host in _HUB_HOSTS:
        if name.startswith(host):
            return "hf://" + name.removeprefix(host)
    return name


def recorded(url: str, registry: Registry) -> str | None:
    """The registry name hub URL ``url`` was recorded under, or None when it is not yet
    (nothing to pull otherwise). Raises ConfigError when that name is another model's."""
    url = _as_hf(url)
    short = short_name(url)
    spec = registry.models.get(short)
    if spec is None:
        return None
    if spec.hf_repo != (hubrepo.parse_repo_url(url) or hub.parse_hf_url(url)).repo:
        raise ConfigError(f"model '{short}' is already {spec.source}, not {url}: add this "
                          f"one under another name (everycycle models add NAME {url})")
    return short


def resolve(name: str, models: Path | None = None, *, progress: bool = False) -> str:
    """The registry name for ``name``: itself, unless it is a hub URL; then the entry
    recorded for it (under ``short_name``), pulled and recorded the first time. Raises
    ConfigError when that name is taken by another model, and the hub's errors."""
    if not is_hub_url(name):
        return name
    known = recorded(name, load_registry(models))
    if known is not None:
        return known
    name = _as_hf(name)
    short = short_name(name)
    if models is not None:
        raise InvalidRequestError(f"{name}: with --models, add it to that file first "
                                  "(a hub URL is recorded in your own models.toml)")
    where, got, _ = add(short, name, progress=progress)
    sys.stderr.write(f"everycycle: pulled {repo_path(got.path, got.commit)} (revision "
                     f"{got.commit}) as '{short}' into {where}\n")
    return short


@dataclass(frozen=True, slots=True)
class PullPlan:
    """What pulling a name or URL downloads: a label for progress, the pinned sha256 if
    known, and the download itself (blocking: run it on a worker thread)."""

    label: str
    sha256: str | None
    _run: Callable[[hub.Progress | None, bool], Path] = field(repr=False)

    def run(self, on_progress: hub.Progress | None = None, *, progress: bool = False
            ) -> Path:
        """Download what is missing; the local file (a split GGUF's first part).
        ``on_progress`` hears (bytes done, total); ``progress`` draws a bar on stderr."""
        return self._run(on_progress, progress)


def plan_pull(given: str, registry: Registry) -> PullPlan:
    """The pull of ``given``: ``hf://owner/repo[:QUANT][@rev]`` (a repo by
    quantization), ``hf://owner/repo/file.gguf[@rev]`` (one file), Ollama's
    ``hf.co/…``, or a registry name. Raises InvalidRequestError for a malformed URL,
    UnknownModelError for an unknown name."""
    if is_hub_url(given):
        url = _as_hf(given)
        by_quant = hubrepo.parse_repo_url(url)
        if by_quant is not None:
            def by_repo(report: hub.Progress | None, bar: bool) -> Path:
                tell = None if report is None else (
                    lambda _part, done, total: report(done, total))
                return hubrepo.pull(by_quant, progress=bar, on_progress=tell).path

            return PullPlan(by_quant.url, None, by_repo)
        ref = hub.parse_hf_url(url)
        return PullPlan(ref.file, None, lambda report, bar: hub.download(
            ref, progress=bar, on_progress=report))
    spec = registry.get(given)
    if spec.hf_repo is None:
        return PullPlan(given, spec.sha256, lambda report, bar: local_file(spec))
    return PullPlan(spec.hf_file or given, spec.sha256, lambda report, bar: hub_files(
        spec, download=True, progress=bar, on_progress=report)[0])


@dataclass(frozen=True, slots=True)
class Removed:
    """What ``remove`` did: the models.toml it changed, and with ``purge`` the files it
    deleted, the bytes freed, and the entries whose files it kept (they share them)."""

    where: Path
    files: int = 0
    freed: int = 0
    shared: tuple[str, ...] = ()


def remove(name: str, *, purge: bool = False) -> Removed:
    """Remove model ``name`` from the user's models.toml; with ``purge``, its downloaded
    files too, unless another entry uses them. Raises UnknownModelError for an unknown
    name, ConfigError for an entry not in the user's file (nothing is removed), and
    InvalidRequestError for ``purge`` of a model that is not a download."""
    from .. import paths
    from .userfile import remove_user_entry

    registry = load_registry()
    spec = registry.models.get(name)
    mine = paths.user_models_file()
    if spec is None:
        raise UnknownModelError(f"model '{name}' not found")
    if spec.origin.resolve() != mine.resolve():
        origin = ("shipped with everycycle" if spec.origin.resolve() == SHIPPED_MODELS.resolve()
                  else f"defined in {spec.origin}")
        raise ConfigError(f"model '{name}' is {origin}, not in your models.toml ({mine}): it "
                          "cannot be removed (an entry of yours with its name overrides it)")
    files: list[Path] = []
    shared: tuple[str, ...] = ()
    if purge:
        if spec.hf_repo is None:
            raise InvalidRequestError(f"'{name}' is {spec.source}, not a download: --purge "
                                      "deletes only files from the hub cache (nothing was "
                                      "removed)")
        shared = tuple(m.name for m in registry.models.values() if m.name != name
                       and (m.hf_repo, m.hf_file, m.revision)
                       == (spec.hf_repo, spec.hf_file, spec.revision))
        if not shared:
            try:
                files = hub_files(spec)
            except EverycycleError:
                files = []  # (not downloaded: nothing to delete)
            if spec.mmproj is not None and spec.mmproj.startswith("hf:"):
                try:
                    files += [p for p in [projector_file(spec)] if p is not None]
                except EverycycleError:
                    pass
    where = remove_user_entry(name)
    return Removed(where, len(files), sum(hub.delete_cached(f) for f in files), shared)
