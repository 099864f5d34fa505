"""Where everycycle keeps things: socket, config, state, logs, audit.

platformdirs picks the per-user locations. ``EVERYCYCLE_HOME`` moves everything
under one directory (tests, portable installs); ``EVERYCYCLE_SOCKET`` names the
socket alone. Nothing here creates files except :func:`ensure_private_dir`.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import platformdirs

from .errors import ConfigError

APP = "everycycle"


def _home() -> Path | None:
    home = os.environ.get("EVERYCYCLE_HOME")
    return Path(home) if home else None


def runtime_dir() -> Path:
    """Directory holding the socket (private: 0700)."""
    home = _home()
    if home is not None:
        return home / "run"
    with warnings.catch_warnings():
        # Without XDG_RUNTIME_DIR (containers, su, cron) platformdirs warns on every
        # call, on the user's stderr, and falls back to /tmp/runtime-UID: a fine place,
        # kept private by ensure_private_dir.
        warnings.simplefilter("ignore")
        return Path(platformdirs.user_runtime_dir(APP))


def socket_path() -> Path:
    """The daemon's Unix socket: ``$EVERYCYCLE_SOCKET`` or ``<runtime_dir>/everycycle.sock``."""
    env = os.environ.get("EVERYCYCLE_SOCKET")
    if env:
        return Path(env)
    return runtime_dir() / f"{APP}.sock"


def config_dir() -> Path:
    """User configuration (models.toml, the TCP token)."""
    home = _home()
    if home is not None:
        return home / "config"
    return Path(platformdirs.user_config_dir(APP))


def state_dir() -> Path:
    """Daemon state: pid files, audit log."""
    home = _home()
    if home is not None:
        return home / "state"
    return Path(platformdirs.user_state_dir(APP))


def log_dir() -> Path:
    """Daemon log files (``daemon --detach`` writes here)."""
    home = _home()
    if home is not None:
        return home / "log"
    return Path(platformdirs.user_log_dir(APP))


def cache_dir() -> Path:
    """What may be thrown away and made again: a model's cached prefixes."""
    home = _home()
    if home is not None:
        return home / "cache"
    return Path(platformdirs.user_cache_dir(APP))


def user_models_file() -> Path:
    """The user's models.toml, which extends and overrides the shipped one."""
    return config_dir() / "models.toml"


def audit_file() -> Path:
    """The append-only JSONL audit log."""
    return state_dir() / "audit.jsonl"


def token_file() -> Path:
    """The bearer token for the TCP listener (0600)."""
    return config_dir() / "token"


def pid_file_for(sock: Path) -> Path:
    """The pid file of the daemon serving ``sock`` (beside it, so one per socket)."""
    return sock.with_name(sock.name + ".pid")


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (0700) if missing and refuse one that others can write.

    Raises ConfigError if the directory is group/world-writable or owned by
    another user.
    """
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ConfigError(f"{path} is owned by uid {st.st_uid}, not by you")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            "fix it with chmod 700"
        )
    return path
