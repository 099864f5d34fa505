"""How long an idle model stays loaded: the keep-alive forms models.toml, the CLI and
Ollama's API take (``300``, ``"5m"``, ``"1h30m"``, ``0``, ``-1``)."""

from __future__ import annotations

import re

DEFAULT_KEEP_ALIVE = 300.0
"""Seconds an idle model stays loaded, as Ollama's default of 5 minutes."""
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_keep_alive(value: object) -> float:
    """Seconds from ``300``, ``"5m"``, ``"1h30m"``, ``"90s"``, ``0`` (unload when idle)
    or ``-1`` / ``"never"`` (stay loaded: returned as -1). Raises ValueError, with the
    forms it takes."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if value < 0:
            return -1.0
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("-1", "never", "forever"):
            return -1.0
        try:
            return parse_keep_alive(float(text))
        except ValueError:
            pass
        parts = re.fullmatch(r"((\d+(\.\d+)?)(ms|s|m|h|d))+", text)
        if parts:
            return sum(float(n) * _UNITS[u]
                       for n, _, u in re.findall(r"(\d+(\.\d+)?)(ms|s|m|h|d)", text))
    raise ValueError(f"keep-alive {value!r}: {KEEP_ALIVE_FORMS}")


KEEP_ALIVE_FORMS = ("use seconds (300), a duration (5m, 1h, 90s), 0 (unload when idle) or -1 "
                    "(never unload)")
