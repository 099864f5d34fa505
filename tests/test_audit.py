"""The audit log: appends JSONL, rotates by size, survives an unwritable location."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from everycycle.daemon.audit import AuditLog


def test_appends_and_rotates_by_size(tmp_path: Path) -> None:
    log = AuditLog(tmp_path / "audit.jsonl", max_bytes=200)
    for i in range(10):
        log.write({"request_id": f"r{i}", "outcome": "Finished"})
    rotated = tmp_path / "audit.jsonl.1"
    assert rotated.exists()
    current = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert current[-1]["request_id"] == "r9" and "time" in current[-1]
    assert (tmp_path / "audit.jsonl").stat().st_size < 400


def test_an_unwritable_log_is_reported_once(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    log = AuditLog(blocker / "audit.jsonl")  # a path under a regular file: never writable
    log.write({"a": 1})
    log.write({"a": 2})
    assert [r.levelname for r in caplog.records].count("ERROR") == 1
