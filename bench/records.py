"""Before and after one refactor: the audit log, /metrics and ``fleet --json`` unchanged.

Checks out REV into a temporary git worktree and runs the same deterministic workload
against a real daemon from that tree and from this one (uncommitted changes included),
each with ``PYTHONPATH`` at its tree and a fresh private EVERYCYCLE_HOME: a socket
Generate, OpenAI chat (plain and streamed), Anthropic messages, Ollama chat, embeddings,
an unknown model, an expired deadline, a load that evicts, a refused TCP connection.
Compares the audit log (times, waits and random request ids blanked) and /metrics
(sums, buckets and seconds blanked) line by line, and ``fleet --json`` by its keys:
keys the working tree gained are fine, keys it lost are not. Exit 1 on a difference.

    .venv/bin/python bench/records.py [--base HEAD] [--dump DIR]
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# bench/ (first on sys.path) holds http.py, which would shadow the standard library's http
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT / "tests"))

import httpx
from daemonhelp import daemon_process
from httphelp import fleet_http
from tinymodel import write_tiny_gguf

from everycycle.client import SyncClient
from everycycle.protocol import Auth, encode

BLANK = "<*>"
VARYING = {"time", "queue_wait_ms", "duration_ms", "idle_s", "waited_s"}
OUR_IDS = "rec-"  # request ids this workload names (x-request-id): kept as they are
METRIC = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?P<labels>\{.*\})? (?P<value>\S+)")
Side = tuple[list[str], list[str], dict[str, Any], list[str]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def blank_audit(line: str) -> str:
    """One audit record with the fields that vary from run to run blanked (order kept)."""
    rec: dict[str, Any] = json.loads(line)
    for key, value in rec.items():
        if key in VARYING or (key == "request_id" and not str(value).startswith(OUR_IDS)):
            rec[key] = BLANK
    return json.dumps(rec, ensure_ascii=False)


def blank_metric(line: str) -> str:
    """A /metrics line with a timing-dependent value blanked; HELP/TYPE lines as they are.
    A histogram's ``_count`` stays exact: how many were observed, not how long they took."""
    m = METRIC.match(line)
    if line.startswith("#") or m is None:
        return line
    name = m["name"]
    timed = "seconds" in name and not name.endswith("_count")
    if name.endswith(("_sum", "_bucket", "_created")) or timed:
        return f"{name}{m['labels'] or ''} {BLANK}"
    return line


def key_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key of a JSON value as a dotted path (list items merged as ``[]``)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            out.add(f"{prefix}{k}")
            out |= key_paths(v, f"{prefix}{k}.")
    elif isinstance(value, list):
        for v in value:
            out |= key_paths(v, f"{prefix}[].")
    return out


def everycycle(sock: Path, command: str, *args: str) -> list[str]:
    """The CLI's ``COMMAND --socket SOCK ARGS`` (run with the side's PYTHONPATH)."""
    return [sys.executable, "-m", "everycycle", command, "--socket", str(sock), *args]


