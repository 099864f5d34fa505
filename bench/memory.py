"""Resident memory of our daemon and its engine process vs llama-server, same model,
slots, context and KV type.

For each row, starts a fresh daemon with that model (slots x context per slot, KV cache
type), runs one round of K concurrent greedy requests so every slot has been used,
and reads the RSS of the daemon and of the model's engine process (their sum counts
the libraries both map twice; PSS, which splits shared pages, is printed too); then
the same with llama-server (-np K, -c K*context, -ctk/-ctv, flash attention for a
quantized cache), built from the llama.cpp vendored in llama-cpp-python. Prints both
sides, the ratio and the difference.

    .venv/bin/python bench/memory.py --llama-server PATH [--rows all|quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import anyio
from load import llama_server_process, prompt, server_load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from daemonhelp import daemon_process

from everycycle.client import connect
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Format

ROWS = [
    # (model, slots, context per slot, kv cache type)
    ("smollm2-135m", 4, 4096, "f16"),
    ("gemma-3-270m", 4, 4096, "f16"),
    ("gemma-3-270m", 8, 8192, "f16"),
    ("smollm2-135m", 4, 4096, "q8_0"),
    ("gemma-3-270m", 4, 4096, "q8_0"),
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def pss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss")


def engine_pid() -> int:
    from everycycle.client import SyncClient

    with SyncClient() as c:
        pid = c.describe_fleet().loaded_models[0].engine_pid
    assert pid is not None
    return pid


async def our_round(k: int, n: int) -> None:
    async with connect() as client, anyio.create_task_group() as tg:
        for i in range(k):
            async def one(i: int = i) -> None:
                async for _ in client.generate("bench", prompt(i), max_tokens=n,
                                               temperature=0.0, format=Format.RAW):
                    pass

            tg.start_soon(one)


def ours(model: Path, k: int, ctx: int, kv: str, n: int) -> tuple[float, float, float]:
    """(daemon RSS, engine RSS, daemon + engine PSS) in MB."""
    home = Path(tempfile.mkdtemp(prefix="ecm", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model}"\ncontext = {ctx}\nparallel = {k}\n'
                      f'kv_cache_type = "{kv}"\n')
    with daemon_process("--models", str(models)) as proc:
        anyio.run(our_round, k, n)
        engine = engine_pid()
        return rss_mb(proc.pid), rss_mb(engine), pss_mb(proc.pid) + pss_mb(engine)


def theirs(binary: Path, model: Path, k: int, ctx: int, kv: str, n: int) -> float:
    extra = [] if kv == "f16" else ["-ctk", kv, "-ctv", kv, "-fa", "on"]
    with llama_server_process(binary, model, k, os.cpu_count() or 1, ctx=ctx,
                              extra=extra) as (port, pid):
        anyio.run(server_load, port, k, n)
        return rss_mb(pid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("-n", type=int, default=32, help="tokens per request")
    ap.add_argument("--rows", choices=["all", "quick"], default="all")
    args = ap.parse_args()
    reg = load_registry()
    rows = ROWS if args.rows == "all" else ROWS[:2]
    print(f"{'model':<14} {'slots x ctx':>12} {'kv':>5} {'daemon+engine':>15} {'(PSS)':>8} "
          f"{'llama-server':>13} {'ratio':>6} {'diff':>8}")
    for name, k, ctx, kv in rows:
        model = local_file(reg.get(name))
        daemon, engine, pss = ours(model, k, ctx, kv, args.n)
        a = daemon + engine
        b = theirs(args.llama_server, model, k, ctx, kv, args.n)
        print(f"{name:<14} {f'{k} x {ctx}':>12} {kv:>5} {a:6.0f} MB ({daemon:.0f}+{engine:.0f})"
              f" {pss:5.0f} MB {b:10.0f} MB {a / b:6.2f} {a - b:+6.0f} MB", flush=True)


if __name__ == "__main__":
    main()
