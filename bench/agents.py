"""Agent sessions interleaved on one slot: how many prompt tokens each side prefills and
how long each turn takes, ours against llama-server (its host-RAM prompt cache,
``--cache-ram``, at its default), in one run.

The recorded requests of tests/data/agents (Claude Code, Codex and opencode sessions,
5-15k tokens each) are replayed with the sessions alternating — claude 1, codex 1,
opencode 1, claude 2, ... — on a model with one slot, so every turn finds the slot
holding another session's conversation. Each request is cut at ``-n`` tokens (1 by
default: what is measured is the prompt), greedy.

Like for like: our side gets each request as the agent sent it, on its own dialect's
route (the user's path: parsing, chat template, tools); llama-server gets the very
token ids our daemon builds for it (computed here first, in-process, by the same code)
on its ``/completion`` route, so the two prefill the same tokens. The bench checks that
each turn's prompt had the same length on both sides and that both generated ``-n``
tokens before it prints a ratio.

    .venv/bin/python bench/agents.py --llama-server PATH [-n 1] [--model GGUF]
"""

from __future__ import annotations

import sys
from pathlib import Path

# bench/http.py sits beside this file: with bench/ first on sys.path it would shadow the
# standard library's http package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent / "tests"))

import argparse
import http.client
import importlib.util
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from daemonhelp import daemon_process

from everycycle import paths
from everycycle.client import SyncClient
from everycycle.daemon.http import anthropic_request, openai_request, responses_request
from everycycle.daemon.jobbuild import build_job
from everycycle.engine.core.jobs import common_prefix
from everycycle.engine.host.contract import LoadOptions
from everycycle.engine.worker.runner import Runner
from everycycle.hardware.gguf import read_metadata
from everycycle.models.registry import ModelSpec, load_registry, local_file
from everycycle.protocol import Generate

_spec = importlib.util.spec_from_file_location("bench_load", _HERE / "load.py")
assert _spec is not None and _spec.loader is not None
_load = importlib.util.module_from_spec(_spec)
sys.modules["bench_load"] = _load
_spec.loader.exec_module(_load)
llama_server = _load.llama_server

DATA = _HERE.parent / "tests" / "data" / "agents"
CONTEXT = 32768


@dataclass
class Turn:
    session: str
    index: int
    path: str
    body: dict[str, Any]
    tokens: list[int]


def interleaved() -> list[tuple[str, int, str, dict[str, Any]]]:
    """The recorded requests, sessions alternating: (session, its turn, path, body)."""
    sessions = {f.stem: [json.loads(line) for line in f.read_text().splitlines()]
                for f in sorted(DATA.glob("*.jsonl"))}
    out = []
    for i in range(max(map(len, sessions.values()))):
        for name, records in sessions.items():
            if i < len(records):
                out.append((name, i + 1, records[i]["path"], records[i]["body"]))
    return out


def generate(path: str, body: dict[str, Any]) -> Generate:
    """The protocol request our HTTP route makes of ``body`` (its prompt's parts)."""
    path = path.partition("?")[0]
    if path.endswith("/messages"):
        return Generate("bench", "bench", messages=anthropic_request.messages(body),
                        **anthropic_request.tools(body), **anthropic_request.thinking(body))
    if path.endswith("/responses"):
        return Generate("bench", "bench", messages=responses_request.messages(body),
                        **responses_request.tools(body))
    return Generate("bench", "bench", messages=openai_request.messages(body.get("messages")),
                    **openai_request.tools(body), **openai_request.thinking(body))


def prompts(model: Path) -> list[Turn]:
    """Every turn with the token ids our daemon prefills for it (built in-process by the
    daemon's own job builder, on the same GGUF)."""
    spec = ModelSpec(name="bench", origin=model, path=model, context=CONTEXT, parallel=1)
    runner = Runner.load(model, LoadOptions(context=CONTEXT, parallel=1, extra_bufts=False),
                         lambda _: None)  # (only its tokenizer and template are used)
    try:
        return [Turn(s, i, p, b, list(build_job(spec, runner, generate(p, b), None)[0]
                                      .spec.tokens)) for s, i, p, b in interleaved()]
    finally:
        runner.close()


def post(port: int, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    started = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    took = time.perf_counter() - started
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"{path}: {resp.status} {data[:300]!r}")
    return json.loads(data), took


def capped(turn: Turn, n: int) -> dict[str, Any]:
    """The agent's request as sent, for our model, cut at ``n`` tokens, greedy."""
    body = {**turn.body, "model": "bench", "stream": False, "temperature": 0.0}
    for key in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
        body.pop(key, None)
    body["max_output_tokens" if "/responses" in turn.path else "max_tokens"] = n
    return body