def workload(http: httpx.Client, sock: Path, env: dict[str, str], tcp: int) -> list[str]:
    """The requests, one after another; each step's status, for the report."""
    steps: list[str] = []

    def ec(*args: str) -> None:
        out = subprocess.run(everycycle(sock, *args), env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        steps.append(f"cli {args[0]}: exit {out.returncode}")

    def post(path: str, body: dict[str, Any], rid: str, **headers: str) -> None:
        hdrs = {"x-request-id": f"{OUR_IDS}{rid}", **headers}
        if body.get("stream"):
            with http.stream("POST", path, json=body, headers=hdrs) as r:
                r.read()
        else:
            r = http.post(path, json=body, headers=hdrs)
        steps.append(f"{rid} {path}: {r.status_code}")

    msgs = [{"role": "user", "content": "hello world"}]
    chat = {"model": "tiny", "messages": msgs, "max_tokens": 8, "temperature": 0, "seed": 7}
    ec("run", "-m", "tiny", "-n", "8", "--temperature", "0", "--seed", "7", "hello world")
    post("/v1/chat/completions", chat, "chat")
    post("/v1/chat/completions", {**chat, "stream": True,
                                  "stream_options": {"include_usage": True}}, "chat-stream")
    post("/v1/messages", {"model": "tiny", "messages": msgs, "max_tokens": 8,
                          "temperature": 0}, "messages")
    post("/api/chat", {"model": "tiny", "messages": msgs, "stream": False,
                       "options": {"temperature": 0, "seed": 7, "num_predict": 8}}, "ollama")
    post("/v1/embeddings", {"model": "tiny", "input": ["hello world", "the world"]}, "embed")
    post("/v1/chat/completions", {**chat, "model": "no-such-model"}, "unknown")
    post("/v1/chat/completions", {**chat, "max_tokens": 4000}, "deadline", **{"x-deadline-ms": "1"})
    ec("load", "tiny2")  # --max-loaded-models 1: tiny makes room
    with socket.create_connection(("127.0.0.1", tcp), timeout=30) as s:
        s.sendall(encode(Auth("not-the-token")))  # refused, audited, closed
        while s.recv(4096):
            pass
    steps.append("tcp with a wrong token: closed")
    return steps


def heartbeats_in(sock: Path) -> bool:
    """Whether every loaded model's engine has reported its prompt cache (its heartbeat,
    once a second: until then the fleet and /metrics leave those fields out)."""
    with SyncClient(sock) as c:
        return all(m.prompt_cache_hits is not None for m in c.describe_fleet().loaded_models)


def run_side(tree: Path, models: Path) -> Side:
    """The workload on a daemon from ``tree``: audit lines, /metrics lines, the fleet
    snapshot and the steps' statuses."""
    with tempfile.TemporaryDirectory(prefix="ecrec", dir="/tmp") as d:
        home = Path(d)
        env = {k: v for k, v in os.environ.items() if k != "EVERYCYCLE_SOCKET"}
        env.update(PYTHONPATH=str(tree), EVERYCYCLE_HOME=str(home), HF_HUB_OFFLINE="1",
                   HF_HOME=str(home / "hf"), OMP_NUM_THREADS="1",
                   **{f"XDG_{x}_HOME": str(home / x.lower())
                      for x in ("CONFIG", "DATA", "STATE", "CACHE")},
                   XDG_RUNTIME_DIR=str(home / "xdgrun"))
        sock = home / "run" / "d.sock"
        tcp = free_port()
        here = Path.cwd()
        os.chdir(home)  # `python -m` puts the cwd first on sys.path: not /work/main
        try:
            with daemon_process("--models", str(models), "--http", "127.0.0.1:0",
                                "--tcp", f"127.0.0.1:{tcp}", "--max-loaded-models", "1",
                                sock=sock, env=env, stderr=home / "daemon.log"):
                with httpx.Client(base_url=fleet_http(sock), timeout=120) as http:
                    steps = workload(http, sock, env, tcp)
                    until = time.monotonic() + 5  # older trees may report no cache at all
                    while not heartbeats_in(sock) and time.monotonic() < until:
                        time.sleep(0.05)
                    time.sleep(0.5)  # and whatever is reported after the answers
                    metrics = http.get("/metrics").text.splitlines()
                fleet = subprocess.run(everycycle(sock, "fleet", "--json"), env=env,
                                       capture_output=True, text=True, timeout=60, check=True)
            audit = home / "state" / "audit.jsonl"  # paths.audit_file() under this home
            lines = audit.read_text().splitlines() if audit.exists() else []
        finally:
            os.chdir(here)
        return lines, metrics, json.loads(fleet.stdout), steps


def compare(what: str, before: list[str], after: list[str], base: str) -> bool:
    if before == after:
        print(f"{what}: identical ({len(after)} lines)")
        return True
    print(f"{what}: DIFFERENT")
    sys.stdout.writelines(difflib.unified_diff(
        [x + "\n" for x in before], [x + "\n" for x in after],
        f"{what} at {base}", f"{what} in the working tree"))
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="the commit to compare against")
    ap.add_argument("--dump", type=Path, help="also write each side's raw records here")
    args = ap.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="everycycle-records") as tmp:
        base = Path(tmp) / "base"
        models = Path(tmp) / "models.toml"
        entries = "".join(
            f'[models.{name}]\npath = "{write_tiny_gguf(Path(tmp) / f"{name}.gguf", seed=seed)}"'
            f"\ncontext = 512\nparallel = 1\n" for name, seed in (("tiny", 1234), ("tiny2", 99)))
        models.write_text(f'default = "tiny"\n{entries}')
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(base), args.base], check=True)
        try:
            before = run_side(base, models)
            after = run_side(ROOT, models)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base)], check=False)
    if args.dump is not None:
        for name, side in (("before", before), ("after", after)):
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.audit.jsonl").write_text("".join(x + "\n" for x in side[0]))
            (args.dump / f"{name}.metrics.txt").write_text("".join(x + "\n" for x in side[1]))
            (args.dump / f"{name}.fleet.json").write_text(json.dumps(side[2], indent=1))
    ok = compare("workload", before[3], after[3], args.base)
    ok &= compare("audit", [blank_audit(x) for x in before[0]],
                  [blank_audit(x) for x in after[0]], args.base)
    ok &= compare("metrics", [blank_metric(x) for x in before[1]],
                  [blank_metric(x) for x in after[1]], args.base)
    old, new = key_paths(before[2]), key_paths(after[2])
    if old - new:
        ok = False
        print(f"fleet --json: LOST fields: {sorted(old - new)}; gained: {sorted(new - old)}")
    else:
        print(f"fleet --json: only gained fields: {sorted(new - old)}")
    print(f"({time.monotonic() - started:.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
