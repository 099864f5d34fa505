"""Remote executors: the RPC servers' devices, probed in a child process, and where they
stand among the local executors (the one place that orders executors)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import anyio
import anyio.to_thread

from ...errors import EverycycleError
from ...hardware import executors as ex
from ...protocol import ExecutorSummary

log = logging.getLogger(__name__)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


N = TypeVar("N", bound=_Named)


def in_order(local: Sequence[N], remote: Sequence[N]) -> list[N]:
    """Local GPUs first, then remote executors, the CPU last: the order ``auto``
    placement tries executors in, and the order ``fleet`` shows them in."""
    return ([e for e in local if e.name != "cpu"] + list(remote)
            + [e for e in local if e.name == "cpu"])


def _summary(e: ex.Executor, status: str | None = None) -> ExecutorSummary:
    return ExecutorSummary(e.name, e.vendor, len(e.devices), e.memory_total, e.memory_free,
                           status=status)


class RemoteHosts:
    """The RPC servers (``--rpc`` and models.toml) and what each last said: its
    executors, or why it cannot be reached."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = tuple(dict.fromkeys(hosts))
        self.found: dict[str, list[ex.Executor] | str] = {}

    def down(self, endpoint: str) -> str | None:
        """Why ``endpoint`` cannot be reached, when it was last seen so."""
        found = self.found.get(endpoint)
        return found if isinstance(found, str) else None

    def mark_down(self, endpoint: str, why: str) -> None:
        self.found[endpoint] = why

    def executors(self) -> list[ex.Executor]:
        return [e for found in self.found.values() if isinstance(found, list) for e in found]

    async def probe(self, in_use: Callable[[str], bool], *, only_down: bool = False) -> None:
        """Ask each RPC server not serving a model now for its devices (in a child
        process: ggml-rpc aborts the process that loses its server); with ``only_down``,
        just those last seen unreachable."""
        from ...hardware import rpc

        for endpoint in self.hosts:
            if only_down and self.down(endpoint) is None:
                continue
            if in_use(endpoint):
                continue  # a ggml RPC server serves one client at a time
            try:
                found = await anyio.to_thread.run_sync(rpc.probe_in_child, endpoint)
            except EverycycleError as exc:
                if self.found.get(endpoint) != exc.message:
                    log.warning("%s", exc.message)
                self.found[endpoint] = exc.message
                continue
            name = rpc.executor_name(endpoint)
            self.found[endpoint] = [
                ex.Executor(f"{name}/{d.index}", "remote",
                            (ex.Device(f"RPC{d.index}[{endpoint}]", endpoint, d.memory_total,
                                       d.memory_free, True),), remote=endpoint)
                for d in found]

    async def watch(self, in_use: Callable[[str], bool]) -> None:
        """Hosts that were down: every 15 s; every host's memory: every 2 minutes."""
        for tick in itertools.count(1):
            await anyio.sleep(15)
            await self.probe(in_use, only_down=tick % 8 != 0)

    def summaries(self, local: Sequence[ex.Executor],
                  dead: Callable[[str], bool]) -> tuple[ExecutorSummary, ...]:
        """Every executor as ``fleet`` shows it; ``dead(endpoint)``: its model's engine
        lost that host."""
        remote: list[ExecutorSummary] = []
        for endpoint in self.hosts:
            found = self.found.get(endpoint)
            if isinstance(found, list):
                status = "unreachable" if dead(endpoint) else None
                remote.extend(_summary(e, status) for e in found)
            else:
                remote.append(ExecutorSummary(f"rpc:{endpoint}", "remote", 0,
                                              status="unreachable"))
        return tuple(in_order([_summary(e) for e in local], remote))
