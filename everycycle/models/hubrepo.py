"""Pulling a hub repo by quantization: ``hf://owner/repo[:QUANT][@REV]``.

As llama-server's ``-hf owner/repo:quant``: the repo's file list (at a revision, pinned
to the commit it resolves to) names its GGUFs; the one whose name carries QUANT is
chosen (default: Q4_K_M, else the smallest of at least 4 bits). Vision projectors
(``mmproj``) are not models. A split GGUF (``name-00001-of-00003.gguf``) is one
choice: every part is downloaded into the same snapshot, and llama.cpp loads it from
the first. A repo's vision projector (``mmproj-*.gguf``) comes along. Offline, the list
comes from what the cache holds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .. import statefile
from ..errors import HubUnreachableError, InternalError, InvalidRequestError
from . import hub

_REPO_URL = re.compile(r"hf://(?P<repo>[^/@:\s]+/[^/@:\s]+)(?::(?P<quant>[A-Za-z0-9_]+))?"
                       r"(?:@(?P<rev>[^@\s]+))?")
SPLIT = re.compile(r"(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf", re.IGNORECASE)
_QUANT = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Za-z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|"
                    r"F16|FP16|F32)(?![A-Za-z0-9])", re.IGNORECASE)
DEFAULT_QUANT = "Q4_K_M"


@dataclass(frozen=True, slots=True)
class RepoRef:
    """A hub repo, a quantization wanted from it (None: the default rule), a revision."""

    repo: str
    quant: str | None = None
    revision: str | None = None

    @property
    def url(self) -> str:
        return (f"hf://{self.repo}" + (f":{self.quant}" if self.quant else "")
                + (f"@{self.revision}" if self.revision else ""))


def parse_repo_url(url: str) -> RepoRef | None:
    """``hf://owner/repo[:QUANT][@REV]`` (no file named); None for anything else."""
    m = _REPO_URL.fullmatch(url)
    if m is None:
        return None
    # The repo and revision follow the rules of a file URL (nothing outside the repo).
    ref = hub.parse_hf_url(f"hf://{m['repo']}/x.gguf" + (f"@{m['rev']}" if m["rev"] else ""))
    return RepoRef(ref.repo, m["quant"], ref.revision)


@dataclass(frozen=True, slots=True)
class Choice:
    """One model file of a repo: its parts (one unless split), quantization, size."""

    parts: tuple[str, ...]
    quant: str | None
    size: int | None

    @property
    def first(self) -> str:
        return self.parts[0]


def quant_of(name: str) -> str | None:
    """The quantization a GGUF's name carries (``Q4_K_M``, ``IQ4_XS``, ``F16``), upper-case."""
    base = Path(name).name
    split = SPLIT.fullmatch(base)
    stem = split["stem"] if split else re.sub(r"\.gguf$", "", base, flags=re.IGNORECASE)
    found = _QUANT.findall(stem)
    return found[-1].upper() if found else None


def bits(quant: str) -> int:
    """Bits per weight a quantization's name says (Q4_K_M: 4, F16: 16)."""
    if quant in ("F16", "BF16", "FP16"):
        return 16
    if quant == "F32":
        return 32
    digits = re.search(r"\d+", quant)
    return int(digits[0]) if digits else 16


def choices(files: Iterable[tuple[str, int | None]]) -> list[Choice]:
    """The repo's model files from (name, size) pairs: GGUFs but projectors, each split
    GGUF once (all its parts present, or an InvalidRequestError)."""
    singles: list[Choice] = []
    splits: dict[tuple[str, str], dict[int, tuple[str, int | None]]] = {}
    for name, size in files:
        base = Path(name).name.lower()
        if not base.endswith(".gguf") or "mmproj" in base:
            continue
        split = SPLIT.fullmatch(name)
        if split is None:
            singles.append(Choice((name,), quant_of(name), size))
        else:
            splits.setdefault((split["stem"], split["n"]), {})[int(split["i"])] = (name, size)
    for (stem, n), found in splits.items():
        count = int(n)
        missing = [i for i in range(1, count + 1) if i not in found]
        if missing:
            raise InvalidRequestError(f"{stem}: a GGUF split in {count} parts lacks part "
                                      f"{missing[0]} in this repository")
        parts = tuple(found[i][0] for i in range(1, count + 1))
        sizes = [found[i][1] for i in range(1, count + 1)]
        total = None if any(s is None for s in sizes) else sum(s or 0 for s in sizes)
        singles.append(Choice(parts, quant_of(parts[0]), total))
    return sorted(singles, key=lambda c: c.first)


