"""API keys: who is asking (a principal) and what each may do (its limits).

The local Unix-socket user is the principal "local". TCP and HTTP clients present a
key; the daemon's original single token (``paths.token_file()``) is the key named
"default". Other keys live in a JSON key file in the config directory, made and kept
0600 and refused when group or others can read it. Only a SHA-256 hash of each
secret is stored: secrets are 256 random bits, so a plain hash cannot be reversed by
guessing, and the daemon compares hashes in constant time. A secret is shown once,
when ``everycycle keys add`` makes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import paths, statefile
from ..errors import ConfigError, EverycycleError, InvalidRequestError
from ..models.registry import Registry

log = logging.getLogger(__name__)

SECRET_PREFIX = "ec-"
MIN_SECRET_CHARS = 32
"""A given secret's characters past the prefix, at least (ours have 43)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RESERVED = ("local", "default")


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """A principal's limits; None is unlimited."""

    concurrent: int | None = None
    """Requests running or queued at once."""
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    """Generated tokens per minute."""
    prompt_bytes_per_minute: float | None = None
    models: tuple[str, ...] | None = None
    """The models (names or aliases) it may use; None: all of them."""
    background: bool | None = None
    """True: every request it makes waits in the background lane."""

    def describe(self) -> str:
        """The limits in words, for `keys list`."""
        parts = []
        if self.concurrent is not None:
            parts.append(f"{self.concurrent} at once")
        for value, unit in ((self.requests_per_minute, "requests/min"),
                            (self.tokens_per_minute, "tokens/min"),
                            (self.prompt_bytes_per_minute, "prompt bytes/min")):
            if value is not None:
                parts.append(f"{value:g} {unit}")
        if self.models is not None:
            parts.append("models: " + ", ".join(self.models))
        if self.background:
            parts.append("background lane")
        return "; ".join(parts) or "none"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request comes from."""

    name: str
    limits: KeyLimits = field(default_factory=KeyLimits)


LOCAL = Principal("local")

ADMINS = frozenset({"local", "default"})
"""Principals that may cancel anyone's requests and read everyone's usage: the socket's
own user and the daemon's token; any other key acts on its own requests only."""


def check_may_use(principal: Principal, name: str, registry: Registry) -> None:
    """Raises InvalidRequestError unless ``principal`` may use model ``name`` (an entry's
    name or alias, read through ``registry``)."""
    if principal.limits.models is None:
        return

    def canonical(name: str) -> str | None:
        try:
            return registry.get(name).name
        except EverycycleError:
            return None

    wanted = canonical(name)
    if wanted is None or wanted not in {canonical(m) for m in principal.limits.models}:
        # The same words whether or not the model exists.
        raise InvalidRequestError(f"model '{name}' is not available to key '{principal.name}'")


def may_act_for(actor: Principal, owner: Principal) -> bool:
    """Whether ``actor`` may cancel (or see) a request of ``owner``'s."""
    return actor.name in ADMINS or actor.name == owner.name


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    sha256: str | None
    """None for "local" and "default", whose entries hold limits only."""
    created: float
    limits: KeyLimits


def load_or_create_token() -> str:
    """The daemon's first key, "default" (TCP and HTTP), created (0600) on first use."""
    path = paths.token_file()
    paths.ensure_private_dir(path.parent)
    with contextlib.suppress(FileNotFoundError):
        return path.read_text().strip()
    with statefile.locked(path):  # two first uses at once agree on one token
        with contextlib.suppress(FileNotFoundError):
            return path.read_text().strip()
        token = secrets.token_urlsafe(32)
        statefile.replace(path, token + "\n")
        return token


def keys_file() -> Path:
    return paths.config_dir() / "keys.json"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"key name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit")
    if name in RESERVED:
        raise InvalidRequestError(f"key name '{name}' is reserved")
    return name


