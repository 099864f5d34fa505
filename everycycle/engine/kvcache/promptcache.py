"""A model's prompt cache beyond its slots: conversations a slot gave up, kept in host
RAM and spilled to disk, restored into whichever slot serves a prompt that extends one.

A slot holds one conversation. When a request of another conversation takes it (an
agent's side request, a second session), the slot's KV state is copied here first
(``keep``), least recently used entries going first when the RAM limit is passed — to
the disk store (kvdisk.py) when there is one, on a writer thread of its own, so the
decode loop never waits for a disk. A prompt then restores the longest prefix any
entry, in RAM or on disk, shares with it (``best``) when that beats every free slot.
At unload what RAM holds goes to disk too (``spill``), newest first, as far as the disk
store's limit allows: a swap or a restart keeps it.

States are copied out of the context on the engine thread; RAM's bookkeeping is under
a lock (``drop_ram`` comes from another thread when another model's load needs the
memory), and the disk store has its own. ``limit`` 0 keeps nothing in RAM (and so
nothing of a slot taken over); the disk store still serves unloads.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...hardware import executors
from ..core.jobs import common_prefix
from ..host.contract import CacheStats
from . import kvdisk

log = logging.getLogger(__name__)

State = Any
"""A sequence's KV state: a ctypes byte array (as llama.cpp wrote it) or bytes."""


@dataclass(frozen=True, slots=True)
class Found:
    """A saved prefix: in RAM (``state`` set) or on disk (``entry`` set)."""

    tokens: tuple[int, ...]
    state: State | None = None
    entry: kvdisk.Entry | None = None


RESTORE_COPIES = 32
"""Tokens of state a RAM restore may copy per token of prompt it saves reading. (A
restore copies the whole entry; copying a token's cells costs microseconds, reading it
milliseconds on a CPU: SmolLM2 on 2 cores, 23 KB and ~7 ms a token.)"""


def worth_restoring(saved: int, entry: int) -> bool:
    """Whether restoring an ``entry``-token RAM entry beats reading ``saved`` more
    prompt tokens than the slot already holds."""
    return saved > 0 and saved * RESTORE_COPIES >= entry


