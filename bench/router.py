"""Many daemons behind a real router (vllm-router from PyPI), measured from outside, as
docs/many-machines.md sets them up: three daemons on this machine, each with its own
state directory (no shared disk prompt cache), behind one router.

1. Prefix reuse: four agent-like conversations at once (one long system prompt shared,
   as an agent's is; a task of their own; five turns, each the last one's messages and
   answer plus a tool result), through the router with its ``cache_aware`` policy and
   then ``round_robin``. A later turn "reuses its prefix" when the daemon it reached had
   the whole previous prompt cached (``usage.prompt_tokens_details.cached_tokens`` at
   least the previous turn's ``prompt_tokens``); also the share of prompt tokens reused
   and where the conversations went.
2. First-token time of turn 5, through the router and straight to a daemon: one
   conversation at a time, taking turns, on fresh conversations of the same shape;
   the ratio is printed only where both sides read the same prompt tokens and reused
   the same cached prefix.
3. Faults: a daemon SIGKILLed with streams on it (how many streams were cut, how soon
   they ended, how many new requests were answered, whether it gets work once back);
   a daemon drained with a stream on it and new requests arriving (none lost).

    eval "$(.ci/vllm-router)"; .venv/bin/python bench/router.py [--model NAME] [--rounds 3]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# (bench/http.py would stand in for the standard library's http, which httpx imports)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import httpx
import openai
from routerhelp import EC, Router, routed, router_binary, wait_for

SYSTEM = ("You are a careful coding agent. You may call tools: read_file(path) returns a "
          "file's text; write_file(path, text) replaces it; run(command) runs a shell "
          "command and returns its output. Think step by step, keep answers short, and "
          "say what you changed. " * 6)
TASKS = ("Fix the failing test in tests/test_parser.py.",
         "Add a --verbose flag to the command line tool.",
         "Find why the cache is never evicted and fix it.",
         "Rename the module utils to helpers everywhere.")
TOOL_RESULT = ("Output of run(pytest -q):\n" + "F..........E...\nFAILED tests/test_x.py::"
               "test_case - AssertionError: expected 3, got 4\n" * 4)


def client(url: str, session: str | None = None) -> openai.OpenAI:
    """The openai client; with ``session``, the X-Session-ID header `launch` gives agents
    (what vllm-router's consistent_hash and sticky_least_loaded policies key on)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600,
                         default_headers={"X-Session-ID": session} if session else None)


def turn(c: openai.OpenAI, model: str, messages: list[dict[str, str]]
         ) -> tuple[dict[str, int], float, str]:
    """One streamed turn: usage, first-token seconds, the answer."""
    start = time.perf_counter()
    first = None
    text = []
    usage: dict[str, int] = {}
    for chunk in c.chat.completions.create(
            model=model, messages=messages, max_tokens=32, temperature=0.0,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            usage = {"prompt": chunk.usage.prompt_tokens,
                     "cached": (details.cached_tokens or 0) if details else 0}
    return usage, first or time.perf_counter() - start, "".join(text)


def conversation(url: str, model: str, task: str, out: list[dict[str, Any]],
                 session: str | None = None) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    c = client(url, session)
    for i in range(5):
        usage, ttft, answer = turn(c, model, messages)
        out.append({**usage, "ttft": ttft})
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"(turn {i + 2}) {TOOL_RESULT}"}]


