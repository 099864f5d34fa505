"""The daemon's HTTP API: the shared exchange with the supervisor, one module per API
dialect, and the app that assembles them (``HttpApi``)."""

from .app import HttpApi

__all__ = ["HttpApi"]
