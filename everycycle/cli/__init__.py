"""The command line: Typer app (app.py), Rich views (render.py), interactive chat (chat.py)."""

from __future__ import annotations

from .app import app, main

__all__ = ["app", "main"]
