"""Model management in one place: a hub URL fetched (by quantization or one file) and
recorded, pinned, in the user's models.toml; a hub URL given as a model name resolved to
its entry, pulling it the first time (``run -m hf://owner/repo:Q8_0``).

``models add`` and ``run``/``chat``/``launch -m hf://…`` all go through here.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, InvalidRequestError
from . import hub, hubrepo


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


def add(name: str, url: str, *, context: int = 4096, parallel: int = 4,
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
        "revision": got.commit, "sha256": digest, "context": context, "parallel": parallel,
        **({"mmproj": f"hf://{got.repo}/{repo_path(got.projector, got.commit)}@{got.commit}",
            "mmproj_sha256": hub.sha256_of(got.projector)} if got.projector else {}),
    })
    return where, got, digest


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
    """``hf://owner/repo[:QUANT]``, or Ollama's ``hf.co/owner/repo[:QUANT]``."""
    return name.startswith(("hf://", *_HUB_HOSTS))


def _as_hf(name: str) -> str:
    for host in _HUB_HOSTS:
        if name.startswith(host):
            return "hf://" + name.removeprefix(host)
    return name


def resolve(name: str, models: Path | None = None, *, progress: bool = False) -> str:
    """The registry name for ``name``: itself, unless it is a hub URL; then the entry
    recorded for it (under ``short_name``), pulled and recorded the first time. Raises
    ConfigError when that name is taken by another model, and the hub's errors."""
    if not is_hub_url(name):
        return name
    from .registry import load_registry

    name = _as_hf(name)
    short = short_name(name)
    spec = load_registry(models).models.get(short)
    wanted = (hubrepo.parse_repo_url(name) or hub.parse_hf_url(name)).repo
    if spec is not None:
        if spec.hf_repo != wanted:
            raise ConfigError(f"model '{short}' is already {spec.source}, not {name}: "
                              f"add this one under another name (everycycle models add "
                              f"NAME {name})")
        return short
    if models is not None:
        raise InvalidRequestError(f"{name}: with --models, add it to that file first "
                                  "(a hub URL is recorded in your own models.toml)")
    where, got, _ = add(short, name, progress=progress)
    sys.stderr.write(f"everycycle: pulled {repo_path(got.path, got.commit)} (revision "
                     f"{got.commit}) as '{short}' into {where}\n")
    return short