def _limits_from(raw: Any, where: str) -> KeyLimits:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: limits must be an object")
    known = set(KeyLimits.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{where}: unknown limit {min(unknown)!r}")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        if value is None:
            continue
        if name == "models":
            if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
                raise ConfigError(f"{where}: models must be a list of names")
            values[name] = tuple(value)
        elif name == "background":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: background must be true or false")
            values[name] = value or None
        elif (isinstance(value, bool) or not isinstance(value, int | float)
              or not math.isfinite(value) or value <= 0
              or (name == "concurrent" and not isinstance(value, int))):
            raise ConfigError(f"{where}: {name} must be a positive number")
        else:
            values[name] = value
    return KeyLimits(**values)


MAX_FILE_BYTES = 4 * 1024 * 1024
"""A key file larger than this is refused (a key is about 200 bytes)."""


def _number(value: Any, what: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: {what} must be a number, not {json.dumps(value)[:40]}")
    return float(value)


def _parse(data: Any, path: Path) -> dict[str, Key]:
    """The key file's JSON, checked field by field. Raises ConfigError naming the key
    and the field."""
    if not isinstance(data, dict) or not isinstance(data.get("keys"), dict):
        raise ConfigError(f"key file {path}: expected {{\"keys\": {{...}}}}")
    keys: dict[str, Key] = {}
    for name, entry in data["keys"].items():
        where = f"key file {path}, key {name!r}"
        if name not in RESERVED and not _NAME.fullmatch(name):
            raise ConfigError(f"{where}: not a valid key name")
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected an object")
        unknown = set(entry) - {"sha256", "created", "limits"}
        if unknown:
            raise ConfigError(f"{where}: unknown field {min(unknown)!r}")
        digest = entry.get("sha256")
        if name not in RESERVED and not (isinstance(digest, str)
                                         and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise ConfigError(f"{where}: sha256 must be 64 hex digits")
        keys[name] = Key(name=name, sha256=digest if name not in RESERVED else None,
                         created=_number(entry.get("created", 0), "created", where),
                         limits=_limits_from(entry.get("limits", {}), where))
    return keys


class KeyStore:
    """The key file, re-read whenever it changes (so `keys add` needs no restart)."""

    def __init__(self, path: Path | None = None, *, default_token: str | None = None) -> None:
        self.path = path or keys_file()
        self.default_token = default_token
        self._seen: tuple[int, int, int] | None = None
        self._keys: dict[str, Key] = {}
        """The last keys read without a fault."""
        self._broken: tuple[int, int] | None = None
        """The broken file's (mtime, size) last logged."""

    # ------------------------------------------------------------------ reading

    def _check_mode(self, st: os.stat_result) -> None:
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"key file {self.path} can be read by others (mode {mode:04o}); "
                f"run: chmod 600 {self.path}")

    def keys(self) -> dict[str, Key]:
        """The keys on file, by name. Raises ConfigError for a loose or broken file."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._keys = None, {}
            return {}
        except OSError as exc:
            raise ConfigError(f"cannot read key file {self.path}: {exc.strerror}") from None
        self._check_mode(st)
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return self._keys
        try:
            text = self.path.read_text(encoding="utf-8")
            if len(text) > MAX_FILE_BYTES:
                raise ConfigError(f"key file {self.path} is over {MAX_FILE_BYTES} bytes")
            data = json.loads(text)
        except (OSError, ValueError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise ConfigError(f"key file {self.path} is unreadable: {why}") from None
        keys = _parse(data, self.path)
        self._seen, self._keys = seen, keys
        return keys

    def current(self) -> dict[str, Key]:
        """The keys in force: as on file, or, while the file is broken, the last good
        ones (the problem logged once per change of the file). Never fails open."""
        try:
            keys = self.keys()
        except ConfigError as exc:
            try:
                st = os.stat(self.path)
                broken = (st.st_mtime_ns, st.st_size)
            except OSError:
                broken = None
            if broken != self._broken:
                self._broken = broken
                log.error("%s; keeping the %d keys and limits read before", exc.message,
                          len(self._keys))
            return self._keys
        self._broken = None
        return keys

    def authenticate(self, secret: str) -> Principal | None:
        """The principal whose secret this is, or None. A broken key file refuses
        every key but "default" (and raises nothing: the daemon logs it elsewhere)."""
        if self.default_token is not None and hmac.compare_digest(
                secret.encode("utf-8"), self.default_token.encode("utf-8")):
            return self.principal("default")
        if not secret.startswith(SECRET_PREFIX):
            return None
        keys = self.current()
        digest = hash_secret(secret)
        found: Principal | None = None
        for key in keys.values():  # every key compared: the time says nothing
            if key.sha256 is not None and hmac.compare_digest(digest, key.sha256):
                found = Principal(key.name, key.limits)
        return found

    def principal(self, name: str) -> Principal:
        """``name`` ("local", "default" or a key) with its limits as on file now (while
        the file is broken, as last read: limits never fail open)."""
        key = self.current().get(name)
        return Principal(name, key.limits if key else KeyLimits())

    # ------------------------------------------------------------------ writing

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, Key]]:
        """The keys as on file now, read under the file's lock, for the caller to change
        in place; written back (atomically, durably) when the block ends without an
        error. Raises FileBusyError or ConfigError; nothing is changed then."""
        paths.ensure_private_dir(self.path.parent)
        try:
            with statefile.locked(self.path):
                self._seen = None  # another process may have written since: read afresh
                keys = dict(self.keys())
                yield keys
                self._write(keys)
        except OSError as exc:  # a full disk, a read-only config dir: nothing changed
            raise ConfigError(f"cannot write key file {self.path}: "
                              f"{exc.strerror or exc}; nothing was changed") from None

    def _write(self, keys: dict[str, Key]) -> None:
        body = {"keys": {k.name: {**({"sha256": k.sha256} if k.sha256 else {}),
                                  "created": k.created,
                                  "limits": {n: v for n, v in asdict(k.limits).items()
                                             if v is not None}}
                         for k in keys.values()}}
        statefile.replace(self.path, json.dumps(body, indent=2) + "\n")

    def add(self, name: str, limits: KeyLimits, secret: str | None = None) -> str:
        """Make key ``name``; returns its secret (shown once, never stored). With
        ``secret``, that one: a key another daemon made, so that one key opens several
        (the daemons behind one router). Raises InvalidRequestError for a secret that
        is not one of ours."""
        check_name(name)
        if secret is not None and (not secret.startswith(SECRET_PREFIX) or len(secret) < len(
                SECRET_PREFIX) + MIN_SECRET_CHARS or not secret.isprintable() or " " in secret):
            raise InvalidRequestError(
                f"not a key secret: one is '{SECRET_PREFIX}' and at least {MIN_SECRET_CHARS} "
                "more characters, as `everycycle keys add` prints it")
        with self._changing() as keys:
            if name in keys:
                raise InvalidRequestError(f"key '{name}' exists; remove it first "
                                          f"(keys rm {name})")
            secret = secret or SECRET_PREFIX + secrets.token_urlsafe(32)
            keys[name] = Key(name, hash_secret(secret), round(time.time(), 3), limits)
        return secret

    def set_limits(self, name: str, limits: KeyLimits) -> None:
        """Replace the limits of key ``name``, or of "local" or "default"."""
        with self._changing() as keys:
            old = keys.get(name)
            if old is None and name not in RESERVED:
                raise InvalidRequestError(f"no key named '{name}' (keys add {name} makes "
                                          "one)")
            keys[name] = Key(name, old.sha256 if old else None,
                             old.created if old else round(time.time(), 3), limits)

    def remove(self, name: str) -> None:
        with self._changing() as keys:
            if name not in keys or name in RESERVED:
                raise InvalidRequestError(
                    f"no key named '{name}'" if name not in RESERVED else
                    f"'{name}' cannot be removed; `keys limit {name}` with no limits "
                    "lifts them")
            del keys[name]
