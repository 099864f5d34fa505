"""Files we write that must survive concurrent writers and ``kill -9``.

Every file under the config and state dirs (keys.json, models.toml, the verified-file
memo, the CPU-kernel verdict, chat history, the audit log) is changed only here:

- ``locked(path)``: an exclusive ``fcntl.flock`` on a sibling lock file
  (``.NAME.lock``) around a read-modify-write. The holder writes its pid there, so a
  writer that cannot get the lock within ``timeout`` seconds raises
  :class:`~everycycle.errors.FileBusyError` naming who holds it, having changed nothing.
  A lock dies with its process: a writer killed mid-way never leaves a stale lock.
- ``replace(path, data)``: the new content in a temporary file in the same directory,
  fsynced, then renamed over the old one (and the directory fsynced), so a reader sees
  the old file or the new one, whole, never a torn one.
- ``append(path, line)``: one whole line, one ``write`` under the lock, rotation
  (``path.1``) under the same lock.

Ground layer: no imports from the rest of the package but errors.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .errors import FileBusyError

LOCK_TIMEOUT = 5.0
"""How long a writer waits for another's lock before it gives up (seconds)."""


def lock_path(path: Path) -> Path:
    """The sibling lock file of ``path``."""
    return path.with_name(f".{path.name}.lock")


def _holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        os.lseek(fd, 0, os.SEEK_SET)
        pid = int(os.read(fd, 32).decode("ascii").strip() or "0")
        if pid > 0:
            return f"pid {pid}"
    return "another process"


@contextlib.contextmanager
def locked(path: Path, *, timeout: float = LOCK_TIMEOUT, mode: int = 0o600) -> Iterator[None]:
    """Hold the exclusive lock of ``path`` for a read-modify-write.

    Raises FileBusyError when another process holds it for longer than ``timeout``
    seconds, and OSError when the lock file cannot be created.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, mode)
    try:
        give_up = time.monotonic() + timeout
        pause = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= give_up:
                    raise FileBusyError(
                        f"{path} is being changed by {_holder(fd)} (its lock "
                        f"{lock_path(path)} was held for over {timeout:g} s); "
                        "nothing was changed") from None
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # (releases the lock)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace(path: Path, data: bytes | str, *, mode: int | None = None) -> None:
    """Make ``data`` the content of ``path`` atomically and durably, with ``mode`` (None:
    the old file's, or 0600 for a new one). Callers that read the old content first
    hold ``locked(path)``. Raises OSError (nothing changed)."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = path.stat().st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o600
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def write(path: Path, data: bytes | str, *, mode: int | None = None,
          timeout: float = LOCK_TIMEOUT) -> None:
    """``replace`` under the lock: a whole-file write that needs no read first. Raises
    FileBusyError or OSError (nothing changed)."""
    with locked(path, timeout=timeout):
        replace(path, data, mode=mode)


def append(path: Path, line: str, *, max_bytes: int | None = None,
           timeout: float = LOCK_TIMEOUT) -> None:
    """Append ``line`` (a newline is added) as one write, under the lock; at
    ``max_bytes`` the file first moves to ``path.1``. Raises FileBusyError or OSError."""
    raw = line.encode("utf-8") + b"\n"
    with locked(path, timeout=timeout):
        if max_bytes is not None:
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_size >= max_bytes:
                    os.replace(path, path.with_name(path.name + ".1"))
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            written = os.write(fd, raw)
            if written != len(raw):  # a full disk: take the part back, keep lines whole
                os.ftruncate(fd, size)
                raise OSError(28, "short write (disk full?)")
        finally:
            os.close(fd)
