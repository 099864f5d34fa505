"""Hugging Face hub access: pinned, verified downloads into the shared HF cache.

Files go where every other tool looks for them (``HF_HUB_CACHE`` / ``HF_HOME``), read
at call time; ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` are respected. huggingface-hub
resumes an interrupted download from its ``.incomplete`` file. A sha256 pin is checked
after download and remembered per file (size + mtime), so a verified 300 MB file is
not hashed again on every load. A mismatch deletes nothing; the model is not used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, cast

from .. import paths, statefile
from ..errors import (
    ChecksumMismatchError,
    FileBusyError,
    HubUnreachableError,
    InternalError,
    InvalidRequestError,
)

_HF_URL = re.compile(r"hf://(?P<repo>[^/@\s]+/[^/@\s]+)/(?P<file>[^@\s]+?)(?:@(?P<rev>[^@\s]+))?")


@dataclass(frozen=True, slots=True)
class HubRef:
    """A file in a hub repo, optionally at a revision (a commit sha pins it)."""

    repo: str
    file: str
    revision: str | None = None

    @property
    def url(self) -> str:
        """``hf://owner/repo/file[@revision]``."""
        return f"hf://{self.repo}/{self.file}" + (f"@{self.revision}" if self.revision else "")


_REPO_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_REVISION = re.compile(r"[A-Za-z0-9._/-]{1,255}")


def parse_hf_url(url: str) -> HubRef:
    """``hf://owner/repo/path/file.gguf[@revision]``. Raises InvalidRequestError, also
    for a path that would leave the repo (``..``, an absolute or empty segment)."""
    m = _HF_URL.fullmatch(url)
    if m is None:
        raise InvalidRequestError(f"not a hub URL: {url!r} (want hf://owner/repo/file.gguf[@rev])")
    repo, file, rev = m["repo"], m["file"], m["rev"]
    if not all(_REPO_PART.fullmatch(part) and ".." not in part for part in repo.split("/")):
        raise InvalidRequestError(f"{url!r}: {repo!r} is not a hub repo id (owner/name of "
                                  "letters, digits, '.', '_' and '-')")
    segments = file.split("/")
    if any(seg in ("", ".", "..") for seg in segments) or "\\" in file or any(
            ord(c) < 0x20 for c in file):
        raise InvalidRequestError(f"{url!r}: the file path must stay inside the repo "
                                  "(no '..', '.' or empty segments)")
    if rev is not None and (not _REVISION.fullmatch(rev) or ".." in rev):
        raise InvalidRequestError(f"{url!r}: {rev!r} is not a revision (a commit, tag or branch)")
    return HubRef(repo, file, rev)


def cache_dir() -> Path:
    """The HF hub cache, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return Path(home) / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached_file(ref: HubRef, *, sha256: str | None = None, name: str | None = None) -> Path:
    """The cached, verified file of ``ref``, with no network access.

    Raises InvalidRequestError when it is not in the cache (telling the user to pull
    ``name``, or the URL) and ChecksumMismatchError when it does not match ``sha256``.
    """
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(ref.repo, ref.file, revision=ref.revision,
                                   cache_dir=str(cache_dir()))
    if not isinstance(found, str):
        what = f"model '{name}'" if name else ref.url
        raise InvalidRequestError(
            f"{what} is not downloaded yet: run `everycycle pull {name or ref.url}`"
        )
    path = Path(found)
    if sha256:
        verify(path, sha256)
    return path


_OFFLINE_HINT = ("offline, use a model already downloaded (`everycycle models` says which) "
                 "or a local GGUF (`path = ...` in models.toml)")
REACH_TIMEOUT = 3.0


def check_reachable(where: str) -> None:
    """Fail fast, in one line, when the hub's host cannot be reached at all: not after
    the hub library's retries (about 24 s of "Retrying in 8s")."""
    import socket
    import urllib.parse

    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urllib.parse.urlsplit(endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=REACH_TIMEOUT):
            pass
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        if isinstance(exc, socket.gaierror):
            why = "its name does not resolve"
        raise HubUnreachableError(f"{where}: cannot reach {host}:{port} ({why}): a network "
                                  f"problem; {_OFFLINE_HINT}") from None


