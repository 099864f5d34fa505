"""Clients of the daemon: the sans-IO connection core (connection.py), the async client
(aio.py), the blocking client (sync.py) and the in-process client (inprocess.py).

Names load lazily so that ``from everycycle.client import SyncClient`` never imports
anyio or asyncio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .aio import BaseClient, Client, connect
    from .connection import ClientConnection, new_request_id
    from .inprocess import EmbeddedClient, embedded
    from .sync import SyncClient

__all__ = [
    "BaseClient",
    "Client",
    "ClientConnection",
    "EmbeddedClient",
    "SyncClient",
    "connect",
    "embedded",
    "new_request_id",
]

_WHERE = {
    "BaseClient": "aio", "Client": "aio", "connect": "aio",
    "ClientConnection": "connection", "new_request_id": "connection",
    "EmbeddedClient": "inprocess", "embedded": "inprocess",
    "SyncClient": "sync",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