class PromptCache:
    """One model's saved prefixes: RAM up to ``limit`` bytes, then ``disk`` (or gone)."""

    def __init__(self, limit: int, disk: kvdisk.KVDisk | None) -> None:
        self.limit = limit
        self.disk = disk
        self.ram: OrderedDict[tuple[int, ...], State] = OrderedDict()
        """Least recently used first."""
        self.ram_bytes = 0
        self.hits = 0
        self.evictions = 0
        self._lock = threading.RLock()  # RAM's bookkeeping
        self._writes: queue.Queue[tuple[tuple[int, ...], State] | None] = queue.Queue()
        self._writer: threading.Thread | None = None

    @property
    def stats(self) -> CacheStats:
        return CacheStats(self.ram_bytes, len(self.ram), self.hits, self.evictions)

    # ------------------------------------------------------------------ finding

    def best(self, tokens: Sequence[int], better_than: int) -> Found | None:
        """The saved prefix sharing the most tokens with ``tokens``, if it shares
        enough more than ``better_than`` to be worth its copy (``worth_restoring``; on
        disk: at least kvdisk.MIN_TOKENS, and its read and checksum: an agent's turn
        whose slot holds all but its last few tokens was restored from a 10 MB file);
        RAM wins a tie."""
        with self._lock:
            ram = max(self.ram, key=lambda k: common_prefix(k, tokens), default=None)
            state = self.ram[ram] if ram is not None else None
        shared = common_prefix(ram, tokens) if ram is not None else 0
        if self.disk is not None:
            entry = self.disk.best(tokens, max(better_than, shared))
            if entry is not None and worth_restoring(
                    common_prefix(entry.tokens, tokens) - better_than, len(entry.tokens)):
                return Found(entry.tokens, entry=entry)
        if ram is None or shared <= better_than or not worth_restoring(
                shared - better_than, len(ram)):
            return None
        return Found(ram, state=state)

    def state(self, found: Found) -> State | None:
        """``found``'s state to restore (a hit), or None when its file failed its checks."""
        if found.state is not None:
            with self._lock:
                if found.tokens in self.ram:
                    self.ram.move_to_end(found.tokens)
            self.hits += 1
            return found.state
        assert self.disk is not None and found.entry is not None
        data = self.disk.load(found.entry)
        if data is not None:
            self.hits += 1
        return data

    def forget(self, found: Found) -> None:
        """``found`` would not restore (llama.cpp refused it): never try it again."""
        if found.state is not None:
            with self._lock:
                if found.tokens in self.ram:
                    self._drop(found.tokens)
        elif self.disk is not None and found.entry is not None:
            self.disk.forget(found.entry)

    # ------------------------------------------------------------------ keeping

    def keep(self, tokens: Sequence[int], take: Callable[[], State | None]) -> None:
        """Keep the state of ``tokens`` in RAM (``take`` copies it out of the context,
        called only when it is needed), replacing the entries it extends; then bring RAM
        under its limit."""
        key = tuple(tokens)
        if len(key) < kvdisk.MIN_TOKENS or self.limit <= 0:
            return
        with self._lock:
            for k in self.ram:
                if k[:len(key)] == key:  # held already, or more of the same conversation
                    self.ram.move_to_end(k)
                    return
        state = take()
        if state is None:
            return
        if len(state) > self.limit:  # more than RAM may hold: straight to disk
            self._to_disk(key, state)
            return
        with self._lock:
            for k in [k for k in self.ram if key[:len(k)] == k]:
                self._drop(k)
            self.ram[key] = state
            self.ram_bytes += len(state)
            while self.ram_bytes > self.limit:
                old, old_state = next(iter(self.ram.items()))
                self._drop(old)
                self.evictions += 1
                self._to_disk(old, old_state)

    def _drop(self, key: tuple[int, ...]) -> None:
        self.ram_bytes -= len(self.ram.pop(key))

    def drop_ram(self) -> int:
        """Give RAM back (another model's load needs it): every entry goes to disk, as
        far as the disk store holds. The bytes given back."""
        with self._lock:
            freed, held = self.ram_bytes, list(self.ram.items())
            self.evictions += len(held)
            self.ram.clear()
            self.ram_bytes = 0
        for key, state in reversed(held):
            self._to_disk(key, state)
        return freed

    # ------------------------------------------------------------------ disk

    def _to_disk(self, key: tuple[int, ...], state: State) -> None:
        """Save ``key``'s state on the writer thread (unless the disk already has it)."""
        if self.disk is None or self.disk.has(key):
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="prompt-cache-writer")
            self._writer.start()
        self._writes.put((key, state))  # (read there, never written again)

    def _write_loop(self) -> None:
        assert self.disk is not None
        while (item := self._writes.get()) is not None:
            self.disk.save(*item)

    def spill(self, slots: Sequence[tuple[Sequence[int], Callable[[], State | None]]]
              ) -> None:
        """At unload: the slots' conversations and then RAM's, newest first, to disk as
        far as its limit holds; returns when they are written."""
        if self.limit > 0:
            for tokens, take in slots:
                self.keep(tokens, take)
            budget = self.disk.limit if self.disk is not None else 0
            for key, state in reversed(self.ram.items()):
                if len(state) > budget:
                    break
                budget -= len(state)
                self._to_disk(key, state)
        else:  # no RAM: the slots go straight to disk
            for tokens, take in slots:
                if len(tokens) >= kvdisk.MIN_TOKENS and (state := take()) is not None:
                    self._to_disk(tuple(tokens), state)
        self.close()

    def close(self) -> None:
        """Finish the writes queued; RAM is given back."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None
        self.ram.clear()
        self.ram_bytes = 0


AUTO_MAX = 8 << 30
"""The most a prompt cache sized from free memory takes (llama-server's --cache-ram)."""


def ram_limit(mib: int) -> int:
    """The bytes of RAM a model's prompt cache may hold: ``mib`` (models.toml's
    ``kv_cache_ram``), or for -1 a quarter of the host memory available now, at most
    AUTO_MAX."""
    if mib >= 0:
        return mib << 20
    available = executors.host_available() or 0
    return min(AUTO_MAX, available // 4)


class Spares:
    """Buffers to copy states into that were used before: copying into fresh memory pays
    for its pages (an 8 MB state on a busy 2-core CPU: ~5 ms of a ~6 ms copy), into a used
    buffer not. For what is copied out only to go back soon (a parked job's cells): its
    buffer is spare again once the state is restored (``give_back``). Keeps ``limit``
    spare bytes at most, the newest. Engine thread only."""

    HEADROOM = 1.25
    """A new buffer's size over the state's: a job's cells grow while it runs."""

    def __init__(self, limit: int = 64 << 20) -> None:
        self.limit = limit
        self._free: list[Any] = []
        self._lent: dict[int, tuple[Any, Any]] = {}
        """id(state) -> (the state, the buffer it is a view of)."""

    def lend(self, size: int) -> Any:
        """A buffer of at least ``size`` bytes: the smallest spare that holds it, or new."""
        fit = [b for b in self._free if len(b) >= size]
        if not fit:
            return (ctypes.c_uint8 * int(size * self.HEADROOM))()
        buf = min(fit, key=len)
        self._free.remove(buf)
        return buf

    def view(self, buf: Any, n: int) -> Any:
        """The first ``n`` bytes of ``buf`` (lent), as the state they hold."""
        state = (ctypes.c_uint8 * n).from_buffer(buf)
        self._lent[id(state)] = (state, buf)
        return state

    def give_back(self, state: Any) -> None:
        """``state`` (from ``view``) is read no more: its buffer is spare again."""
        _, buf = self._lent.pop(id(state))
        self.spare(buf)

    def spare(self, buf: Any) -> None:
        self._free.append(buf)
        while sum(len(b) for b in self._free) > self.limit:
            self._free.pop(0)

    @property
    def bytes(self) -> int:
        """What the spare buffers hold."""
        return sum(len(b) for b in self._free)


def copy_state(L: Any, ctx: Any, seq: int, spares: Spares | None = None) -> State | None:
    """Sequence ``seq``'s KV state, copied out of ``ctx`` (None when it has none); into a
    buffer ``spares`` lends when given (give it back once the state is restored)."""
    size = int(L.llama_state_seq_get_size(ctx, seq))
    if size <= 0:
        return None
    if spares is not None:
        buf = spares.lend(size)
        n = int(L.llama_state_seq_get_data(ctx, buf, size, seq))
        if n <= 0:
            spares.spare(buf)
            return None
        return spares.view(buf, n)
    buf = (ctypes.c_uint8 * size)()
    n = int(L.llama_state_seq_get_data(ctx, buf, size, seq))
    if n <= 0:
        return None
    return buf if n == size else (ctypes.c_uint8 * n).from_buffer_copy(buf)
