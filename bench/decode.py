"""Single-stream decode speed: our engine against llama.cpp's own C++ ceiling.

Three sides on the same GGUF, threads and CPU kernels, alternating rounds, each
measurement in a fresh child process:
- our engine with prompt lookup off (like for like with the two below);
- a raw llama_decode + native-sampler loop through the same Python bindings;
- with --llama-bench PATH, llama.cpp's llama-bench ``tg128`` (``--repack 0`` where our
  probe turned the CPU's extra buffer types off, so both run the same kernels).
The goal is engine/llama-bench >= 0.97. Our engine with prompt lookup on is printed as
its own line: a story that repeats itself drafts well, which is not decode overhead.
(ggml-cpu uses OpenMP: a second thread driving llama.cpp in the same process gets its
own thread team; the daemon drives each model from one thread.)

    .venv/bin/python bench/decode.py [--tokens 128] [--rounds 3] [--model PATH]
                                     [--llama-bench PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import llama_cpp as L

from everycycle import paths
from everycycle.engine.core.jobs import Job, JobSpec, Sampling
from everycycle.engine.llama.llamalog import backend_init
from everycycle.engine.worker.runner import Runner
from everycycle.hardware import cpukernels
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Format


def raw_loop(path: Path, prompt: list[int], n: int, threads: int) -> float:
    backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = EXTRA
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_threads, cp.n_threads_batch = 4096, 512, threads, threads
    cp.no_perf = True
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_model_get_vocab(model)
    smpl = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(smpl, L.llama_sampler_init_greedy())
    arr = (L.llama_token * len(prompt))(*prompt)
    L.llama_decode(ctx, L.llama_batch_get_one(arr, len(prompt)))
    tok_arr = (L.llama_token * 1)()
    buf = ctypes.create_string_buffer(64)
    start = time.perf_counter()
    done = 0
    for _ in range(n):
        tok = L.llama_sampler_sample(smpl, ctx, -1)
        if L.llama_vocab_is_eog(vocab, tok):
            break
        L.llama_token_to_piece(vocab, tok, buf, 64, 0, False)
        tok_arr[0] = tok
        L.llama_decode(ctx, L.llama_batch_get_one(tok_arr, 1))
        done += 1
    elapsed = time.perf_counter() - start
    L.llama_sampler_free(smpl)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return done / elapsed


def engine(path: Path, prompt: list[int], n: int, threads: int, lookup: bool) -> float:
    done = threading.Event()
    first: list[float] = []
    count = [0]

    def notify(batch: list[tuple[Job, object]]) -> None:
        for _job, out in batch:
            if not first:
                first.append(time.perf_counter())
            count[0] += len(out.ids)  # type: ignore[attr-defined]
            if out.finished:  # type: ignore[attr-defined]
                done.set()

    runner = Runner(path, context=4096, parallel=1, notify=notify, n_threads=threads,
                    extra_bufts=EXTRA)
    job = Job(JobSpec(tokens=prompt, max_tokens=n + 1, sampling=Sampling.of(temperature=0.0), lookup=lookup))
    runner.submit(job)
    done.wait()
    elapsed = time.perf_counter() - first[0]  # from the first token, as the raw loop
    runner.close()
    return (job.n_generated - 1) / elapsed


def measure(which: str, path: Path, n: int, threads: int) -> None:
    """Child process: print one tok/s figure for ``which`` (raw or engine)."""
    probe_out: list[list[int]] = []

    def tokenize() -> None:
        probe = Runner(path, context=256, parallel=1, notify=lambda b: None, n_threads=threads,
                       extra_bufts=EXTRA)
        probe_out.append(probe.tokenize(PROMPT, Format.CHAT))
        probe.close()

    if which.startswith("engine"):
        tokenize()  # on the engine's own thread pattern: a worker thread, as the daemon
        print(engine(path, probe_out[0], n, threads, lookup=which == "engine-lookup"))
    else:
        t = threading.Thread(target=tokenize)
        t.start()
        t.join()
        print(raw_loop(path, probe_out[0], n, threads))


PROMPT = "Write a long story about a lighthouse keeper."
EXTRA = cpukernels.decide(paths.state_dir()).extra
"""The CPU's extra buffer types, as the daemon would load with them."""


def child(which: str, path: Path, n: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", which, "--model", str(path), "--tokens", str(n)],
        capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def llama_bench(binary: Path, path: Path, n: int, threads: int) -> float:
    """llama-bench's tg``n`` tok/s (one repetition, its own warm-up run first)."""
    out = subprocess.run(
        [str(binary), "-m", str(path), "-p", "0", "-n", str(n), "-t", str(threads), "-r", "1",
         "-ngl", "0", "--repack", "1" if EXTRA else "0", "-o", "json"],
        capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("--child", choices=["raw", "engine", "engine-lookup"],
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = args.model or local_file(load_registry().get("gemma-3-270m"))
    threads = os.cpu_count() or 1
    if args.child:
        measure(args.child, path, args.tokens, threads)
        return
    runs: dict[str, list[float]] = {"engine": [], "raw": [], "engine-lookup": []}
    if args.llama_bench:
        runs["llama-bench"] = []
    for r in range(args.rounds):
        for side, rates in runs.items():
            rates.append(llama_bench(args.llama_bench, path, args.tokens, threads)
                         if side == "llama-bench" else child(side, path, args.tokens))
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()),
              file=sys.stderr)
    print(f"model {path.name}, {args.tokens} tokens, {threads} threads, CPU extra kernels "
          f"{'on' if EXTRA else 'off (llama-bench --repack 0)'}")
    names = {"engine": "everycycle engine, lookup off", "raw": "raw llama_decode loop",
             "llama-bench": f"llama-bench tg{args.tokens}",
             "engine-lookup": "everycycle engine, lookup on"}
    for side, rates in runs.items():
        print(f"{names[side]:32} {max(rates):6.1f} tok/s (best of {len(rates)})")
    for other in ("llama-bench", "raw"):
        if other in runs:
            per_round = [e / o for e, o in zip(runs["engine"], runs[other], strict=True)]
            best = max(runs["engine"]) / max(runs[other])
            print(f"ratio engine (lookup off)/{other}: best {best:.3f}, "
                  f"median per round {statistics.median(per_round):.3f}")
    per_round = [e / o for e, o in zip(runs["engine-lookup"], runs["engine"], strict=True)]
    print("lookup on/off (drafts accepted, not overhead): median "
          f"{statistics.median(per_round):.3f}")


if __name__ == "__main__":
    main()
