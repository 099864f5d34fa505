"""uvicorn, run as one task of the daemon's event loop (no second loop, no thread)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import uvicorn


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn Server that leaves signals to the daemon (it owns SIGTERM/SIGINT)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: Any) -> uvicorn.Server:
    """A uvicorn server for ``app``; start it with ``await server.serve(sockets=[sock])``
    and stop it with ``server.should_exit = True``."""
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_level="warning",
                            timeout_graceful_shutdown=2, server_header=False,
                            log_config=None)
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    return _EmbeddedServer(config)
