"""The HTTP API under load: our /v1/chat/completions vs llama-server's, and HTTP vs socket TTFT.

Starts its own daemon with --http on the default chat model (or --model) and, with
--llama-server, a llama-server with -np K on the same GGUF and threads. Rounds alternate:
K concurrent streaming chat completions of N greedy tokens through our HTTP, the same
requests through our socket protocol, then through llama-server. Prints aggregate tok/s
per side and the ratios (per round, median, best): HTTP against llama-server's, and
HTTP against our socket path. Then single-stream time to first token through our HTTP vs our socket,
alternating, p50 of each.

    .venv/bin/python bench/http.py -k 4 -n 128 --rounds 5 [--llama-server PATH] [--model PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

# This file is named http: running it puts bench/ first on sys.path, where it would
# shadow the standard library's http package for everything imported after it.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "tests"))

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import tempfile
import time

import anyio
from daemonhelp import daemon_process

_spec = importlib.util.spec_from_file_location("bench_load", _HERE / "load.py")
assert _spec is not None and _spec.loader is not None
_load = importlib.util.module_from_spec(_spec)
sys.modules["bench_load"] = _load  # dataclasses look their module up
_spec.loader.exec_module(_load)
Run, llama_server = _load.Run, _load.llama_server

from everycycle.client import SyncClient, connect
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Message, Role, Tokens

TOPICS = ["a lighthouse keeper", "a lost cat", "the first snow", "a robot gardener",
          "an old clock", "a desert train", "a quiet library", "a storm at sea"]


def question(i: int) -> str:
    return f"{i:04d}. Write a long story about {TOPICS[i % len(TOPICS)]}, in many chapters."


async def sse_chat(port: int, i: int, n: int, out: list[tuple[int, float]]) -> None:
    """One streaming chat completion; appends (completion tokens, time to first content)."""
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": question(i)}],
                       "max_tokens": n, "temperature": 0.0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    start = time.perf_counter()
    first: float | None = None
    chunks = 0
    usage: int | None = None
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream:
        await stream.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        buf = b""
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                buf += await stream.receive()
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.startswith(b"data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("usage"):
                        usage = ev["usage"].get("completion_tokens")
                    for choice in ev.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            chunks += 1
                            if first is None:
                                first = time.perf_counter() - start
    out.append((usage if usage is not None else chunks, first or 0.0))


async def concurrent(port: int, k: int, n: int) -> Run:
    return await _load.concurrent(sse_chat, port, k, n)


async def socket_chat(client: object, i: int, n: int, out: list[tuple[int, float]]) -> None:
    """The same chat request through our own protocol client on the daemon's socket."""
    start = time.perf_counter()
    first: float | None = None
    count = 0
    async for ev in client.generate(  # type: ignore[attr-defined]
            "bench", messages=(Message(Role.USER, question(i)),), max_tokens=n,
            temperature=0.0):
        if isinstance(ev, Tokens) and ev.chunk.ids:
            first = first or time.perf_counter() - start
            count += len(ev.chunk.ids)
    out.append((count, first or 0.0))


async def socket_concurrent(client: object, k: int, n: int) -> Run:
    return await _load.concurrent(socket_chat, client, k, n)


def side_by_side(ours: int, theirs: int | None, k: int, n: int, rounds: int
                 ) -> tuple[list[Run], list[Run], list[Run]]:
    """Rounds of: our HTTP, our socket (the same requests), llama-server's HTTP."""
    async def go() -> tuple[list[Run], list[Run], list[Run]]:
        async with connect() as client:
            await concurrent(ours, k, 8)  # warm-up: load, first allocations
            await socket_concurrent(client, k, 8)
            if theirs is not None:
                await concurrent(theirs, k, 8)
            a, s, b = [], [], []
            for _ in range(rounds):
                a.append(await concurrent(ours, k, n))
                s.append(await socket_concurrent(client, k, n))
                if theirs is not None:
                    b.append(await concurrent(theirs, k, n))
            return a, s, b

    return anyio.run(go)


