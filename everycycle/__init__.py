"""everycycle: a local LLM daemon and CLI over llama.cpp."""

from __future__ import annotations

from .errors import (
    CancelledError,
    ConfigError,
    DaemonUnavailableError,
    ErrorKind,
    EverycycleError,
    InternalError,
    InvalidRequestError,
    ModelNotLoadedError,
    ProtocolError,
    RejectedError,
    RequestFailedError,
    UsageError,
)

__version__ = "0.1.0"

__all__ = [
    "CancelledError",
    "ConfigError",
    "DaemonUnavailableError",
    "ErrorKind",
    "EverycycleError",
    "InternalError",
    "InvalidRequestError",
    "ModelNotLoadedError",
    "ProtocolError",
    "RejectedError",
    "RequestFailedError",
    "UsageError",
    "__version__",
]
