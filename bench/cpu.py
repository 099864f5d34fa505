"""CPU per generated token of each process on the per-token path: daemon, engine, client.

Starts its own daemon on a GGUF (the tests' tiny model shows host work best), streams K
concurrent greedy answers of N tokens through our async client, ROUNDS times, and prints
each process's user + system CPU time (``/proc``, ``getrusage``) divided by the tokens.
On a machine with fewer cores than the engine's threads plus two, every microsecond the
daemon and the client spend comes out of the engine's compute.

    .venv/bin/python bench/cpu.py --model tiny.gguf [-k 1] [-n 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from everycycle.client import BaseClient, connect
from everycycle.protocol import Format, Tokens


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_of(parent: int) -> int:
    """The one child process of ``parent`` (the daemon's engine)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == parent:
                return int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue
    raise SystemExit("the daemon has no engine process")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def stream(client: BaseClient, i: int, n: int, counts: list[int]) -> None:
    async for ev in client.generate("bench", f"Write a long story, chapter {i}:", max_tokens=n,
                                    temperature=0.0, format=Format.RAW):
        if isinstance(ev, Tokens):
            counts.append(len(ev.chunk.ids))


async def measure(sock: Path, daemon: int, k: int, n: int, rounds: int) -> None:
    async with connect(sock) as client:
        await client.load("bench")
        warm: list[int] = []
        await stream(client, 0, 8, warm)
        engine = child_of(daemon)
        counts: list[int] = []
        before = cpu_seconds(daemon), cpu_seconds(engine), own_cpu_seconds()
        start = time.perf_counter()
        for _ in range(rounds):
            async with anyio.create_task_group() as tg:
                for i in range(k):
                    tg.start_soon(stream, client, i, n, counts)
        wall = time.perf_counter() - start
        after = cpu_seconds(daemon), cpu_seconds(engine), own_cpu_seconds()
    tokens = sum(counts)
    d, e, c = (1e6 * (a - b) / tokens for a, b in zip(after, before, strict=True))
    print(f"{k} streams x {n} tokens x {rounds} rounds: {tokens / wall:.0f} tok/s; CPU per "
          f"token: daemon {d:.1f} us, engine {e:.1f} us, client {c:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("-k", type=int, default=1, help="concurrent streams")
    ap.add_argument("-n", type=int, default=1024, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="eccpu", dir="/tmp"))
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{args.model.resolve()}"\ncontext = 4096\n'
                      f"parallel = {max(args.k, 1)}\nspeculative = false\n")
    os.environ["EVERYCYCLE_HOME"] = str(home)
    sock = home / "run" / "everycycle.sock"
    daemon = subprocess.Popen([sys.executable, "-m", "everycycle", "daemon", "--models",
                               str(models)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        while not sock.exists():
            if daemon.poll() is not None:
                raise SystemExit("the daemon did not start")
            time.sleep(0.05)
        anyio.run(measure, sock, daemon.pid, args.k, args.n, args.rounds)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)


if __name__ == "__main__":
    main()
