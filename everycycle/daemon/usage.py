"""Usage reports: the audit log's request records summed per key, model or day.

Reads the rotated file (``audit.jsonl.1``) before the current one; a line that is not
a request record (auth events, a torn last line) is skipped.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

GROUPS = ("key", "model", "day", "hour")


@dataclass(slots=True)
class UsageRow:
    """One group's totals."""

    group: str
    requests: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected: int = 0
    failed: int = 0
    """Invalid, ModelNotLoaded or Internal."""
    prompt_tokens: int = 0
    generated_tokens: int = 0

    def as_json(self, by: str) -> dict[str, Any]:
        data = asdict(self)
        return {by: data.pop("group"), **data}


def audit_records(path: Path) -> Iterator[dict[str, Any]]:
    """Every request record in ``path`` and its rotated predecessor, oldest first."""
    for part in (path.with_name(path.name + ".1"), path):
        try:
            f = part.open(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            continue
        with f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "request_id" in record and "model" in record:
                    yield record


def parse_since(text: str, now: dt.datetime | None = None) -> float:
    """``2026-11-30``, ``2026-11-30T12:00``, or ``7d`` / ``12h`` / ``30m`` ago: a Unix time.

    Raises ValueError with a message for anything else.
    """
    now = now or dt.datetime.now().astimezone()
    units = {"d": 86400, "h": 3600, "m": 60}
    if text[-1:] in units and text[:-1].isdigit():
        return now.timestamp() - int(text[:-1]) * units[text[-1]]
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--since {text!r}: use a date (2026-11-30), a date and time "
                         "(2026-11-30T12:00) or an age (7d, 12h, 30m)") from None
    if when.tzinfo is None:
        when = when.astimezone()  # local time, as people write dates
    return when.timestamp()


def summarize(records: Iterator[dict[str, Any]], *, by: str = "key",
              since: float | None = None) -> list[UsageRow]:
    """Totals per group, largest generated-token count first."""
    if by not in GROUPS:
        raise ValueError(f"--by {by!r}: one of {', '.join(GROUPS)}")
    rows: dict[str, UsageRow] = {}
    for r in records:
        when = r.get("time")
        if not isinstance(when, int | float):
            continue
        if since is not None and when < since:
            continue
        if by == "key":
            group = str(r.get("principal") or "local")
        elif by == "model":
            group = str(r["model"] or "(default)")
        elif by == "day":
            group = dt.datetime.fromtimestamp(when).astimezone().date().isoformat()
        else:
            group = dt.datetime.fromtimestamp(when).astimezone().strftime("%Y-%m-%dT%H:00")
        row = rows.setdefault(group, UsageRow(group))
        row.requests += 1
        outcome = r.get("outcome")
        if outcome == "Finished":
            row.finished += 1
        elif outcome == "Cancelled":
            row.cancelled += 1
        elif outcome == "Rejected":
            row.rejected += 1
        else:
            row.failed += 1
        row.prompt_tokens += int(r.get("prompt_tokens") or 0)
        row.generated_tokens += int(r.get("output_tokens") or 0)
    order = (lambda row: row.group) if by in ("day", "hour") else (
        lambda row: (-row.generated_tokens, row.group))
    return sorted(rows.values(), key=order)
