"""Single-stream decode speed: the engine vs a raw llama_decode + native-sampler loop.

Both run on the same GGUF, threads and prompt, alternating rounds in one run; each
measurement gets a fresh child process. (ggml-cpu uses OpenMP: a second thread that
drives llama.cpp in the same process gets its own thread team, and the first team's
spinning workers would slow it down. The daemon drives each model from one thread.)
Prints tok/s for each and the ratio (goal >= 0.97).

    .venv/bin/python bench/decode.py [--tokens 128] [--rounds 3] [--model PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import llama_cpp as L

from everycycle.engine.jobs import Job, Sampling
from everycycle.engine.llamalog import backend_init
from everycycle.engine.runner import Runner
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Format


def raw_loop(path: Path, prompt: list[int], n: int, threads: int) -> float:
    backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
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


def engine(path: Path, prompt: list[int], n: int, threads: int) -> float:
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

    runner = Runner(path, context=4096, parallel=1, notify=notify, n_threads=threads)
    job = Job(tokens=prompt, max_tokens=n + 1, sampling=Sampling(temperature=0.0))
    runner.submit(job)
    done.wait()
    elapsed = time.perf_counter() - first[0]  # from the first token, as the raw loop
    runner.close()
    return (job.n_generated - 1) / elapsed


def measure(which: str, path: Path, n: int, threads: int) -> None:
    """Child process: print one tok/s figure for ``which`` (raw or engine)."""
    probe_out: list[list[int]] = []

    def tokenize() -> None:
        probe = Runner(path, context=256, parallel=1, notify=lambda b: None, n_threads=threads)
        probe_out.append(probe.tokenize(PROMPT, Format.CHAT))
        probe.close()

    if which == "engine":
        tokenize()  # on the engine's own thread pattern: a worker thread, as the daemon
        print(engine(path, probe_out[0], n, threads))
    else:
        t = threading.Thread(target=tokenize)
        t.start()
        t.join()
        print(raw_loop(path, probe_out[0], n, threads))


PROMPT = "Write a long story about a lighthouse keeper."


def child(which: str, path: Path, n: int) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", which, "--model", str(path), "--tokens", str(n)],
        capture_output=True, text=True, check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--child", choices=["raw", "engine"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = args.model or local_file(load_registry().get("gemma-3-270m"))
    threads = os.cpu_count() or 1
    if args.child:
        measure(args.child, path, args.tokens, threads)
        return
    raws, engs = [], []
    for r in range(args.rounds):
        raws.append(child("raw", path, args.tokens))
        engs.append(child("engine", path, args.tokens))
        print(f"round {r + 1}: raw {raws[-1]:.1f} tok/s  engine {engs[-1]:.1f} tok/s",
              file=sys.stderr)
    raw, eng = max(raws), max(engs)
    print(f"model {path.name}, {args.tokens} tokens, {threads} threads")
    print(f"raw llama_decode loop: {raw:.1f} tok/s")
    print(f"everycycle engine:     {eng:.1f} tok/s")
    per_round = sorted(e / r for e, r in zip(engs, raws, strict=True))
    print(f"ratio engine/raw:      {eng / raw:.3f} (best of each); "
          f"median per-round {per_round[len(per_round) // 2]:.3f}")


if __name__ == "__main__":
    main()