@contextlib.contextmanager
def repo_errors(where: str) -> Iterator[None]:
    """The hub's answers about a repo (gated, missing, no such revision) as one-line
    InvalidRequestErrors naming ``where``."""
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except GatedRepoError:
        raise InvalidRequestError(f"{where}: the repo is gated; log in with `hf auth login`"
                                  ) from None
    except RepositoryNotFoundError:
        raise InvalidRequestError(f"{where}: no such repository on the hub") from None
    except RevisionNotFoundError:
        raise InvalidRequestError(f"{where}: no such revision") from None


Progress = Callable[[int, int | None], None]
"""Told (bytes done, total bytes if known) as a download moves, on the downloading thread."""


def download(ref: HubRef, *, sha256: str | None = None, progress: bool = False,
             on_progress: Progress | None = None) -> Path:
    """Download ``ref`` into the HF cache (resuming a partial file) and verify it; with
    ``on_progress``, tell it how far the download is (the HTTP API's pull).

    Raises InvalidRequestError for an unknown repo, file or revision or when offline
    and not cached, ChecksumMismatchError for a bad file, InternalError when the hub
    cannot be reached.
    """
    import httpx2
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    bar: Any = (_reporting(on_progress) if on_progress is not None
                else _RichBar if progress else _SilentBar)
    where = ref.url
    if not offline():
        check_reachable(where)
    try:
        with repo_errors(where):
            found = hf_hub_download(
                ref.repo, ref.file, revision=ref.revision, cache_dir=str(cache_dir()),
                endpoint=os.environ.get("HF_ENDPOINT") or None, local_files_only=offline(),
                tqdm_class=cast(Any, bar),
            )
    except LocalEntryNotFoundError as exc:
        if offline():
            raise InvalidRequestError(
                f"{where} is not in the cache and the hub is offline (HF_HUB_OFFLINE); "
                "pull it while online"
            ) from None
        cause = exc.__cause__ or exc.__context__ or exc
        raise HubUnreachableError(f"{where}: cannot reach the hub ({cause}) and it is not "
                                  f"cached; {_OFFLINE_HINT}") from None
    except EntryNotFoundError:
        raise InvalidRequestError(f"{where}: no such file in the repository") from None
    except (OSError, httpx2.HTTPError) as exc:  # unreachable hub, a broken transfer, disk
        raise InternalError(f"{where}: download failed: {type(exc).__name__}: {exc}") from None
    path = Path(str(found))
    if sha256:
        verify(path, sha256)
    return path


def delete_cached(path: Path) -> int:
    """Delete a cached snapshot file and the blob it links to (the HF cache's layout);
    the bytes freed. A file outside the cache is refused (InvalidRequestError)."""
    root = cache_dir().resolve()
    blob = path.resolve()
    if not blob.is_relative_to(root) or "snapshots" not in path.parts:
        raise InvalidRequestError(f"{path} is not in the hub cache ({root}): not deleted")
    size = blob.stat().st_size if blob.exists() else 0
    for p in {path, blob}:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return size


def commit_of(path: Path) -> str | None:
    """The commit a cached snapshot file belongs to (``…/snapshots/<commit>/file``)."""
    parts = path.parts
    if "snapshots" in parts:
        i = parts.index("snapshots")
        if i + 1 < len(parts):
            return parts[i + 1]
    return None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(path: Path, expected: str) -> None:
    """Check ``path`` against ``expected`` (remembered once verified).

    Raises ChecksumMismatchError naming both hashes; the file is left in place.
    """
    real = path.resolve()
    st = real.stat()
    if _read_memo(_memo_path()).get(str(real)) == [st.st_size, st.st_mtime_ns, expected]:
        return
    actual = sha256_of(real)
    if actual != expected:
        raise ChecksumMismatchError(
            f"{path}: sha256 is {actual}, but the registry pins {expected}; "
            "the file was not used (nothing was deleted)"
        )
    _remember(real, st, actual)


