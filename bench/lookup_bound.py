"""The most prompt lookup could gain on bench/lookup.py's tasks, on this machine.

For each model and task: the greedy answer (lookup off, in-process), then a replay of
it with a perfect-foresight drafter: at every step it looks up the same n-gram place as
our drafter, but drafts exactly the tokens the model will accept (never a wrong one, no
longer than our 16). Each step is scored with the engine's own measured step time for
its row count (the runner's StepCost table, from its load probe and its steps), and
compared with one-row steps for every token. A real drafter cannot beat this bound:
it does not know where the model leaves the text it copies.

    .venv/bin/python bench/lookup_bound.py [-n 200]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading
from pathlib import Path

from everycycle.engine.core.jobs import Job, JobSpec, Output, Sampling
from everycycle.engine.spec.lookup import MAX_DRAFT, PromptLookup
from everycycle.engine.worker.runner import Runner
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Format

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("ec_bench_lookup", HERE / "lookup.py")
assert _spec and _spec.loader
tasks_module = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tasks_module
_spec.loader.exec_module(tasks_module)


def answer(runner: Runner, tokens: list[int], n: int) -> list[int]:
    done = threading.Event()
    ids: list[int] = []

    def notify(batch: list[tuple[Job, Output]]) -> None:
        for _, out in batch:
            ids.extend(out.ids)
            if out.finished:
                done.set()

    runner.loop.notify = notify
    runner.submit(Job(JobSpec(tokens=tokens, max_tokens=n, lookup=False, sampling=Sampling.of(temperature=0.0, repeat_penalty=1.0))))
    done.wait()
    return ids


def bound(runner: Runner, prompt: list[int], out: list[int]) -> float:
    cost = runner.costs.decode
    one = cost.estimate(1) or 1.0
    lookup = PromptLookup(prompt)
    t, spent = 0, 0.0
    while t < len(out):
        draft = lookup.draft(min(MAX_DRAFT, len(out) - t - 1))
        run = 0
        while run < len(draft) and draft[run] == out[t + run]:
            run += 1
        spent += cost.estimate(1 + run) or one
        for tok in out[t:t + run + 1]:
            lookup.append(tok)
        t += run + 1
    return len(out) * one / spent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=200)
    ap.add_argument("--models", default="smollm2-135m,gemma-3-270m")
    args = ap.parse_args()
    reg = load_registry()
    print("perfect-foresight prompt lookup vs none, step times as this engine measured "
          "them; the most on/off could be")
    for name in args.models.split(","):
        chat = name in tasks_module.CHAT
        runner = Runner(local_file(reg.get(name)), context=4096, parallel=1,
                        notify=lambda batch: None)
        try:
            for task, text in tasks_module.TASKS.items():
                prompt = (runner.tokenize(text) if chat
                          else runner.tokenize(f"{text}\n\n", Format.RAW))
                out = answer(runner, prompt, args.n)
                print(f"{name:14} {task:12} {len(out):4} tokens  bound "
                      f"{bound(runner, prompt, out):5.2f}x", flush=True)
        finally:
            runner.close()


if __name__ == "__main__":
    main()
