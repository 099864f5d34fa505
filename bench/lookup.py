"""Prompt-lookup decoding: tok/s with and without it, against llama-server's n-gram
speculative decoding, on copy-heavy tasks and on free generation, in one run.

For each model and task, one greedy stream (one slot, 2 threads): our daemon with
`speculative` off and on (checking the two outputs are identical), then llama-server
from the same vendored llama.cpp with `--spec-type none`, `ngram-simple`, `ngram-mod`
and `ngram-map-k`, each streamed and timed here from the first token to the last, as
ours (its tokens counted by its own `timings`). The four llama-servers run side by
side, so each task is timed on every engine back to back; ours is shown against the best
of llama-server's n-gram types. Round 1 is each task's first time; later rounds ask it
again (their median is shown apart), where a memory of earlier answers drafts: ours
(answers made with lookup) and llama-server's ngram-mod.

    .venv/bin/python bench/lookup.py --llama-server PATH [-n 200] [--rounds 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# This folder holds http.py: keep it from shadowing the standard library's http.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
import urllib.request

_spec = importlib.util.spec_from_file_location("ec_bench_load", HERE / "load.py")
assert _spec and _spec.loader
load = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = load
_spec.loader.exec_module(load)

from everycycle.client import SyncClient
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Format

PARAGRAPH = ("The lighthouse keeper climbed the stairs every evning at dusk, lit the great "
             "lamp, and watched the ships pass safley through the narow strait. In winter "
             "the storms came from the north, and the keeper wrote in his log each night: "
             "the wind, the waves, the ships, and the time the light was lit.")
CSV = ("name,age,city\nAlice,34,Paris\nBob,29,Berlin\nCarol,41,Madrid\nDave,25,Rome\n"
       "Eve,38,Vienna\nFrank,50,Lisbon")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result = result + "
        "item.price * item.count\n    if result > 100:\n        result = result * 0.9\n"
        "    return result\n")
TASKS = {
    "fix typos": f"Fix the typos in this paragraph and output the corrected paragraph only:"
                 f"\n\n{PARAGRAPH}",
    "csv to json": f"Convert this CSV to a JSON list of objects:\n\n{CSV}",
    "rename var": f"Rename the variable `result` to `amount` in this code and output the "
                  f"code only:\n\n{CODE}",
    "repeat": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}",
    "free": "Write a short story about a robot who learns to paint.",
}


CHAT = {"smollm2-135m"}
"""Chat models get the task as a user turn (their template, both engines); the rest (the
base gemma-3-270m) a plain completion prompt."""


def ours(c: SyncClient, model: str, text: str, n: int, speculative: bool
         ) -> tuple[float, list[int]]:
    chat = model in CHAT
    return load.greedy_stream(c, model, text if chat else f"{text}\n\n", n,
                              format=None if chat else Format.RAW, speculative=speculative)


def theirs(port: int, model: str, text: str, n: int) -> tuple[float, int, int]:
    """llama-server's decode tok/s timed here, as ours: streamed, first token to last
    (its own server-side ``timings`` leave out the HTTP stream), and its draft counts."""
    if model in CHAT:
        path, body = "/v1/chat/completions", {
            "messages": [{"role": "user", "content": text}], "max_tokens": n}
    else:
        path, body = "/completion", {"prompt": f"{text}\n\n", "n_predict": n}
    body |= {"temperature": 0.0, "top_k": 1, "cache_prompt": False, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    first = last = 0.0
    timings: dict[str, float] = {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            timings = ev.get("timings") or timings
            piece = (ev["choices"][0]["delta"].get("content") if ev.get("choices")
                     else ev.get("content"))
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
    tokens = int(timings.get("predicted_n", 0))
    rate = (tokens - 1) / (last - first) if last > first and tokens > 1 else float("nan")
    return rate, int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0))


def lookup_counts(c: SyncClient, model: str) -> tuple[int, int]:
    """The model's drafted tokens accepted and drafted so far, from the fleet view."""
    m = next(m for m in c.describe_fleet().loaded_models if m.name == model)
    drafted, accepted = m.drafted("lookup")
    return accepted, drafted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    ap.add_argument("--tasks", default=",".join(TASKS), help="which of: " + ", ".join(TASKS))
    args = ap.parse_args()
    tasks = {t: TASKS[t] for t in args.tasks.split(",")}
    reg = load_registry()
    names = args.models.split(",")
    paths = {name: local_file(reg.get(name)) for name in names}
    threads = os.cpu_count() or 1
    home = Path(tempfile.mkdtemp(prefix="ecl", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    toml = home / "models.toml"
    toml.write_text("".join(f'[models.{n}]\npath = "{p}"\ncontext = 4096\nparallel = 1\n'
                            for n, p in paths.items()))
    log = (home / "daemon.log").open("wb")  # kept: what the daemon said, if it fails
    daemon = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "everycycle", "daemon", "--models",
                               str(toml)], stdout=subprocess.DEVNULL, stderr=log)
    sock = home / "run" / "everycycle.sock"
    spec_types = ["none", "ngram-simple", "ngram-mod", "ngram-map-k"]
    print(f"greedy, one stream, {args.n} tokens at most, {threads} threads, "
          f"{args.rounds} alternating rounds; tok/s; 'ours' is the drafted tokens "
          f"accepted with lookup on (all rounds), 'on/best' ours against the best n-gram "
          f"type")
    header = (f"{'model':14} {'task':12} {'off':>7} {'on':>7} {'on/off':>7} {'same':>5}"
              f" {'ours':>9}" + "".join(f" {t:>13}" for t in spec_types) + f" {'on/best':>8}")
    print(header)
    try:
        while not sock.exists():
            time.sleep(0.05)
        with SyncClient(sock) as c:
            for name in names:
                results: dict[str, dict[str, list[float]]] = {}
                same: dict[str, bool] = {}
                drafts: dict[str, str] = {}
                accepted: dict[str, tuple[int, int]] = {}
                for task in tasks:
                    results[task] = {k: [] for k in ["off", "on", *spec_types]}
                    same[task] = True
                ours(c, name, "warm up", 4, False)
                with contextlib.ExitStack() as servers:
                    # One llama-server per n-gram type, all up at once (idle ones sleep):
                    # each task is timed on every engine back to back, so the machine's
                    # drift over minutes does not land on one side.
                    ports = {spec: servers.enter_context(load.llama_server_process(
                        args.llama_server, paths[name], 1, threads,
                        extra=("--spec-type", spec) if spec != "none" else ()))[0]
                        for spec in (spec_types if args.llama_server else [])}
                    for _ in range(args.rounds):
                        for task, text in tasks.items():
                            # The same cache state for both runs: the prompt already
                            # cached (llama.cpp's floats depend a little on how a prompt
                            # is split between cache and batch).
                            ours(c, name, text, 1, False)
                            r_off, ids_off = ours(c, name, text, args.n, False)
                            before = lookup_counts(c, name)
                            r_on, ids_on = ours(c, name, text, args.n, True)
                            after = lookup_counts(c, name)
                            took = accepted.get(task, (0, 0))
                            accepted[task] = (took[0] + after[0] - before[0],
                                              took[1] + after[1] - before[1])
                            results[task]["off"].append(r_off)
                            results[task]["on"].append(r_on)
                            same[task] = same[task] and ids_off == ids_on
                            for spec, port in ports.items():
                                rate, dn, da = theirs(port, name, text, args.n)
                                results[task][spec].append(rate)
                                if spec == "ngram-simple":
                                    drafts[task] = f"{da}/{dn}"
                # Round 1 is each task's first time; later rounds ask it again, where
                # memories of earlier answers (ours, and llama-server's ngram-mod) draft.
                def first(v: list[float]) -> float:
                    return v[0]

                def again(v: list[float]) -> float:
                    return statistics.median(v[1:])

                phases = [("first time (round 1)", first)]
                if args.rounds > 1:
                    phases.append(("asked again (median of later rounds)", again))
                for label, pick in phases:
                    print(f"  {label}")
                    for task in tasks:
                        r = {k: pick(v) if v else float("nan")
                             for k, v in results[task].items()}
                        best = max((r[s] for s in spec_types[1:] if results[task][s]),
                                   default=float("nan"))
                        mine = "{}/{}".format(*accepted[task])
                        print(f"{name:14} {task:12} {r['off']:7.1f} {r['on']:7.1f} "
                              f"{r['on'] / r['off']:7.2f} {'yes' if same[task] else 'NO':>5}"
                              f" {mine:>9}" + "".join(f" {r[s]:13.1f}" for s in spec_types)
                              + f" {r['on'] / best:8.2f}")
                if drafts:
                    print("  llama-server ngram-simple drafts accepted/drafted: "
                          + ", ".join(f"{t} {d}" for t, d in drafts.items()))
    finally:
        daemon.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.wait(60)


if __name__ == "__main__":
    main()