def ours(port: int, turns: list[Turn], n: int) -> list[tuple[int, int, int, float]]:
    """(prompt tokens, prefilled, generated, seconds) of each turn, from the audit log."""
    out = []
    for turn in turns:
        _, took = post(port, turn.path, capped(turn, n))
        record = json.loads(paths.audit_file().read_text().splitlines()[-1])
        prompt, cached = int(record["prompt_tokens"]), int(record["cached_tokens"])
        out.append((prompt, prompt - cached, int(record["output_tokens"]), took))
    return out


def theirs(port: int, turns: list[Turn], n: int) -> list[tuple[int, int, int, float]]:
    out = []
    for turn in turns:
        answer, took = post(port, "/completion", {
            "prompt": turn.tokens, "n_predict": n, "temperature": 0.0, "cache_prompt": True,
            "ignore_eos": True})
        timings = answer["timings"]
        prefilled = int(timings["prompt_n"])
        out.append((prefilled + int(timings.get("cache_n", 0)), prefilled,
                    int(timings["predicted_n"]), took))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1, help="tokens per answer (both sides)")
    ap.add_argument("--model", type=Path)
    ap.add_argument("--llama-server", type=Path, required=True)
    args = ap.parse_args()
    reg = load_registry()
    model = (args.model or local_file(reg.get(reg.default_name()))).resolve()
    threads = os.cpu_count() or 1
    home = Path(tempfile.mkdtemp(prefix="eca", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    turns = prompts(model)
    print(f"model {model.name}, {threads} threads, one slot of {CONTEXT} tokens on both "
          f"sides, {len(turns)} turns of {len({t.session for t in turns})} sessions "
          f"interleaved, {args.n} token(s) each, greedy; prompt lookup off on ours")
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model}"\ncontext = {CONTEXT}\n'
                      "parallel = 1\nspeculative = false\nkv_cache_disk = 0\n")
    with daemon_process("--models", str(models), "--http", "127.0.0.1:0"):
        with SyncClient() as c:
            c.load("bench")
            url = c.describe_fleet().http
        assert url is not None
        a = ours(int(url.rpartition(":")[2]), turns, args.n)
    print("ours:", a, flush=True)  # (the slow half, kept should the other fail)
    # llama-server caps a slot at the model's training context (SmolLM2: 8,192), where
    # ours takes models.toml's: the same context on both sides needs its override.
    arch = read_metadata(model, ("general.architecture",))["general.architecture"]
    train = f"{arch}.context_length=int:{CONTEXT}"
    with llama_server(args.llama_server, model, 1, threads, ctx=CONTEXT,
                      extra=("--override-kv", train)) as port:
        b = theirs(port, turns, args.n)
    print("shared: the longest prefix the turn shares with its session's earlier turns "
          "(what a cache can save); reused: the share of it ours did not prefill")
    print(f"{'turn':<12} {'prompt':>7} {'shared':>7} | {'ours: prefilled':>15} {'reused':>7} "
          f"{'s':>7} | {'llama-server: prefilled':>23} {'s':>7} | ratio")
    for k, (turn, (pa, fa, ga, ta), (pb, fb, gb, tb)) in enumerate(zip(turns, a, b,
                                                                       strict=True)):
        if pa != pb or pa != len(turn.tokens) or ga != args.n or gb != args.n:
            raise SystemExit(f"{turn.session} {turn.index}: not the same work (prompt "
                             f"{pa} vs {pb}, built {len(turn.tokens)}; generated {ga} vs "
                             f"{gb}): no ratio")
        shared = max((common_prefix(t.tokens, turn.tokens) for t in turns[:k]
                      if t.session == turn.session), default=0)
        reused = f"{(pa - fa) / shared:.0%}" if shared >= 32 else "-"
        print(f"{turn.session + ' ' + str(turn.index):<12} {pa:>7} {shared:>7} | {fa:>15} "
              f"{reused:>7} {ta:>7.1f} | {fb:>23} {tb:>7.1f} | {ta / tb:.2f}")
    fa, fb = sum(x[1] for x in a), sum(x[1] for x in b)
    ta, tb = sum(x[3] for x in a), sum(x[3] for x in b)
    print(f"{'total':<12} {sum(x[0] for x in a):>7} | {fa:>15} {ta:>7.1f} | {fb:>23} "
          f"{tb:>7.1f} | {ta / tb:.2f}")
    print(f"prefilled tokens, ours/llama-server: {fa / max(fb, 1):.3f}; "
          f"time per turn, ours/llama-server: {ta / tb:.3f}")


if __name__ == "__main__":
    main()
