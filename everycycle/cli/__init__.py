"""The command line: the shared app and helpers (common.py), run/chat/embed (app.py),
the commands that ask a daemon (fleet.py), the daemon itself (daemon.py), the registry and hub
(models.py), Rich views (render.py), the chat loop (chat.py), Ctrl-C (interrupt.py)."""

from __future__ import annotations

from .app import main
from .common import app

__all__ = ["app", "main"]
