"""Single-stream decode on a loopback RPC executor vs the same model local, in one run.

Starts `everycycle rpc-serve` on loopback and a daemon with `--rpc` to it, then, in
alternating rounds, a greedy stream of N tokens on the model placed on the local CPU
and on the remote executor (the same CPU, over ggml RPC): the ratio is what the RPC
hop costs a split model per token. Needs llama-cpp-python built with -DGGML_RPC=on
(.ci/vulkan-venv makes one: .venv-vk).

    .venv-vk/bin/python bench/rpc.py [-n 128] [--rounds 3] [--model PATH ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]  # (bench/http.py)
_spec = importlib.util.spec_from_file_location("ec_bench_load", HERE / "load.py")
assert _spec and _spec.loader
load = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = load
_spec.loader.exec_module(load)

from everycycle.client import SyncClient
from everycycle.hardware import rpc
from everycycle.models.registry import load_registry, local_file


def stream_rate(c: SyncClient, model: str, n: int) -> float:
    return load.greedy_stream(c, model, "Write a long story about a lighthouse keeper.", n)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path, action="append")
    args = ap.parse_args()
    if not rpc.available():
        raise SystemExit("this llama.cpp build has no RPC backend: use .venv-vk (.ci/vulkan-venv)")
    models = args.model or [local_file(load_registry().get("smollm2-135m"))]
    threads = os.cpu_count() or 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"127.0.0.1:{port}"
    home = Path(tempfile.mkdtemp(prefix="ecr", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    toml = home / "models.toml"
    toml.write_text("".join(
        f'[models.local{i}]\npath = "{m}"\ncontext = 2048\nparallel = 1\nexecutor = "cpu"\n'
        f'[models.remote{i}]\npath = "{m}"\ncontext = 2048\nparallel = 1\n'
        f'executor = "rpc:{endpoint}/0"\n' for i, m in enumerate(models)))
    server = subprocess.Popen([sys.executable, "-m", "everycycle", "rpc-serve", "--port",
                               str(port), "--threads", str(threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not rpc.reachable(endpoint, 0.5):
        time.sleep(0.1)
    daemon = subprocess.Popen([sys.executable, "-m", "everycycle", "daemon", "--models",
                               str(toml), "--rpc", endpoint], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    sock = home / "run" / "everycycle.sock"
    try:
        while not sock.exists():
            time.sleep(0.05)
        time.sleep(0.5)
        with SyncClient(sock) as c:
            for i, m in enumerate(models):
                rates: dict[str, list[float]] = {"local": [], "remote": []}
                for where in ("local", "remote"):
                    stream_rate(c, f"{where}{i}", 8)  # load and warm up
                    if where == "remote":
                        c.unload(f"remote{i}")
                for _ in range(args.rounds):
                    for where in ("local", "remote"):
                        rates[where].append(stream_rate(c, f"{where}{i}", args.n))
                        if where == "remote":
                            c.unload(f"remote{i}")  # the server serves one model at a time
                best_local, best_remote = max(rates["local"]), max(rates["remote"])
                print(f"{m.name}: local cpu {best_local:.1f} tok/s, loopback RPC "
                      f"{best_remote:.1f} tok/s, ratio {best_remote / best_local:.3f} "
                      f"(per round: " + " ".join(f"{r / loc:.3f}" for r, loc in
                                                 zip(rates['remote'], rates['local'],
                                                     strict=True)) + ")")
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        server.kill()
        server.wait(10)
    print(f"{args.n} greedy tokens per stream, {threads} threads, {args.rounds} alternating "
          "rounds (best shown); remote = the same CPU behind `everycycle rpc-serve`")


if __name__ == "__main__":
    main()