def file_sha256(path: Path) -> str:
    """``path``'s sha256: from the memo of verified files while the file is unchanged
    (by size and mtime), else read (and remembered)."""
    real = path.resolve()
    st = real.stat()
    stamp = _read_memo(_memo_path()).get(str(real))
    if isinstance(stamp, list) and len(stamp) == 3 and stamp[:2] == [st.st_size,
                                                                     st.st_mtime_ns]:
        return str(stamp[2])
    digest = sha256_of(real)
    _remember(real, st, digest)
    return digest


def _memo_path() -> Path:
    return paths.state_dir() / "verified.json"


def _remember(real: Path, st: os.stat_result, digest: str) -> None:
    # (a memo that cannot be kept costs a re-hash next time, nothing more)
    memo_path = _memo_path()
    with contextlib.suppress(OSError, FileBusyError), statefile.locked(memo_path):
        memo = _read_memo(memo_path)  # afresh, under the lock: others' entries kept
        memo[str(real)] = [st.st_size, st.st_mtime_ns, digest]
        statefile.replace(memo_path, json.dumps(memo))


def _read_memo(memo_path: Path) -> dict[str, Any]:
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def verified_path(expected: str) -> Path | None:
    """A file verified before to have sha256 ``expected`` and unchanged since (by size
    and mtime), without reading it; None when there is none."""
    for key, stamp in _read_memo(_memo_path()).items():
        if isinstance(stamp, list) and len(stamp) == 3 and stamp[2] == expected:
            with contextlib.suppress(OSError):
                st = Path(key).stat()
                if [st.st_size, st.st_mtime_ns] == stamp[:2]:
                    return Path(key)
    return None


class _SilentBar:
    """A progress bar that shows nothing (stderr is not a terminal)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _reporting(report: Progress) -> type[_SilentBar]:
    """A progress "bar" class that tells ``report`` instead of drawing."""

    class _Reporting(_SilentBar):
        def __init__(self, *args: object, total: int | None = None, initial: int = 0,
                     **kwargs: object) -> None:
            self.total = total
            self.done = initial
            report(initial, total)

        def update(self, n: float = 1) -> None:
            self.done += int(n)
            report(self.done, self.total)

    return _Reporting


class _RichBar(_SilentBar):
    """A Rich progress bar on stderr: bytes, speed, ETA."""

    def __init__(self, *args: object, total: int | None = None, initial: int = 0,
                 desc: str = "", **kwargs: object) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
        )
        self._progress.start()
        self._task = self._progress.add_task(desc or "download", total=total, completed=initial)

    def update(self, n: float = 1) -> None:
        self._progress.advance(self._task, n)

    def close(self) -> None:
        self._progress.stop()

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolved(source: str, sha256: str | None, *, fetch: bool, what: str,
             name: str | None = None) -> Path:
    """The file ``source`` names — a path, or an ``hf://`` URL — on disk and checked
    against ``sha256``; a hub one from the HF cache, downloaded first with ``fetch``
    unless offline. Raises InvalidRequestError (``what`` names a missing file; ``name``
    the model to pull) or ChecksumMismatchError naming both hashes."""
    if not source.startswith("hf:"):
        path = Path(source)
        if not path.is_file():
            raise InvalidRequestError(f"{what} {path} is not a file")
        if sha256:
            verify(path, sha256)
        return path
    ref = parse_hf_url(source)
    try:
        return cached_file(ref, sha256=sha256, name=name)
    except ChecksumMismatchError:
        raise
    except InvalidRequestError:
        if not fetch or offline():
            raise
    return download(ref, sha256=sha256)
