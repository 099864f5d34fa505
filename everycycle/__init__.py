"""everycycle: a local LLM daemon and CLI over llama.cpp.

The client API is exported here: ``connect`` (async), ``SyncClient`` (blocking),
``embedded`` (in-process) and the error tree. Client names load lazily, so importing
the package stays light (no event loop, no llama_cpp).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AlreadyRunningError,
    ChecksumMismatchError,
    ConfigError,
    DaemonUnavailableError,
    ErrorKind,
    EverycycleError,
    InternalError,
    InvalidRequestError,
    ModelNotLoadedError,
    ProtocolError,
    RejectedError,
    RequestCancelledError,
    RequestFailedError,
    UsageError,
)

if TYPE_CHECKING:
    from .client import SyncClient, connect, embedded

__version__ = "0.2.0"

__all__ = [
    "AlreadyRunningError",
    "ChecksumMismatchError",
    "ConfigError",
    "DaemonUnavailableError",
    "ErrorKind",
    "EverycycleError",
    "InternalError",
    "InvalidRequestError",
    "ModelNotLoadedError",
    "ProtocolError",
    "RejectedError",
    "RequestCancelledError",
    "RequestFailedError",
    "SyncClient",
    "UsageError",
    "__version__",
    "connect",
    "embedded",
]

_LAZY = {"SyncClient", "connect", "embedded"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(".client", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
