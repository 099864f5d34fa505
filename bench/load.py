"""Concurrent load through the daemon, optionally against llama-server in the same run.

Starts its own daemon (and, with --llama-server, a llama-server with -np K) on the same
GGUF and threads, runs K concurrent greedy streams of N tokens on each, and prints
aggregate decode tok/s, time to first token p50/p95, and the ratio. Also measures the
daemon's single-stream TTFT against the embedded path, and what a follow-up prompt
that extends a previous one costs to prefill.

    .venv/bin/python bench/load.py -k 4 -n 128 [--llama-server PATH] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from everycycle.client import BaseClient, connect, embedded
from everycycle.protocol import Format, Tokens
from everycycle.registry import load_registry, local_file

TOPICS = ["a lighthouse keeper", "a lost cat", "the first snow", "a robot gardener",
          "an old clock", "a desert train", "a quiet library", "a storm at sea"]


def prompt(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}. Chapter {i}:"


@dataclass
class Run:
    tokens: int
    wall: float
    ttfts: list[float]

    def line(self, name: str) -> str:
        p50 = statistics.median(self.ttfts) * 1000
        ordered = sorted(self.ttfts)
        p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)] * 1000
        return (f"{name:<14} {self.tokens / self.wall:7.1f} tok/s aggregate  "
                f"TTFT p50 {p50:6.1f} ms  p95 {p95:6.1f} ms  ({self.tokens} tokens, "
                f"{self.wall:.2f} s)")

    @property
    def rate(self) -> float:
        return self.tokens / self.wall


async def one_stream(client: BaseClient, i: int, n: int, out: list[tuple[int, float]]) -> None:
    start = time.perf_counter()
    first: float | None = None
    count = 0
    async for ev in client.generate("bench", prompt(i), max_tokens=n, temperature=0.0,
                                    format=Format.RAW):
        if isinstance(ev, Tokens):
            if first is None and ev.chunk.ids:
                first = time.perf_counter() - start
            count += len(ev.chunk.ids)
    out.append((count, first or 0.0))


async def everycycle_load(client: BaseClient, k: int, n: int) -> Run:
    out: list[tuple[int, float]] = []
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(k):
            tg.start_soon(one_stream, client, i, n, out)
    wall = time.perf_counter() - start
    return Run(sum(c for c, _ in out), wall, [t for _, t in out])


def daemon_run(models: Path, sock: Path, k: int, n: int, rounds: int) -> Run:
    async def go() -> Run:
        async with connect(sock) as client:
            await client.load("bench")
            await everycycle_load(client, k, min(n, 8))  # warm-up
            runs = [await everycycle_load(client, k, n) for _ in range(rounds)]
        return max(runs, key=lambda r: r.rate)

    return anyio.run(go)


# ----------------------------------------------------------------- llama-server


async def server_stream(port: int, i: int, n: int, out: list[tuple[int, float]]) -> None:
    body = json.dumps({"prompt": prompt(i), "n_predict": n, "temperature": 0.0,
                       "stream": True, "cache_prompt": True}).encode()
    start = time.perf_counter()
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream:
        await stream.send(
            b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        )
        buf = b""
        first: float | None = None
        count = 0
        try:
            while True:
                buf += await stream.receive()
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.startswith(b"data: "):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("content") and first is None:
                        first = time.perf_counter() - start
                    if ev.get("stop"):
                        count = ev.get("timings", {}).get("predicted_n", count)
                    elif ev.get("content") is not None:
                        count += 1
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    out.append((count, first or 0.0))


def server_run(binary: Path, model: Path, k: int, n: int, rounds: int, threads: int) -> Run:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(binary), "-m", str(model), "-np", str(k), "-c", str(4096 * k), "-t", str(threads),
         "-tb", str(threads), "--port", str(port), "--host", "127.0.0.1", "-ngl", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                    c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    if b" 200 " in c.recv(100):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("llama-server did not start")
            time.sleep(0.2)

        async def go() -> Run:
            async def load(nn: int) -> Run:
                out: list[tuple[int, float]] = []
                start = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for i in range(k):
                        tg.start_soon(server_stream, port, i, nn, out)
                wall = time.perf_counter() - start
                return Run(sum(c for c, _ in out), wall, [t for _, t in out])

            await load(min(n, 8))
            runs = [await load(n) for _ in range(rounds)]
            return max(runs, key=lambda r: r.rate)

        return anyio.run(go)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


# ----------------------------------------------------------------- ttft and prefix reuse


def ttft(client_cm: object, n_samples: int) -> list[float]:
    async def go() -> list[float]:
        async with client_cm as client:  # type: ignore[attr-defined]
            await client.load("bench")
            times = []
            for i in range(n_samples + 1):
                out: list[tuple[int, float]] = []
                await one_stream(client, i, 1, out)
                times.append(out[0][1])
            return times[1:]

    return anyio.run(go)


def prefix_reuse(sock: Path) -> tuple[float, float, float]:
    """TTFT of a long fresh prompt, of the same prompt extended, and of another fresh one."""
    base = " ".join(f"Fact {i}: the lighthouse keeper counts ships." for i in range(60))

    async def first_token(client: BaseClient, text: str) -> float:
        start = time.perf_counter()
        async for ev in client.generate("bench", text, max_tokens=1, temperature=0.0,
                                        format=Format.RAW):
            if isinstance(ev, Tokens):
                return time.perf_counter() - start
        return float("nan")

    async def go() -> tuple[float, float, float]:
        async with connect(sock) as client:
            fresh = await first_token(client, base)
            extended = await first_token(client, base + " Question: how many ships?")
            other = await first_token(client, base.replace("lighthouse", "harbour", 1)[::-1])
            return fresh, extended, other

    return anyio.run(go)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", type=int, default=4, help="concurrent streams")
    ap.add_argument("-n", type=int, default=128, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--ttft-samples", type=int, default=10)
    args = ap.parse_args()
    model = args.model or local_file(load_registry().get("gemma-3-270m"))
    threads = os.cpu_count() or 1
    home = Path(tempfile.mkdtemp(prefix="ecb", dir="/tmp"))
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model}"\ncontext = 4096\n'
                      f"parallel = {max(args.k, 1)}\n")
    env = {**os.environ, "EVERYCYCLE_HOME": str(home)}
    sock = home / "run" / "everycycle.sock"
    os.environ["EVERYCYCLE_HOME"] = str(home)
    daemon = subprocess.Popen([sys.executable, "-m", "everycycle", "daemon", "--models",
                               str(models)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        while not sock.exists():
            if daemon.poll() is not None:
                raise SystemExit("the daemon did not start")
            time.sleep(0.05)
        ours = daemon_run(models, sock, args.k, args.n, args.rounds)
        fresh, extended, other = prefix_reuse(sock)
        via_daemon = ttft(connect(sock), args.ttft_samples)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    in_process = ttft(embedded(models), args.ttft_samples)
    print(f"model {model.name}, {args.k} streams x {args.n} tokens, {threads} threads")
    print(ours.line("everycycle"))
    if args.llama_server:
        theirs = server_run(args.llama_server, model, args.k, args.n, args.rounds, threads)
        print(theirs.line("llama-server"))
        print(f"ratio everycycle/llama-server: {ours.rate / theirs.rate:.3f}")
    d50, e50 = statistics.median(via_daemon) * 1000, statistics.median(in_process) * 1000
    print(f"single-stream TTFT p50: daemon {d50:.1f} ms, embedded {e50:.1f} ms, "
          f"difference {d50 - e50:+.1f} ms")
    print(f"prefix reuse: long prompt {fresh * 1000:.0f} ms to first token; the same prompt "
          f"extended {extended * 1000:.0f} ms; an unrelated prompt of the same length "
          f"{other * 1000:.0f} ms")


if __name__ == "__main__":
    main()
