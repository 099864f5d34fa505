"""An editor's completion pattern against llama-server, like for like: 20 ``/infill``
requests, each the last one's prefix a few characters longer (a user typing), with the
same suffix and repo-level context, streamed; the first-token time of each, on the
daemon and on llama-server (same GGUF, one slot each, same threads), taking turns
request by request so that a noisy moment falls on both sides.

Before it prints a ratio it checks that both sides did the same work: the same prompt
tokens for every request (``tokens_evaluated``), the same tokens generated, and the
reuse each side reports (``timings.cache_n``: the cells kept from the last request).

    .venv/bin/python bench/editor.py --llama-server PATH [--model GGUF] [--rounds 3]

Without ``--model``, the default model (SmolLM2-135M) with FIM token ids added to its
metadata (``ggufwrite.SMOLLM2_FIM``: its vocabulary has none of its own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from everycycle.hardware.ggufwrite import SMOLLM2_FIM, with_fim_keys
from everycycle.models.registry import load_registry, local_file

sys.path.insert(0, str(Path(__file__).parent))
from load import llama_server

SUFFIX = "\n\n\ndef main() -> None:\n    print(area(2.0), circumference(2.0))\n"
EXTRA = [{"filename": "geometry/sphere.py",
          "text": "import math\n\n\ndef volume(r: float) -> float:\n"
                  "    return 4.0 / 3.0 * math.pi * r ** 3\n" * 4}]
TYPED = ("import math\n\n\ndef area(r: float) -> float:\n    return math.pi * r * r\n\n\n"
         "def circumference(r: float) -> float:\n    return 2.0 * math.pi * r\n\n\n"
         "def diameter(r: float) -> float:\n    return 2.0 * r\n")
"""What the user types, a few characters a request."""


def requests(n: int, round_: int) -> list[str]:
    """``n`` prefixes, each the last one a few characters longer; a file of its own each
    round (neither side has seen it: what a cache kept from the last round does not
    count)."""
    typed = f"# geometry, take {round_}\n" + TYPED
    start = len(typed) // 3
    step = max(1, (len(typed) - start) // n)
    return [typed[:start + i * step] for i in range(n)]


def fim_model(cache: Path) -> Path:
    spec = load_registry().get(load_registry().default_name())
    out = cache / "smollm2-fim.gguf"
    if not out.exists():
        with_fim_keys(local_file(spec), out, SMOLLM2_FIM)
    return out


@contextlib.contextmanager
def daemon(model: Path, ctx: int, threads: int) -> Iterator[int]:
    """Our daemon with ``model`` alone (one slot), HTTP on a free port; yields the port
    once the model is loaded."""
    home = Path(tempfile.mkdtemp(prefix="ece", dir="/tmp"))
    (home / "models.toml").write_text(
        f'default = "bench"\n[models.bench]\npath = "{model}"\ncontext = {ctx}\n'
        f"parallel = 1\nthreads = {threads}\nspeculative = false\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "EVERYCYCLE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "everycycle", "daemon", "--models",
                             str(home / "models.toml"), "--http", f"127.0.0.1:{port}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sock = home / "run" / "everycycle.sock"
    try:
        while not sock.exists():
            if proc.poll() is not None:
                raise SystemExit("the daemon did not start")
            time.sleep(0.05)
        subprocess.run([sys.executable, "-m", "everycycle", "load", "bench"], env=env,
                       check=True, capture_output=True, timeout=300)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def infill(port: int, prefix: str, n: int) -> tuple[float, dict[str, Any]]:
    """One streamed /infill: the seconds to its first token, and its last object."""
    body = json.dumps({"input_prefix": prefix, "input_suffix": SUFFIX, "input_extra": EXTRA,
                       "prompt": "", "n_predict": n, "ignore_eos": True, "temperature": 0,
                       "top_k": 40, "stream": True, "cache_prompt": True}).encode()
    start = time.perf_counter()
    first: float | None = None
    last: dict[str, Any] = {}
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"POST /infill HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                  b"application/json\r\nConnection: close\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        buf = b""
        while chunk := c.recv(65536):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if first is None and not obj.get("stop"):
                    first = time.perf_counter() - start
                if obj.get("stop"):
                    last = obj
    if not last:
        raise SystemExit(f"no answer on port {port}")
    return (first if first is not None else time.perf_counter() - start), last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=8, help="tokens each completion generates")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    cache = Path(tempfile.gettempdir()) / "everycycle-bench"
    cache.mkdir(exist_ok=True)
    model = args.model or fim_model(cache)
    ours: list[list[float]] = []
    theirs: list[list[float]] = []
    with daemon(model, args.ctx, args.threads) as our_port, llama_server(
            args.llama_server, model, 1, args.threads, ctx=args.ctx,
            extra=("-b", "2048")) as their_port:
        for r in range(args.rounds):
            infill(our_port, "warm up\n", 1)  # a prefix of neither side's: both start cold
            infill(their_port, "warm up\n", 1)
            a: list[float] = []
            b: list[float] = []
            reused = [0, 0]
            for i, prefix in enumerate(requests(args.requests, r)):
                sides = [(our_port, a), (their_port, b)]
                if (r + i) % 2:
                    sides.reverse()
                done = []
                for port, times in sides:
                    t, last = infill(port, prefix, args.n)
                    times.append(t)
                    done.append(last)
                mine, other = done if (r + i) % 2 == 0 else done[::-1]
                same = (mine["tokens_evaluated"] == other["tokens_evaluated"]
                        and mine["tokens_predicted"] == other["tokens_predicted"] == args.n)
                if not same:
                    raise SystemExit(f"request {i}: the sides did different work: ours read "
                                     f"{mine['tokens_evaluated']} and made "
                                     f"{mine['tokens_predicted']}, llama-server "
                                     f"{other['tokens_evaluated']} and "
                                     f"{other['tokens_predicted']}")
                reused[0] += mine["timings"]["cache_n"]
                reused[1] += other["timings"]["cache_n"]
                if r == 0:
                    print(f"  request {i:2d}: prompt {mine['tokens_evaluated']:4d} tokens, "
                          f"reused ours {mine['timings']['cache_n']:4d} / llama-server "
                          f"{other['timings']['cache_n']:4d}; first token ours "
                          f"{a[-1] * 1e3:6.1f} ms, llama-server {b[-1] * 1e3:6.1f} ms")
            ours.append(a)
            theirs.append(b)
            print(f"round {r}: prompt tokens reused, all requests: ours {reused[0]}, "
                  f"llama-server {reused[1]}")
    print(f"model {model.name}, {args.requests} requests x {args.rounds} rounds, "
          f"{args.n} tokens each, {args.threads} threads, one slot a side")
    ratios = []
    for r, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        ratio = sum(a) / sum(b)
        ratios.append(ratio)
        print(f"round {r}: first-token time, sum of {len(a)}: ours {sum(a) * 1e3:7.1f} ms, "
              f"llama-server {sum(b) * 1e3:7.1f} ms, ratio {ratio:.3f}; medians "
              f"{statistics.median(a) * 1e3:.1f} / {statistics.median(b) * 1e3:.1f} ms")
    print(f"ratio ours/llama-server (first-token time): median {statistics.median(ratios):.3f}"
          f" (spread {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
