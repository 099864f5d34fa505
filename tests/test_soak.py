"""The soak, short: hostile clients never change a normal client's answer, and the
daemon's memory stays within its documented bound (SECURITY.md)."""

from __future__ import annotations

from conftest import SpawnDaemon
from soak import soak

from everycycle import paths
from everycycle.client import SyncClient

RSS_BOUND = 96 * 2**20
"""The most the daemon's RSS may grow over the soak (SECURITY.md)."""


def test_hostile_clients_mixed_with_normal_ones(spawn_daemon: SpawnDaemon) -> None:
    proc = spawn_daemon("--http", "127.0.0.1:0")
    with SyncClient() as c:
        c.load("tiny4")
        url = c.describe_fleet().http
    assert url is not None
    host, _, port = url.removeprefix("http://").rpartition(":")
    result = soak(paths.socket_path(), (host, int(port)), proc.pid, seconds=12)
    for line in result.lines():
        print(line)  # noqa: T201 - the figures, shown with pytest -s
    assert not result.errors, result.errors
    assert result.normal_answers >= 8 and result.normal_mismatches == 0
    assert all(result.hostile.get(name, 0) >= 1 for name in (
        "slow readers", "never-readers", "endless headers", "mid-stream disconnects",
        "dead-end grammars", "dead-end schemas over HTTP")), result.hostile
    assert result.rss_peak - result.rss_start < RSS_BOUND, result.lines()
    assert proc.poll() is None
    with SyncClient() as c:
        assert c.describe_fleet().loaded_models[0].engine_restarts is None  # never died
