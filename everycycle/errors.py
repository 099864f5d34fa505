"""The exception tree of everycycle; every error carries its wire ``ErrorKind``.

::

    EverycycleError                    base; .kind is an ErrorKind
    ├── ProtocolError                  the peer sent a line we cannot accept (Invalid)
    │   ├── LineTooLongError           a line over the framing limit (Invalid, closes)
    │   └── TooLargeError              a value over its size limit: an image (Invalid; HTTP 413)
    ├── InvalidRequestError            well-formed but unacceptable: range, unknown model (Invalid)
    │   ├── ChecksumMismatchError      a model file differs from its sha256 pin (Invalid)
    │   ├── UnknownModelError          a name no registry entry has (Invalid; HTTP 404)
    │   └── ContextOverflowError       a prompt longer than the context; its numbers (Invalid)
    ├── ConfigError                    a models.toml or option problem (Invalid)
    │   └── AlreadyRunningError        another daemon serves this socket; .pid (Invalid)
    ├── ModelNotLoadedError            known model, not resident, auto-load off (ModelNotLoaded)
    ├── RejectedError                  queue full, over a quota (Rejected)
    ├── FileBusyError                  another process holds a state file's lock (Rejected)
    ├── RequestCancelledError          cancelled: client, deadline, disconnect, shutdown (Cancelled)
    ├── InternalError                  we failed: llama.cpp, I/O (Internal)
    ├── RequestFailedError             client side: the daemon answered Error{kind} (that kind)
    └── DaemonUnavailableError         client side: no daemon answers on the socket (Internal)

``UsageError(RuntimeError)`` is separate: it signals misuse of this library's API
(a programming error, e.g. reusing an active request id on one connection), never
something a peer did.

``unwrap_groups`` is for the boundaries where a task group's ExceptionGroup would
otherwise reach a caller that expects one of these errors (anyio's migration notes).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator


class ErrorKind(enum.Enum):
    """The closed set of error kinds on the wire (DESIGN.md, "Protocol")."""

    INVALID = "Invalid"
    MODEL_NOT_LOADED = "ModelNotLoaded"
    REJECTED = "Rejected"
    CANCELLED = "Cancelled"
    INTERNAL = "Internal"


class EverycycleError(Exception):
    """Base of every error everycycle raises on purpose."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, *, kind: ErrorKind | None = None) -> None:
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind


class ProtocolError(EverycycleError):
    """The peer sent a line that does not decode to a valid request or event."""

    kind = ErrorKind.INVALID

    def __init__(self, message: str, *, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class LineTooLongError(ProtocolError):
    """A framed line exceeded the maximum length; the connection must close."""


class TooLargeError(ProtocolError):
    """A value over its size limit (an image's bytes): what HTTP answers with 413."""


class InvalidRequestError(EverycycleError):
    """A request that decodes but cannot be served as asked (range, unknown model, context)."""

    kind = ErrorKind.INVALID


class ChecksumMismatchError(InvalidRequestError):
    """A model file's sha256 differs from the pinned one."""


class UnknownModelError(InvalidRequestError):
    """A model name no registry entry has (what HTTP answers with 404)."""


class ContextOverflowError(InvalidRequestError):
    """A prompt of ``prompt_tokens`` tokens does not fit a context of ``context``."""

    def __init__(self, message: str, *, prompt_tokens: int, context: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.context = context


class ConfigError(EverycycleError):
    """A configuration file (models.toml) or option is wrong; the message names where."""

    kind = ErrorKind.INVALID


class AlreadyRunningError(ConfigError):
    """Another daemon holds this socket; ``pid`` is its process id when known."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


class ModelNotLoadedError(EverycycleError):
    """The model is known but not resident, and auto-load is off for this request."""

    kind = ErrorKind.MODEL_NOT_LOADED


class RejectedError(EverycycleError):
    """Admission refused: queue full, per-connection limit, no room on an executor, or a
    principal over one of its quotas (then ``limit`` names it and ``retry_after`` says
    in how many seconds it will have room, where that is known)."""

    kind = ErrorKind.REJECTED

    def __init__(self, message: str, *, limit: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after = retry_after


class FileBusyError(EverycycleError):
    """Another process held a config or state file's lock for too long; nothing was
    changed (the message names the file and the holder). Retrying later may succeed."""

    kind = ErrorKind.REJECTED


class RequestCancelledError(EverycycleError):
    """The request was cancelled (Cancel, deadline, disconnect, shutdown)."""

    kind = ErrorKind.CANCELLED


class InternalError(EverycycleError):
    """Something failed on our side (llama.cpp, the file system)."""

    kind = ErrorKind.INTERNAL


class AllocationError(InternalError):
    """llama.cpp could not allocate a model's weights or KV cache where it was placed
    (a device that reported more free memory than it had): a load may retry smaller."""


class RequestFailedError(EverycycleError):
    """The daemon ended a request with ``Error{kind, message}``; ``kind`` is the daemon's."""

    def __init__(self, message: str, *, kind: ErrorKind, request_id: str = "") -> None:
        super().__init__(message, kind=kind)
        self.request_id = request_id


class UnavailableError(EverycycleError):
    """A service the command needs cannot be reached (the CLI maps this to exit 69)."""


class DaemonUnavailableError(UnavailableError):
    """No daemon answers on the socket."""


class HubUnreachableError(UnavailableError):
    """The model hub cannot be reached (no network, a proxy, a firewall)."""


class UsageError(RuntimeError):
    """This library's API was misused (a programming error, not a peer's)."""


@contextlib.contextmanager
def unwrap_groups() -> Iterator[None]:
    """Re-raise the one exception inside (nested) single-exception groups.

    A task group wraps whatever its body raised in an ExceptionGroup; at a boundary
    whose callers catch ``EverycycleError`` (or ``KeyboardInterrupt``) the group is
    unwrapped so the except clause that was meant for it matches. A group of two or
    more exceptions is a real concurrent failure and propagates unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        inner: BaseException = group
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        if inner is group:
            raise
        raise inner from None
