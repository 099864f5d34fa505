"""Embeddings per second through the daemon vs llama-server, and constrained generation.

Starts its own daemon on the default model (or --model) and, with --llama-server, a
llama-server with --embeddings (mean pooling where the model declares none, as ours)
on the same GGUF and threads. Rounds alternate: 1,000 short texts, as 4 concurrent
clients sending 50 texts per request, through our socket, then through llama-server's
/v1/embeddings. Prints texts/s per side and the ratio. Then greedy generation of N
tokens on one prompt with and without a JSON schema, tok/s of each.

    .venv/bin/python bench/embed.py [--llama-server PATH] [--rounds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
from load import llama_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemonhelp import daemon_process

from everycycle.client import connect
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Tokens

TEXTS = [f"Item {i}: a short note about {w} number {i % 97}." for i, w in
         enumerate(["gardens", "boats", "clocks", "trains", "libraries", "storms"] * 167)][:1000]
CLIENTS, PER_REQUEST = 4, 50
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"},
    "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "thriller"]}}},
    "required": ["title", "year", "genres"]}


def chunks(texts: list[str]) -> list[list[str]]:
    return [texts[i:i + PER_REQUEST] for i in range(0, len(texts), PER_REQUEST)]


async def ours_round() -> float:
    work = chunks(TEXTS)
    start = time.perf_counter()

    async def client(k: int) -> None:
        async with connect() as c:
            for batch in work[k::CLIENTS]:
                vectors = await c.embed("bench", batch)
                assert len(vectors) == len(batch)

    async with anyio.create_task_group() as tg:
        for k in range(CLIENTS):
            tg.start_soon(client, k)
    return len(TEXTS) / (time.perf_counter() - start)


async def post(port: int, body: bytes) -> dict[str, object]:
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream:
        await stream.send(b"POST /v1/embeddings HTTP/1.1\r\nHost: localhost\r\n"
                          b"Content-Type: application/json\r\nConnection: close\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        try:
            while True:
                data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    head, _, rest = data.partition(b"\r\n\r\n")
    if b"chunked" in head.lower():
        out, rest2 = b"", rest
        while rest2:
            size_line, _, rest2 = rest2.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            out, rest2 = out + rest2[:size], rest2[size + 2:]
        rest = out
    result: dict[str, object] = json.loads(rest)
    return result


async def theirs_round(port: int) -> float:
    work = chunks(TEXTS)
    start = time.perf_counter()

    async def client(k: int) -> None:
        for batch in work[k::CLIENTS]:
            body = json.dumps({"input": batch, "model": "bench"}).encode()
            answer = await post(port, body)
            data = answer.get("data")
            assert isinstance(data, list) and len(data) == len(batch), answer

    async with anyio.create_task_group() as tg:
        for k in range(CLIENTS):
            tg.start_soon(client, k)
    return len(TEXTS) / (time.perf_counter() - start)


async def constrained(n: int) -> tuple[float, float]:
    prompt = "Describe a famous film as JSON with its title, year and genres."
    rates = []
    async with connect() as c:
        for schema in (None, json.dumps(SCHEMA)):
            start = time.perf_counter()
            count = 0
            async for ev in c.generate("bench", prompt, max_tokens=n, temperature=0.0,
                                       json_schema=schema):
                if isinstance(ev, Tokens):
                    count += len(ev.chunk.ids)
            rates.append(count / (time.perf_counter() - start))
    return rates[0], rates[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("-n", type=int, default=128, help="tokens for the constrained run")
    args = ap.parse_args()
    reg = load_registry()
    model = args.model or local_file(reg.get(reg.default_name()))
    threads = os.cpu_count() or 1
    home = Path(tempfile.mkdtemp(prefix="ece", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model}"\ncontext = 4096\nparallel = 4\n')
    a: list[float] = []
    b: list[float] = []
    with daemon_process("--models", str(models)):
        anyio.run(ours_round)  # load, warm up
        if args.llama_server:
            with llama_server(args.llama_server, model, CLIENTS, threads,
                              extra=["--embeddings", "--pooling", "mean", "-ub", "2048",
                                     "-b", "2048"]) as port:
                anyio.run(theirs_round, port)
                for _ in range(args.rounds):
                    a.append(anyio.run(ours_round))
                    b.append(anyio.run(theirs_round, port))
        else:
            a = [anyio.run(ours_round) for _ in range(args.rounds)]
        free, schema = anyio.run(constrained, args.n)
    print(f"model {model.name}, {len(TEXTS)} texts per round, {CLIENTS} clients x "
          f"{PER_REQUEST} texts a request, {threads} threads, {args.rounds} rounds")
    print(f"everycycle    {max(a):7.1f} texts/s best, per round {' '.join(f'{x:.1f}' for x in a)}")
    if b:
        print(f"llama-server  {max(b):7.1f} texts/s best, per round "
              f"{' '.join(f'{x:.1f}' for x in b)}")
        ratios = [x / y for x, y in zip(a, b, strict=True)]
        print(f"ratio everycycle/llama-server: median {statistics.median(ratios):.3f}, "
              f"best {max(a) / max(b):.3f}")
    print(f"greedy generation, {args.n} tokens max: free {free:.1f} tok/s, under a JSON "
          f"schema {schema:.1f} tok/s ({schema / free:.2f}x)")


if __name__ == "__main__":
    main()