def choose(ref: RepoRef, found: list[Choice], commit: str) -> Choice:
    """The file ``ref`` names among ``found``. Raises InvalidRequestError, in one line."""
    where = f"hf://{ref.repo}@{commit[:12]}"
    if not found:
        raise InvalidRequestError(f"{where} has no GGUF file: not a repository of llama.cpp "
                                  "models (look for one whose name ends in -GGUF)")
    have = ", ".join(sorted({c.quant or c.first for c in found}))
    if ref.quant is not None:
        wanted = ref.quant.upper()
        named = [c for c in found if c.quant == wanted]
        if not named:
            raise InvalidRequestError(f"{where} has no {wanted} GGUF (it has {have})")
        return min(named, key=_smallest)
    default = [c for c in found if c.quant == DEFAULT_QUANT]
    if default:
        return min(default, key=_smallest)
    enough = [c for c in found if c.quant is not None and bits(c.quant) >= 4]
    if enough:
        return min(enough, key=lambda c: (bits(c.quant or ""), *_smallest(c)))
    if len(found) == 1:
        return found[0]
    raise InvalidRequestError(f"{where}: no {DEFAULT_QUANT} or other GGUF of 4 bits or more; "
                              f"name one (it has {have}): hf://{ref.repo}:QUANT")


def _smallest(c: Choice) -> tuple[int, str]:
    return (c.size if c.size is not None else 1 << 62, c.first)


def listing(ref: RepoRef) -> tuple[str, list[tuple[str, int | None]]]:
    """The commit ``ref``'s revision resolves to and the (name, size) of its files: from
    the hub, or from the cache when offline (HF_HUB_OFFLINE)."""
    if hub.offline():
        return _cached_listing(ref)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    hub.check_reachable(ref.url)
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        with hub.repo_errors(ref.url):
            info = api.model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except (HfHubHTTPError, OSError) as exc:
        raise HubUnreachableError(f"{ref.url}: cannot list the repository: {exc}") from None
    except (ValueError, KeyError, TypeError) as exc:  # a bad answer
        raise InternalError(f"{ref.url}: cannot list the repository: "
                            f"{type(exc).__name__}: {exc}") from None
    if not info.sha:
        raise InternalError(f"{ref.url}: the hub did not say which commit this is")
    return info.sha, [(s.rfilename, s.size) for s in info.siblings or ()]


def _repo_cache(ref: RepoRef) -> Path:
    return hub.cache_dir() / f"models--{ref.repo.replace('/', '--')}"


def _remember(ref: RepoRef, commit: str) -> None:
    """Record what ``ref``'s revision resolved to, in the cache's ``refs/`` as the hub
    library does for a branch or tag, so that an offline pull finds the same files."""
    refs = _repo_cache(ref) / "refs" / (ref.revision or "main")
    try:
        statefile.replace(refs, commit, mode=0o644)  # (whole: another pull may read it)
    except OSError:  # (only offline pulls by quantization miss it)
        pass


def _cached_listing(ref: RepoRef) -> tuple[str, list[tuple[str, int | None]]]:
    base = _repo_cache(ref)
    rev = ref.revision or "main"
    commit = rev
    refs = base / "refs" / rev
    if refs.is_file():
        commit = refs.read_text().strip()
    snapshot = base / "snapshots" / commit
    if not snapshot.is_dir():
        raise InvalidRequestError(f"{ref.url} is not in the cache and the hub is offline "
                                  "(HF_HUB_OFFLINE); pull it while online")
    files: list[tuple[str, int | None]] = [(str(p.relative_to(snapshot)), p.stat().st_size)
                                           for p in sorted(snapshot.rglob("*")) if p.is_file()]
    return commit, files


def projector(files: Iterable[tuple[str, int | None]], quant: str | None) -> str | None:
    """The repo's vision projector (``mmproj*.gguf``) to go with a model of ``quant``:
    the one of that quantization, else F16, else BF16, else the smallest; None: none."""
    found = [(n, size) for n, size in files
             if Path(n).name.lower().startswith("mmproj") and n.lower().endswith(".gguf")]
    if not found:
        return None
    for wanted in (quant, "F16", "BF16"):
        named = [n for n, _ in found if wanted is not None and quant_of(n) == wanted]
        if named:
            return min(named)
    return min(found, key=lambda f: (f[1] if f[1] is not None else 1 << 62, f[0]))[0]


@dataclass(frozen=True, slots=True)
class Pulled:
    """A repo pull's result: the commit, the chosen file and its parts on disk, and the
    repo's vision projector if it has one."""

    commit: str
    choice: Choice
    paths: tuple[Path, ...]
    projector: Path | None = None

    @property
    def path(self) -> Path:
        """What llama.cpp loads (a split GGUF's first part)."""
        return self.paths[0]


def pull(ref: RepoRef, *, progress: bool = False,
         on_progress: Callable[[str, int, int | None], None] | None = None) -> Pulled:
    """Choose ``ref``'s file and download every part of it, pinned to the commit.
    ``on_progress`` hears (part, bytes done, total)."""
    commit, files = listing(ref)
    choice = choose(ref, choices(files), commit)
    if not hub.offline() and (ref.revision or "main") != commit:
        _remember(ref, commit)
    got = []
    for part in choice.parts:
        report = None
        if on_progress is not None:
            def report(done: int, total: int | None, part: str = part) -> None:
                on_progress(part, done, total)
        got.append(hub.download(hub.HubRef(ref.repo, part, commit), progress=progress,
                                on_progress=report))
    mmproj = projector(files, choice.quant)
    extra = (hub.download(hub.HubRef(ref.repo, mmproj, commit), progress=progress)
             if mmproj is not None else None)
    return Pulled(commit, choice, tuple(got), extra)
