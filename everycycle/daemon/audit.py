"""The append-only JSONL audit log: one line per finished request, rotated by size.

No prompt text unless asked for. A failing log (disk full, unwritable) never stops
requests from being served; the failure is reported once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class AuditLog:
    """Appends records to ``path``; at ``max_bytes`` the file moves to ``path.1``."""

    def __init__(self, path: Path, *, max_bytes: int = 10 << 20, include_prompts: bool = False):
        self.path = path
        self.max_bytes = max_bytes
        self.include_prompts = include_prompts
        self._failed = False

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a ``time`` field is added). Never raises."""
        line = json.dumps({"time": round(time.time(), 3), **record}, ensure_ascii=False)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists() and self.path.stat().st_size >= self.max_bytes:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line.encode("utf-8") + b"\n")
            finally:
                os.close(fd)
            self._failed = False
        except OSError as exc:
            if not self._failed:
                log.error("audit log %s is not writable (%s); requests are still served",
                          self.path, exc)
            self._failed = True
