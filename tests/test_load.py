"""200 concurrent connections streaming against small queues: nothing lost, nothing leaked."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import anyio
import pytest
from conftest import SpawnDaemon
from daemonhelp import wait_until

from everycycle.client import SyncClient, connect
from everycycle.protocol import Accepted, Error, Tokens, is_terminal

CONNECTIONS = int(os.environ.get("EVERYCYCLE_LOAD_CONNECTIONS", "200"))
REQUESTS_EACH = 2


@pytest.fixture
def daemon(spawn_daemon: SpawnDaemon) -> int:
    return spawn_daemon("--max-queue", "8").pid


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def one_connection(i: int, outcomes: Counter[str]) -> None:
    async with connect() as client:
        for j in range(REQUESTS_EACH):
            events = [e async for e in client.generate("tiny4", f"load {i} {j}", max_tokens=4,
                                                       temperature=0.0)]
            terminals = [e for e in events if is_terminal(e)]
            assert len(terminals) == 1 and terminals[0] is events[-1], events
            end = events[-1]
            if isinstance(end, Tokens):
                assert isinstance(events[0], Accepted)
                outcomes["finished"] += 1
            else:
                assert isinstance(end, Error)
                outcomes[end.kind.value] += 1


async def storm() -> Counter[str]:
    outcomes: Counter[str] = Counter()
    with anyio.fail_after(300):
        async with anyio.create_task_group() as tg:
            for i in range(CONNECTIONS):
                tg.start_soon(one_connection, i, outcomes)
    return outcomes


def idle() -> bool:
    with SyncClient() as c:
        snap = c.describe_fleet()
    return snap.active_requests == 0 and all(m.busy == 0 and m.queued == 0
                                             for m in snap.loaded_models)


def settle(pid: int) -> tuple[int, int]:
    wait_until(idle, "the daemon to be idle", timeout=10)
    # Connections closed by clients are reaped: their descriptors stop changing.
    def steady() -> bool:
        before = fds(pid)
        time.sleep(0.05)
        return fds(pid) == before

    wait_until(steady, "the daemon's descriptors to settle", timeout=10)
    return fds(pid), rss_kib(pid)


def test_two_hundred_connections_lose_nothing_and_leak_nothing(daemon: int) -> None:
    first = anyio.run(storm)
    assert sum(first.values()) == CONNECTIONS * REQUESTS_EACH
    assert first["finished"] > 0 and first["Rejected"] > 0, first
    assert set(first) <= {"finished", "Rejected"}, first
    fd1, rss1 = settle(daemon)
    second = anyio.run(storm)
    assert sum(second.values()) == CONNECTIONS * REQUESTS_EACH
    fd2, rss2 = settle(daemon)
    assert fd2 == fd1, (fd1, fd2)
    assert rss2 - rss1 < 16 * 1024, (rss1, rss2)  # KiB: no growth beyond allocator noise
    sys.stderr.write(f"\nload: {dict(first)} then {dict(second)}; fds {fd1}->{fd2}; "
                     f"RSS {rss1}->{rss2} KiB\n")