def reuse(binary: str, models: Path, model: str, policy: str, sessions: bool
          ) -> dict[str, Any]:
    with routed(binary, models, model, policy) as router:
        before = [m.requests_served() for m in router.members]
        turns: list[list[dict[str, Any]]] = [[] for _ in TASKS]
        threads = [threading.Thread(target=conversation, args=(
            router.url, model, f"[{n}] {task}", turns[n], f"session-{n}" if sessions else None))
                   for n, task in enumerate(TASKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        spread = [m.requests_served() - b for m, b in zip(router.members, before, strict=True)]
    later = [(a, b) for conv in turns for a, b in itertools.pairwise(conv)]
    return {"turns": len(later), "reused": sum(b["cached"] >= a["prompt"] for a, b in later),
            "tokens": sum(b["cached"] for _, b in later) / sum(b["prompt"] for _, b in later),
            "spread": spread}


def ttft_side_by_side(binary: str, models: Path, model: str, rounds: int) -> None:
    with routed(binary, models, model, "cache_aware") as router:
        direct = router.members[0].url
        sides: dict[str, list[dict[str, Any]]] = {"router": [], "direct": []}
        for r in range(rounds):
            for side, url in (("router", router.url), ("direct", direct)):
                turns: list[dict[str, Any]] = []
                conversation(url, model, f"[round {r} {side}] {TASKS[r % len(TASKS)]}",
                             turns)
                sides[side].append(turns[-1])
    for a, b in zip(sides["router"], sides["direct"], strict=True):
        if abs(a["prompt"] - b["prompt"]) > 4 or abs(a["cached"] - b["cached"]) > 4:
            print(f"  turn 5 differs: router {a}, direct {b}: no ratio")
            return
    r = statistics.median(t["ttft"] for t in sides["router"])
    d = statistics.median(t["ttft"] for t in sides["direct"])
    print(f"turn 5 first token: router {r * 1000:.0f} ms, direct {d * 1000:.0f} ms "
          f"(median of {rounds}; prompt {sides['router'][-1]['prompt']} tokens, "
          f"{sides['router'][-1]['cached']} cached): router/direct {r / d:.3f}")


def stream(url: str, model: str, n: int, out: dict[str, Any], tokens: int) -> None:
    try:
        c = client(url)
        for chunk in c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Count to {n}000."}],
                max_tokens=tokens, temperature=1.0, stream=True,
                extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                out["started"] = True
            if chunk.choices and chunk.choices[0].finish_reason:
                out["finish"] = chunk.choices[0].finish_reason
    except (openai.APIError, httpx.HTTPError) as exc:
        out["error"] = type(exc).__name__
    out["ended"] = time.monotonic()


def streams(router: Router, model: str, tokens: int) -> tuple[list[dict[str, Any]],
                                                              list[threading.Thread]]:
    results: list[dict[str, Any]] = [{} for _ in range(3)]
    threads = [threading.Thread(target=stream, args=(router.url, model, n, results[n], tokens))
               for n in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.5)
    wait_for(lambda: all(r.get("started") for r in results), "streams", timeout=300)
    return results, threads


def short(url: str, model: str, n: int) -> bool:
    try:
        c = client(url)
        c.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": f"Say {n}."}])
        return True
    except openai.APIError:
        return False


def faults(binary: str, models: Path, model: str) -> None:
    with routed(binary, models, model, "cache_aware") as router:
        results, threads = streams(router, model, 400)
        on = [m.requests_running() for m in router.members]
        victim = router.members[next(i for i, n in enumerate(on) if n)]
        assert victim.proc is not None
        killed = time.monotonic()
        victim.proc.kill()
        answered = sum(short(router.url, model, n) for n in range(6))
        for t in threads:
            t.join()
        cut = [r for r in results if r.get("finish") != "length"]
        ends = ", ".join(f"{r['ended'] - killed:.2f} s" for r in cut)
        print(f"SIGKILL: {len(cut)} of 3 streams cut ({on[router.members.index(victim)]} "
              f"were on it), ended after {ends}; new requests answered {answered}/6")
        victim.start()
        before = victim.requests_served()
        back = time.monotonic()

        def sent_again() -> bool:
            _, runs = streams(router, model, 16)
            for t in runs:
                t.join()
            return victim.requests_served() > before

        wait_for(sent_again, "work for the revived daemon", timeout=120)
        print(f"  back on its port: given work again within {time.monotonic() - back:.1f} s")
    with routed(binary, models, model, "cache_aware") as router:
        results, threads = streams(router, model, 400)
        member = next(m for m in router.members if m.requests_running())
        drain = subprocess.Popen([*EC, "drain", "--socket", str(member.sock)],
                                 env=member.env(), stderr=subprocess.DEVNULL)
        wait_for(lambda: httpx.get(f"{member.url}/health", timeout=5).status_code == 503,
                 "draining")
        answered = sum(short(router.url, model, n) for n in range(10))
        for t in threads:
            t.join()
        drain.wait()
        whole = sum(r.get("finish") == "length" for r in results)
        print(f"drain: streams finished whole {whole}/3; new requests during the drain "
              f"answered {answered}/10; drain exit {drain.returncode}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", default=router_binary())
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not args.router:
        sys.exit("vllm-router not found: eval \"$(.ci/vllm-router)\" or --router PATH")
    from everycycle.models.registry import load_registry, local_file

    gguf = local_file(load_registry(None).get(args.model))
    with tempfile.TemporaryDirectory() as d:
        models = Path(d) / "models.toml"
        models.write_text(f'default = "{args.model}"\n[models."{args.model}"]\n'
                          f'path = "{gguf}"\ncontext = 4096\nparallel = 2\n')
        for policy, sessions in (("cache_aware", False), ("round_robin", False),
                                 ("sticky_least_loaded", True)):
            got = reuse(args.router, models, args.model, policy, sessions)
            print(f"{policy}{' + X-Session-ID' if sessions else ''}: turns 2-5 reusing their prefix {got['reused']}/{got['turns']} "
                  f"({100 * got['reused'] / got['turns']:.0f}%), prompt tokens reused "
                  f"{100 * got['tokens']:.1f}%, requests per daemon {got['spread']}")
        ttft_side_by_side(args.router, models, args.model, args.rounds)
        faults(args.router, models, args.model)


if __name__ == "__main__":
    main()