def ttft_http_vs_socket(port: int, samples: int) -> tuple[list[float], list[float]]:
    async def via_socket(client: object, i: int) -> float:
        start = time.perf_counter()
        async for ev in client.generate(  # type: ignore[attr-defined]
                "bench", messages=(Message(Role.USER, question(i)),), max_tokens=1,
                temperature=0.0):
            if isinstance(ev, Tokens) and ev.chunk.ids:
                return time.perf_counter() - start
        return float("nan")

    async def go() -> tuple[list[float], list[float]]:
        http, sock = [], []
        async with connect() as client:
            for i in range(samples):
                # Each request has its own prompt (a fresh number up front, so only the
                # template's prefix is cached), and the sides take turns going first.
                out: list[tuple[int, float]] = []
                if i % 2:
                    sock.append(await via_socket(client, 1000 + 2 * i))
                    await sse_chat(port, 1000 + 2 * i + 1, 1, out)
                else:
                    await sse_chat(port, 1000 + 2 * i, 1, out)
                    sock.append(await via_socket(client, 1000 + 2 * i + 1))
                http.append(out[0][1])
        return http, sock

    return anyio.run(go)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", type=int, default=4, help="concurrent streams")
    ap.add_argument("-n", type=int, default=128, help="tokens per stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--ttft-samples", type=int, default=20)
    ap.add_argument("--lookup", action="store_true",
                    help="let the daemon use prompt-lookup drafts (llama-server drafts none, "
                    "so the ratio then measures more than the HTTP path)")
    args = ap.parse_args()
    reg = load_registry()
    model = args.model or local_file(reg.get(reg.default_name()))
    threads = os.cpu_count() or 1
    home = Path(tempfile.mkdtemp(prefix="ech", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model.resolve()}"\ncontext = 4096\n'
                      f"parallel = {max(args.k, 1)}\n"
                      + ("" if args.lookup else "speculative = false\n"))
    with daemon_process("--models", str(models), "--http", "127.0.0.1:0"):
        with SyncClient() as c:
            c.load("bench")
            url = c.describe_fleet().http
        assert url is not None
        ours = int(url.rpartition(":")[2])
        with contextlib.ExitStack() as stack:
            theirs = None
            if args.llama_server:
                theirs = stack.enter_context(llama_server(args.llama_server, model, args.k,
                                                          threads))
            a, sock_runs, b = side_by_side(ours, theirs, args.k, args.n, args.rounds)
        http, sock = ttft_http_vs_socket(ours, args.ttft_samples)
    print(f"model {model.name}, {args.k} streaming chat completions x {args.n} tokens, "
          f"{threads} threads, {args.rounds} alternating rounds, our prompt lookup "
          f"{'on' if args.lookup else 'off (as llama-server)'}")
    best = max(a, key=lambda r: r.rate)
    print(best.line("everycycle"))
    print(max(sock_runs, key=lambda r: r.rate).line("our socket"))
    over = [x.rate / y.rate for x, y in zip(a, sock_runs, strict=True)]
    print(f"ratio our HTTP/our socket (the same chat requests): per round "
          f"{' '.join(f'{r:.3f}' for r in over)}, median {statistics.median(over):.3f}")
    if b:
        best_b = max(b, key=lambda r: r.rate)
        print(best_b.line("llama-server"))
        ratios = [x.rate / y.rate for x, y in zip(a, b, strict=True)]
        print(f"ratio everycycle/llama-server: per round {' '.join(f'{r:.3f}' for r in ratios)}"
              f", median {statistics.median(ratios):.3f}, best {best.rate / best_b.rate:.3f}")
    h50, s50 = statistics.median(http) * 1000, statistics.median(sock) * 1000
    paired = statistics.median(h - s for h, s in zip(http, sock, strict=True)) * 1000
    print(f"single-stream TTFT p50 over {args.ttft_samples}: HTTP {h50:.1f} ms, socket "
          f"{s50:.1f} ms, difference {h50 - s50:+.1f} ms (median of paired differences "
          f"{paired:+.1f} ms)")


if __name__ == "__main__":
    main()
