"""``mcp.json``: the user's MCP servers, in the shape Claude Desktop, Cursor and LM Studio
read (``{"mcpServers": {name: {"command", "args", "env"}}}``), in the config directory.

Entries this daemon cannot run (a ``url`` server) are kept in the file as written and
reported per server, never a reason to refuse the others: the file is often shared.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import paths, statefile
from ..errors import ConfigError

__all__ = ["McpServer", "add", "config_file", "load", "remove"]

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
"""A server's name: it prefixes its tools' names where two servers share one."""


@dataclass(frozen=True, slots=True)
class McpServer:
    """One configured server: a command speaking MCP on stdio, or (not run here) a URL."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None

    @property
    def problem(self) -> str | None:
        """Why this entry cannot be started here, in one sentence; None when it can."""
        if self.command is None:
            return (f"MCP server '{self.name}' is a URL server ({self.url}); only stdio "
                    "servers (a `command`) are run so far")
        return None

    def describe(self) -> str:
        """The command line (or URL), as ``mcp list`` shows it."""
        if self.command is None:
            return self.url or ""
        return " ".join([self.command, *self.args])


def config_file() -> Path:
    """Where the MCP servers are configured (beside models.toml)."""
    return paths.config_dir() / "mcp.json"


def _read(path: Path) -> dict[str, Any]:
    """The whole file as JSON (an empty document when there is none). Raises ConfigError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    try:
        doc = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not JSON: {exc.msg} (line {exc.lineno})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} must hold a JSON object with \"mcpServers\"")
    servers = doc.get("mcpServers", {})
    if not isinstance(servers, dict):
        raise ConfigError(f"{path}: \"mcpServers\" must be an object of servers by name")
    return doc


def _entry(path: Path, name: str, raw: Any) -> McpServer:
    where = f"{path}: server '{name}'"
    if not NAME.match(name):
        raise ConfigError(f"{where}: a name is letters, digits, '_', '.' or '-' (at most 64)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object with a \"command\"")
    command, url = raw.get("command"), raw.get("url")
    if command is None and url is None:
        raise ConfigError(f"{where} has neither \"command\" nor \"url\"")
    if command is not None and (not isinstance(command, str) or not command):
        raise ConfigError(f"{where}: \"command\" must be a non-empty string")
    args = raw.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where}: \"args\" must be a list of strings")
    env = raw.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise ConfigError(f"{where}: \"env\" must map names to strings")
    cwd = raw.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ConfigError(f"{where}: \"cwd\" must be a string")
    if url is not None and not isinstance(url, str):
        raise ConfigError(f"{where}: \"url\" must be a string")
    return McpServer(name, command, tuple(args), dict(env), cwd, url)


def load(path: Path | None = None) -> dict[str, McpServer]:
    """The configured servers by name, in the file's order. Raises ConfigError (one
    sentence naming the file and the server)."""
    path = path or config_file()
    servers = _read(path).get("mcpServers", {})
    return {name: _entry(path, name, raw) for name, raw in servers.items()}


def add(server: McpServer, path: Path | None = None) -> bool:
    """Write ``server`` into the file (replacing one of its name; the file's other keys
    and servers stay as they were); whether it replaced one. Raises ConfigError,
    FileBusyError or OSError."""
    path = path or config_file()
    _entry(path, server.name, {"command": server.command, "args": list(server.args),
                               "env": dict(server.env)})  # (the name and shape checked)
    with statefile.locked(path):
        doc = _read(path)
        servers = doc.setdefault("mcpServers", {})
        replaced = server.name in servers
        entry: dict[str, Any] = {"command": server.command, "args": list(server.args)}
        if server.env:
            entry["env"] = dict(server.env)
        if server.cwd:
            entry["cwd"] = server.cwd
        servers[server.name] = entry
        statefile.replace(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    return replaced


def remove(name: str, path: Path | None = None) -> None:
    """Take server ``name`` out of the file. Raises ConfigError when it is not there."""
    path = path or config_file()
    with statefile.locked(path):
        doc = _read(path)
        servers = doc.get("mcpServers", {})
        if name not in servers:
            raise ConfigError(f"no MCP server '{name}' in {path}")
        del servers[name]
        statefile.replace(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
