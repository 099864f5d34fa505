"""The append-only JSONL audit log: one line per finished request, rotated by size;
whole lines only, under the file's lock (statefile.append).

No prompt text unless asked for. A failing log (disk full, unwritable) never stops
requests from being served; the failure is reported once.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from .. import statefile
from ..errors import FileBusyError

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
            statefile.append(self.path, line, max_bytes=self.max_bytes)
            self._failed = False
        except (OSError, FileBusyError) as exc:
            if not self._failed:
                log.error("audit log %s is not writable (%s); requests are still served",
                          self.path, exc)
            self._failed = True
