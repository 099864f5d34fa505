"""Single-stream decode: our daemon vs ``llama-bench`` on the same GGUF, in one run.

    python3 bench/gpu/single.py --model M --llama-bench PATH [--ngl 99] [-n 128] [--rounds 3]

llama-bench times llama_decode alone (-p 0 -n N, mean of its repetitions); ours is a
greedy stream through the daemon's socket, timed from the first token to the last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]
_spec = importlib.util.spec_from_file_location("ec_bench_load", HERE.parent / "load.py")
assert _spec and _spec.loader
load = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = load  # (its dataclasses look their module up)
_spec.loader.exec_module(load)


def llama_bench(binary: Path, model: Path, n: int, ngl: int, threads: int) -> float:
    out = subprocess.run([str(binary), "-m", str(model), "-p", "0", "-n", str(n), "-ngl",
                          str(ngl), "-t", str(threads), "-r", "3", "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=600)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--llama-bench", type=Path, required=True)
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    home = Path(tempfile.mkdtemp(prefix="ecg", dir="/tmp"))
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{args.model}"\ncontext = 4096\nparallel = 1\n')
    os.environ["EVERYCYCLE_HOME"] = str(home)
    sock = home / "run" / "everycycle.sock"
    daemon = subprocess.Popen([sys.executable, "-m", "everycycle", "daemon", "--models",
                               str(models)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    ours: list[float] = []
    theirs: list[float] = []
    try:
        while not sock.exists():
            if daemon.poll() is not None:
                raise SystemExit("the daemon did not start")
            time.sleep(0.05)
        load.side_by_side(sock, None, 1, 8, 1)  # load and warm up
        for _ in range(args.rounds):
            rows, _ = load.side_by_side(sock, None, 1, args.n, 1)
            ours.append(rows[0].rate)
            theirs.append(llama_bench(args.llama_bench, args.model, args.n, args.ngl,
                                      threads))
        from everycycle.client import SyncClient

        with SyncClient(sock) as c:
            placed = [(m.assigned_executor, m.device_layers, m.total_layers)
                      for m in c.describe_fleet().loaded_models]
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
    best, best_theirs = max(ours), max(theirs)
    print(f"single stream, {args.model.name}, {args.n} tokens, {args.rounds} alternating "
          f"rounds; the daemon placed it on {placed}")
    print(f"everycycle  {best:8.1f} tok/s")
    print(f"llama-bench {best_theirs:8.1f} tok/s (-ngl {args.ngl})")
    ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
    print(f"ratio everycycle/llama-bench: best {best / best_theirs:.3f}, per round "
          + " ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
