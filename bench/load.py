"""Concurrent load through the daemon, optionally against llama-server in the same run.

Starts its own daemon (and, with --llama-server, a llama-server with -np K) on the same
GGUF and threads, runs K concurrent greedy streams of N tokens on each, and prints
aggregate decode tok/s, time to first token p50/p95, and the ratio; our side twice,
through our client library and through a raw JSON-lines client (read as the
llama-server side is read). Also measures the
daemon's single-stream TTFT against the embedded path, and what a follow-up prompt
that extends a previous one costs to prefill.

    .venv/bin/python bench/load.py -k 4 -n 128 [--llama-server PATH] [--model PATH ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from everycycle import paths
from everycycle.client import BaseClient, connect, embedded
from everycycle.hardware import cpukernels
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Format, Tokens

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


Stream = Callable[[Any, int, int, list[tuple[int, float]]], Awaitable[None]]


async def concurrent(stream: Stream, target: Any, k: int, n: int) -> Run:
    """Run ``k`` streams of ``n`` tokens at once against ``target``."""
    out: list[tuple[int, float]] = []
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(k):
            tg.start_soon(stream, target, i, n, out)
    wall = time.perf_counter() - start
    return Run(sum(c for c, _ in out), wall, [t for _, t in out])


async def everycycle_load(client: BaseClient, k: int, n: int) -> Run:
    return await concurrent(one_stream, client, k, n)


SPECULATIVE: bool | None = None
"""The raw client's ``speculative`` (None: not sent, the model's default)."""


async def raw_stream(sock: Path, i: int, n: int, out: list[tuple[int, float]]) -> None:
    """One stream as a client of our own would read it that is not our client library:
    a line of JSON out, lines of JSON in, ``json.loads`` each (as ``server_stream`` reads
    llama-server, and on the same kind of asyncio stream)."""
    body: dict[str, dict[str, object]] = {"Generate": {
        "request_id": f"raw-{i}", "model": "bench", "prompt": prompt(i), "max_tokens": n,
        "temperature": 0.0, "format": "raw"}}
    if SPECULATIVE is not None:
        body["Generate"]["speculative"] = SPECULATIVE
    start = time.perf_counter()
    reader, writer = await asyncio.open_unix_connection(str(sock))
    first: float | None = None
    count = 0
    try:
        writer.write(json.dumps(body).encode() + b"\n")
        while line := await reader.readline():
            ev = json.loads(line)
            tokens = ev.get("Tokens")
            if tokens is None:
                if "Done" in ev or "Error" in ev:
                    break
                continue
            if tokens["chunk"]["ids"] and first is None:
                first = time.perf_counter() - start
            count += len(tokens["chunk"]["ids"])
            if tokens["finished"]:
                break
    finally:
        writer.close()
    out.append((count, first or 0.0))


async def raw_load(sock: Path, k: int, n: int) -> Run:
    return await concurrent(raw_stream, sock, k, n)


# ----------------------------------------------------------------- llama-server


async def server_stream(port: int, i: int, n: int, out: list[tuple[int, float]]) -> None:
    body = json.dumps({"prompt": prompt(i), "n_predict": n, "temperature": 0.0,
                       "stream": True, "cache_prompt": True}).encode()
    start = time.perf_counter()
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream:
        await stream.send(
            b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
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


async def server_load(port: int, k: int, n: int) -> Run:
    return await concurrent(server_stream, port, k, n)


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, k: int, threads: int, *, ctx: int = 4096,
                 extra: Sequence[str] = ()) -> Iterator[int]:
    """A llama-server with -np K on ``model``; yields its port once healthy."""
    with llama_server_process(binary, model, k, threads, ctx=ctx, extra=extra) as (port, _):
        yield port


@contextlib.contextmanager
def llama_server_process(binary: Path, model: Path, k: int, threads: int, *, ctx: int = 4096,
                         extra: Sequence[str] = ()) -> Iterator[tuple[int, int]]:
    """A llama-server with -np K slots of ``ctx`` tokens; yields (port, pid) once healthy.

    Like for like: where our engines load without the CPU's extra buffer types (the
    probe saw them fault, or EVERYCYCLE_CPU_EXTRA=off), so does it (``--no-repack``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repack = () if cpukernels.decide(paths.state_dir()).extra else ("--no-repack",)
    proc = subprocess.Popen(
        [str(binary), "-m", str(model), "-np", str(k), "-c", str(ctx * k), "-t", str(threads),
         "-tb", str(threads), "--port", str(port), "--host", "127.0.0.1", "-ngl", "0",
         *repack, *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as c:
                    c.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                    if b" 200 " in c.recv(100):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("llama-server did not start")
            time.sleep(0.2)
        yield port, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def greedy_stream(c: Any, model: str, prompt: str, n: int, **options: Any
                  ) -> tuple[float, list[int]]:
    """One greedy stream on a blocking client: decode tok/s (first to last token) and
    the ids. Exits naming the model on an Error."""
    from everycycle.protocol import Error

    ids: list[int] = []
    first = last = 0.0
    for event in c.generate(model, prompt, max_tokens=n, temperature=0.0, **options):
        if isinstance(event, Error):
            raise SystemExit(f"{model}: {event.message}")
        if isinstance(event, Tokens) and event.chunk.ids:
            now = time.perf_counter()
            first = first or now
            last = now
            ids.extend(event.chunk.ids)
    return ((len(ids) - 1) / (last - first) if last > first else float("nan")), ids


def side_by_side(sock: Path, port: int | None, k: int, n: int, rounds: int
                 ) -> tuple[list[Run], list[Run], list[Run]]:
    """Alternate rounds: everycycle through our client, through a raw socket client,
    then llama-server (if any), ``rounds`` times."""

    async def go() -> tuple[list[Run], list[Run], list[Run]]:
        async with connect(sock) as client:
            await client.load("bench")
            await everycycle_load(client, k, min(n, 8))  # warm-up
            await raw_load(sock, k, min(n, 8))
            if port is not None:
                await server_load(port, k, min(n, 8))
            ours, raw, theirs = [], [], []
            for _ in range(rounds):
                ours.append(await everycycle_load(client, k, n))
                raw.append(await raw_load(sock, k, n))
                if port is not None:
                    theirs.append(await server_load(port, k, n))
            return ours, raw, theirs

    return anyio.run(go)


# ----------------------------------------------------------------- ttft and prefix reuse


def lookup_ab(sock: Path, k: int, n: int, rounds: int) -> None:
    """Prompt lookup forced on against off, on one daemon and model, in alternating
    rounds (the raw client's ``speculative``); both sides checked to make as many
    tokens."""
    global SPECULATIVE

    drafts: list[str] = []

    async def go() -> list[tuple[Run, Run]]:
        global SPECULATIVE
        async with connect(sock) as client:
            await client.load("bench")
            await raw_load(sock, k, min(n, 8))  # warm-up
            pairs, seen = [], (0, 0)
            for _ in range(rounds):
                SPECULATIVE = True
                on = await raw_load(sock, k, n)
                (m,) = (await client.describe_fleet()).loaded_models
                now = m.drafted("lookup")
                drafts.append(f"{now[1] - seen[1]}/{now[0] - seen[0]}")
                seen = now
                SPECULATIVE = False
                off = await raw_load(sock, k, n)
                pairs.append((on, off))
            return pairs

    pairs = anyio.run(go)
    SPECULATIVE = None
    for on, off in pairs:
        if on.tokens != off.tokens:
            raise SystemExit(f"lookup on made {on.tokens} tokens, off {off.tokens}: "
                             "not the same work")
    ratios = [on.rate / off.rate for on, off in pairs]
    print(max((p[0] for p in pairs), key=lambda r: r.rate).line("lookup on"))
    print(max((p[1] for p in pairs), key=lambda r: r.rate).line("lookup off"))
    print(f"ratio lookup on/off ({k} streams): median {statistics.median(ratios):.3f}, "
          f"rounds in order {' '.join(f'{r:.3f}' for r in ratios)}; draft tokens accepted/"
          f"drafted by round {' '.join(drafts)}")


def ttft_pair(sock: Path, models: Path, n_samples: int) -> tuple[list[float], list[float]]:
    """Single-stream time to first token, alternating daemon and embedded requests."""

    async def first(client: BaseClient, i: int) -> float:
        out: list[tuple[int, float]] = []
        await one_stream(client, i, 1, out)
        return out[0][1]

    async def go() -> tuple[list[float], list[float]]:
        async with connect(sock) as daemon, embedded(models) as local:
            await daemon.load("bench")
            await local.load("bench")
            await first(daemon, 0)
            await first(local, 0)
            via_daemon, in_process = [], []
            for i in range(n_samples):
                # (A pause between: each side's engine spins its OpenMP threads for a
                # few ms after its last step, which would take a core from the other.)
                await anyio.sleep(0.05)
                via_daemon.append(await first(daemon, i))
                await anyio.sleep(0.05)
                in_process.append(await first(local, i))
            return via_daemon, in_process

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
            unrelated = " ".join(f"Note {i}: the harbour master counts boats." for i in range(60))
            other = await first_token(client, unrelated)
            return fresh, extended, other

    return anyio.run(go)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", type=int, default=4, help="concurrent streams")
    ap.add_argument("-n", type=int, default=128, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", type=Path, action="append",
                    help="a GGUF (repeat for several, one after another; default gemma-3-270m)")
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--ttft-samples", type=int, default=10)
    ap.add_argument("--threads", type=int,
                    help="the daemon's threads (models.toml's threads; default: its own choice)")
    ap.add_argument("--server-threads", type=int,
                    help="llama-server's -t and -tb (default: every core)")
    ap.add_argument("--no-lookup", action="store_true",
                    help="speculative = false for the daemon's model (prompt lookup off)")
    ap.add_argument("--lookup-ab", action="store_true",
                    help="only prompt lookup forced on against off, alternating rounds")
    ap.add_argument("--ngl", type=int, default=0,
                    help="llama-server's -ngl (99 on a GPU; the daemon places by itself)")
    args = ap.parse_args()
    for model in args.model or [local_file(load_registry().get("gemma-3-270m"))]:
        bench_model(model, args)


def bench_model(model: Path, args: argparse.Namespace) -> None:
    """One model: its own daemon (and llama-server), every figure printed."""
    threads = os.cpu_count() or 1
    home = Path(tempfile.mkdtemp(prefix="ecb", dir="/tmp"))
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model.resolve()}"\ncontext = 4096\n'
                      f"parallel = {max(args.k, 1)}\n"
                      + (f"threads = {args.threads}\n" if args.threads else "")
                      + ("speculative = false\n" if args.no_lookup else ""))
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
        if args.lookup_ab:
            print(f"model {model.name}, {args.k} streams x {args.n} tokens, "
                  f"{args.rounds} alternating rounds, raw client")
            lookup_ab(sock, args.k, args.n, args.rounds)
            return
        with contextlib.ExitStack() as stack:
            port = None
            if args.llama_server:
                port = stack.enter_context(llama_server(
                    args.llama_server, model, args.k, args.server_threads or threads,
                    extra=("-ngl", str(args.ngl))))
            ours, raw, theirs = side_by_side(sock, port, args.k, args.n, args.rounds)
        fresh, extended, other = prefix_reuse(sock)
        via_daemon, in_process = ttft_pair(sock, models, args.ttft_samples)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    print(f"model {model.name}, {args.k} streams x {args.n} tokens, daemon threads "
          f"{args.threads or 'default'}, llama-server -t {args.server_threads or threads}, "
          f"{args.rounds} alternating rounds (best of each shown); our prompt lookup "
          f"{'off' if args.no_lookup else 'on where batches are exact'}; CPU extra kernels "
          f"{'on' if cpukernels.decide(paths.state_dir()).extra else 'off (both sides)'}")
    best = max(ours, key=lambda r: r.rate)
    print(best.line("everycycle"))
    best_raw = max(raw, key=lambda r: r.rate)
    print(best_raw.line("raw client"))
    if theirs:
        best_theirs = max(theirs, key=lambda r: r.rate)
        print(best_theirs.line("llama-server"))
        for name, runs, top in (("everycycle", ours, best), ("raw client", raw, best_raw)):
            ratios = sorted(o.rate / t.rate for o, t in zip(runs, theirs, strict=True))
            print(f"ratio {name}/llama-server: best {top.rate / best_theirs.rate:.3f}, "
                  f"per round {' '.join(f'{r:.3f}' for r in ratios)}, "
                  f"median {statistics.median(ratios):.3f}")
    d50, e50 = statistics.median(via_daemon) * 1000, statistics.median(in_process) * 1000
    print(f"single-stream TTFT p50: daemon {d50:.1f} ms, embedded {e50:.1f} ms, "
          f"difference {d50 - e50:+.1f} ms")
    print(f"prefix reuse: long prompt {fresh * 1000:.0f} ms to first token; the same prompt "
          f"extended {extended * 1000:.0f} ms; an unrelated prompt of similar length "
          f"{other * 1000:.0f} ms")


if __name__ == "__main__":
    main()
