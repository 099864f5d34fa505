"""A model's cached prefixes on disk, across unloads and restarts.

When a model is unloaded (evicted to make room, idle, ``unload``, ``stop``), each slot's
KV cells — llama.cpp's per-sequence state — are saved with the tokens they hold; when a
prompt later extends a saved prefix further than any slot's cache does, the state is
restored into the slot instead of prefilled. A conversation swapped out does not pay
its whole prefill again (llama-server loses it; hearth-llm exists to keep it).

Entries live under ``<cache_dir>/kv/<key>/``, one file each (a header with the tokens,
then the state). The key is the GGUF file's identity (real path, size, mtime, inode)
and the context's settings (tokens a slot, KV type, the llama.cpp build): an entry of a
file that changed is never used. A store holds at most ``limit`` bytes; the least
recently used entries go first. Files are written whole (statefile.replace).

A saved state is trusted only when it proves itself: its header names the store it
belongs to and carries a SHA-256 of that store key, its tokens and the state's bytes,
checked before the state goes near llama.cpp. A flipped byte, a truncated file or one
copied from another store is removed with one warning and the prompt is prefilled; a
wrong answer from a damaged cache is never an option.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ... import statefile
from ..core.jobs import common_prefix

log = logging.getLogger(__name__)

MAGIC = b"everycycle-kv 2\n"
"""(Version 1 files, with no checksum, are never read; the store's limit ages them out.)"""
MIN_TOKENS = 32
"""Prefixes shorter than this are not worth a file (or a restore)."""


@dataclass(frozen=True, slots=True)
class Entry:
    path: Path
    tokens: tuple[int, ...]


def store_key(gguf: Path, *parts: object) -> str:
    """The store of ``gguf`` (as it is now) for a context described by ``parts``."""
    real = gguf.resolve()
    st = real.stat()
    ident = [str(real), st.st_size, st.st_mtime_ns, st.st_ino, *parts]
    return hashlib.sha256(json.dumps(ident, default=str).encode()).hexdigest()[:32]


class KVDisk:
    """One model's saved prefixes (its prompt cache's disk tier: promptcache.py). Any
    thread: the files are read and written outside the lock that guards the list."""

    def __init__(self, root: Path, key: str, limit: int) -> None:
        self.key = key
        self.dir = root / "kv" / key
        self.root = root / "kv"
        self.limit = limit
        self.entries: list[Entry] = []
        self._lock = threading.Lock()
        with contextlib.suppress(OSError):
            for tmp in self.dir.glob(".*.tmp"):  # a save cut short (its engine killed)
                tmp.unlink()
            for f in sorted(self.dir.glob("*.kv")):
                tokens = self._header(f)
                if tokens is not None:
                    self.entries.append(Entry(f, tokens))

    @staticmethod
    def _header(path: Path) -> tuple[int, ...] | None:
        try:
            with path.open("rb") as f:
                return _read_header(f)[0]
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return None

    def _digest(self, tokens: Sequence[int], state: Any) -> str:
        h = hashlib.sha256(self.key.encode() + b"\n")
        h.update(json.dumps(list(tokens)).encode() + b"\n")
        h.update(state)
        return h.hexdigest()

    def best(self, tokens: Sequence[int], better_than: int) -> Entry | None:
        """The entry sharing the longest prefix with ``tokens``, if it shares more than
        ``better_than`` tokens (and at least MIN_TOKENS)."""
        with self._lock:
            found = max(self.entries, key=lambda e: common_prefix(e.tokens, tokens),
                        default=None)
        if found is None:
            return None
        shared = common_prefix(found.tokens, tokens)
        return found if shared >= MIN_TOKENS and shared > better_than else None

    def load(self, entry: Entry) -> bytes | None:
        """``entry``'s state (its file marked used now), or None when it is unreadable
        or fails its checks (then the file is removed, with a warning)."""
        try:
            with entry.path.open("rb") as f:
                tokens, store, digest = _read_header(f)
                data = f.read()
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            tokens, store, digest, data = (), "", "", b""
        if (tokens != entry.tokens or store != self.key
                or digest != self._digest(tokens, data)):
            log.warning("a cached prefix in %s failed its checksum (damaged, cut short or "
                        "from another model); removed, the prompt is computed instead",
                        entry.path)
            self.forget(entry)
            with contextlib.suppress(OSError):
                entry.path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(entry.path)
        return data

    def forget(self, entry: Entry) -> None:
        """Never offer ``entry`` again."""
        with self._lock:
            if entry in self.entries:
                self.entries.remove(entry)

    def has(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` are saved exactly."""
        key = tuple(tokens)
        with self._lock:
            return any(e.tokens == key for e in self.entries)

    def save(self, tokens: Sequence[int], state: Any) -> None:
        """Keep ``state`` (the KV cells of ``tokens``: bytes, or the ctypes array
        llama.cpp wrote), replacing an entry it extends; then trim the whole store to
        its limit. Never raises (a cache is optional)."""
        state = memoryview(state).cast("B")
        if len(tokens) < MIN_TOKENS or not state or len(state) > self.limit:
            return
        name = hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:24] + ".kv"
        header = json.dumps({"tokens": list(tokens), "store": self.key,
                             "sha256": self._digest(tokens, state)}).encode()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            statefile.replace(self.dir / name, b"".join(
                (MAGIC, struct.pack("<Q", len(header)), header, state)))
        except OSError as exc:
            log.warning("cannot keep a cached prefix in %s: %s", self.dir, exc)
            return
        keep = tuple(tokens)
        with self._lock:
            for old in list(self.entries):  # a shorter prefix of the same conversation
                if old.tokens == keep[:len(old.tokens)] and old.path.name != name:
                    with contextlib.suppress(OSError):
                        old.path.unlink()
                    self.entries.remove(old)
            self.entries = [e for e in self.entries if e.path.name != name]
            self.entries.append(Entry(self.dir / name, keep))
            self._trim()

    def _trim(self) -> None:
        """(Under the lock.) Remove the least recently used files of every store until all fit the limit."""
        files = []
        with contextlib.suppress(OSError):
            for f in self.root.glob("*/*.kv"):
                with contextlib.suppress(OSError):
                    st = f.stat()
                    files.append((st.st_mtime_ns, st.st_size, f))
        total = sum(size for _, size, _ in files)
        for _, size, f in sorted(files):
            if total <= self.limit:
                break
            with contextlib.suppress(OSError):
                f.unlink()
                total -= size
                self.entries = [e for e in self.entries if e.path != f]


def _read_header(f: BinaryIO) -> tuple[tuple[int, ...], str, str]:
    """(tokens, store key, checksum) from a file's header; raises ValueError (or OSError,
    KeyError, TypeError, struct.error) when there is no such header."""
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a saved state")
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    return (tuple(int(t) for t in header["tokens"]), str(header["store"]),
            str(header["sha256"]))


def restore_sequence(L: object, ctx: object, mem: object, seq: int, state: Any) -> bool:
    """Put ``state`` (bytes, or the ctypes array llama.cpp wrote) into sequence ``seq``
    of ``ctx`` (emptied first); False when llama.cpp refuses it (then the sequence is
    empty)."""
    import ctypes

    lib: Any = L
    lib.llama_memory_seq_rm(mem, seq, -1, -1)
    buf = ((ctypes.c_uint8 * len(state)).from_buffer_copy(state)
           if isinstance(state, bytes) else state)
    if int(lib.llama_state_seq_set_data(ctx, buf, len(state), seq)) == 0:
        lib.llama_memory_seq_rm(mem, seq, -1, -1)
        return False
    return True
