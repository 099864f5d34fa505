"""The append-only JSONL audit log: one line per finished request, rotated by size;
whole lines only, under the file's lock (statefile.append).

It listens on the daemon's event bus (``AuditLog.on_event``): a request's end, a model
loaded or evicted, an engine's death, a load's wait for room, a refused key. Listeners are
called as the event is published, so a request's line is written before its client hears
its terminal event.

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
from ..protocol import Embed, Generate
from . import events
from .outcome import Outcome

log = logging.getLogger(__name__)


class AuditLog:
    """Appends records to ``path``; at ``max_bytes`` the file moves to ``path.1``."""

    def __init__(self, path: Path, *, max_bytes: int = 10 << 20, include_prompts: bool = False):
        self.path = path
        self.max_bytes = max_bytes
        self.include_prompts = include_prompts
        self._failed = False

    def on_event(self, event: events.DaemonEvent) -> None:
        """The record of ``event``, for those the log keeps."""
        record: dict[str, Any] | None = None
        if isinstance(event, events.RequestEnded):
            record = audit_record(event.outcome, event.request, prompts=self.include_prompts)
        elif isinstance(event, events.ModelLoaded):
            record = {"event": "load", "model": event.model, "executor": event.executor}
        elif isinstance(event, events.ModelEvicted):
            record = {"event": "evict", "model": event.model, "for_model": event.for_model,
                      "reason": event.reason, "idle_s": event.idle_s}
        elif isinstance(event, events.EngineDied):
            record = {"event": "engine_death", "model": event.model, "cause": event.cause,
                      "message": event.message}
        elif isinstance(event, events.RoomWait):
            record = {"event": "room_wait", "model": event.model, "waited_s": event.waited_s,
                      "outcome": event.outcome, "held_by": event.held_by}
        elif isinstance(event, events.AuthRefused):
            record = {"event": "auth", "outcome": event.outcome}
        if record is not None:
            self.write(record)

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


def _size(b64: str) -> int:
    """The byte count base64 text decodes to."""
    return len(b64) * 3 // 4 - b64[-2:].count("=")


def audit_record(outcome: Outcome, req: Generate | Embed, *, prompts: bool) -> dict[str, Any]:
    """The audit log's line for a request (its prompt only with ``prompts``)."""
    record: dict[str, Any] = {
        "request_id": outcome.request_id,
        "principal": outcome.principal,
        "model": outcome.model,
        "executor": outcome.executor,
        "prompt_tokens": outcome.prompt_tokens,
        "cached_tokens": outcome.cached_tokens,
        "output_tokens": outcome.generated_tokens,
        "queue_wait_ms": round(outcome.queue_wait_s * 1000, 1),
        "duration_ms": round(outcome.duration_s * 1000, 1),
        "outcome": outcome.kind.value if outcome.kind else "Finished",
        "lane": outcome.lane,
    }
    if outcome.limit is not None:
        record["limit"] = outcome.limit
    query = req.query if isinstance(req, Embed) else None
    if query is not None:
        record["kind"] = "rerank"
    if prompts:
        record["prompt"] = ({"query": query, "documents": list(req.input)}
                            if isinstance(req, Embed) and query is not None
                            else list(req.input) if isinstance(req, Embed) else
                            list(req.prompt_tokens) if req.prompt_tokens is not None else
                            req.prompt if req.messages is None else
                            [[m.role.value, m.text] + [f"(image, {_size(i.data or '')} bytes)"
                                                       for i in m.images]
                             for m in req.messages])
    return record
