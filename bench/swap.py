"""Many models, one memory: two or three models with room for one, N interleaved clients.

Runs the same load twice in one run, side by side, on its own daemons:
- **fifo**: each waiting load makes room as soon as it may (``--swap-after 0
  --min-residency 0``): requests are served nearly in arrival order, a swap each time
  the model changes;
- **policy**: the defaults (a resident model serves what comes for it for a while
  before it gives way; nobody waits past the bound).

Prints loads, p50/p95 latency, throughput and how many requests were answered for each.

    .venv/bin/python bench/swap.py [--model PATH] [--models 2] [--clients 8] [--requests 6]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from everycycle import paths
from everycycle.client import connect
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Tokens

HERE = Path(__file__).resolve().parent


def registry(folder: Path, gguf: Path, n: int, context: int) -> Path:
    f = folder / "swap.toml"
    f.write_text("max_loaded_models = 1\n" + "".join(
        f'[models.m{i}]\npath = "{gguf}"\ncontext = {context}\nparallel = 4\n'
        "kv_cache_disk = 0\n" for i in range(n)))
    return f


async def client(k: int, n_models: int, requests: int, tokens: int,
                 latencies: list[float], answered: list[int]) -> None:
    async with connect() as c:
        for j in range(requests):
            model = f"m{(k + j) % n_models}"  # every client alternates models
            started = time.monotonic()
            events = [e async for e in c.generate(model, f"Story {k}.{j}:", max_tokens=tokens,
                                                  temperature=0.0)]
            latencies.append(time.monotonic() - started)
            if isinstance(events[-1], Tokens) and events[-1].finished:
                answered.append(1)


def run(name: str, folder: Path, models: Path, args: argparse.Namespace,
        flags: list[str]) -> str:
    home = folder / name
    env_home = {"EVERYCYCLE_HOME": str(home)}
    import os

    os.environ.update(env_home)
    daemon = subprocess.Popen([sys.executable, "-m", "everycycle", "daemon", "--models",
                               str(models), *flags], stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if paths.socket_path().exists():
                break
            time.sleep(0.05)
        latencies: list[float] = []
        answered: list[int] = []

        async def go() -> float:
            started = time.monotonic()
            async with anyio.create_task_group() as tg:
                for k in range(args.clients):
                    tg.start_soon(client, k, args.models, args.requests, args.tokens,
                                  latencies, answered)
            return time.monotonic() - started

        wall = anyio.run(go)
    finally:
        daemon.terminate()
        daemon.wait(30)
    records = [json.loads(line) for line in paths.audit_file().read_text().splitlines()]
    loads = sum(1 for r in records if r.get("event") == "load")
    ordered = sorted(latencies)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    total = args.clients * args.requests
    return (f"{name:<7} loads {loads:3d}  answered {len(answered)}/{total}  latency p50 "
            f"{statistics.median(latencies):6.2f} s  p95 {p95:6.2f} s  "
            f"{len(answered) / wall:5.2f} requests/s  ({wall:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="A GGUF (default: the default model).")
    ap.add_argument("--models", type=int, default=2, help="How many models share memory.")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6, help="Requests per client.")
    ap.add_argument("--tokens", type=int, default=32, help="Tokens per answer.")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args()
    gguf = args.model or local_file(load_registry().get(load_registry().default_name()))
    with tempfile.TemporaryDirectory(prefix="ecswap", dir="/tmp") as d:
        folder = Path(d)
        models = registry(folder, gguf, args.models, args.context)
        print(f"{gguf.name}: {args.models} models, room for one; {args.clients} clients x "
              f"{args.requests} requests of {args.tokens} tokens, alternating models")
        print(run("fifo", folder, models, args, ["--swap-after", "0", "--min-residency",
                                                 "0"]))
        print(run("policy", folder, models, args, []))


if __name__ == "__main__":
    main()
