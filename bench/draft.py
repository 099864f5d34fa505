"""Speculative decoding with a draft model, ours against llama-server's ``-md``, side by
side in one run.

The pair is SmolLM2-135M as the issue made it: the target the shipped Q4_1 dequantized
to F16 (written once beside the bench's cache), the draft the shipped Q4_1 itself — the
same weights up to quantization noise, so they agree as a matched pair does. Four
sides, each on its own server started for it, the same threads, context and slots: our
daemon without and with ``draft_model``, llama-server without and with ``-md``. Prompt
lookup is off on ours (``speculative = false``), as llama-server drafts with the draft
model only (``--spec-type draft-simple``: with ``-md`` alone this llama-server loads the
draft and never drafts): like for like. Greedy, three prompts (prose, code, a list), N
tokens each, decode tok/s timed from the first token to the last, as a client sees it;
``-k`` streams at once for the load figures. All four servers are up together and take
turns prompt by prompt, round by round. Each side's drafted and accepted tokens are
printed (ours from ``Usage``, llama-server's from its timings).

A ratio is the mean of the prompts' ratios over the prompts where both sides generated
as many tokens (the others are named); whether their texts are the same is said (a draft
changes no token where batches are bit-exact; llama.cpp's CPU kernels round a batch of
rows otherwise on some CPUs, and two engines may then differ after a near-tie).

    .venv/bin/python bench/draft.py --llama-server PATH [-n 256] [-k 1] [--rounds 3]
        [--target T.gguf --draft D.gguf] [--draft-max N] [--ngl 99]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from load import llama_server_process  # (bench/ is the script's path: not http, ours)

from everycycle.models.registry import load_registry, local_file

PROMPTS = {
    "prose": "The history of the lighthouse begins in the ancient world, where",
    "code": "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n",
    "list": "A shopping list for a week of healthy meals:\n1.",
}


def f16_target(source: Path, cache: Path) -> Path:
    """``source`` (a quantized GGUF) dequantized to F16 (norms and 1-D tensors F32),
    written once into ``cache``."""
    import gguf
    import numpy as np

    out = cache / (source.stem + ".F16.gguf")
    if out.exists():
        return out
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out) + ".part", arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_uint32(name, int(gguf.LlamaFileType.MOSTLY_F16))
            continue
        kind = f.types[0]
        sub = f.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        values = np.asarray(values, dtype=np.float32).reshape(
            [int(d) for d in reversed(t.shape)])
        writer.add_tensor(t.name, values.astype(np.float16 if values.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(out) + ".part").rename(out)
    return out


@contextlib.contextmanager
def daemon(target: Path, draft: Path | None, k: int, threads: int, ctx: int,
           draft_max: int = 3) -> Iterator[Path]:
    """Our daemon with one model, ``bench`` (drafted by ``draft`` if given); yields its
    socket once the model is loaded."""
    home = Path(tempfile.mkdtemp(prefix="ecd", dir="/tmp"))
    lines = [f'[models.bench]\npath = "{target}"\ncontext = {ctx}\nparallel = {k}\n',
             f"threads = {threads}\nspeculative = false\n"]
    if draft is not None:
        lines.append(f'draft_model = "{draft}"\ndraft_max = {draft_max}\n')
    (home / "models.toml").write_text("".join(lines))
    env = {**os.environ, "EVERYCYCLE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "everycycle", "daemon", "--models",
                             str(home / "models.toml")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sock = home / "run" / "everycycle.sock"
    try:
        while not sock.exists():
            if proc.poll() is not None:
                raise SystemExit("the daemon did not start")
            time.sleep(0.05)
        subprocess.run([sys.executable, "-m", "everycycle", "load", "bench"], env=env,
                       check=True, capture_output=True)
        yield sock
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def ours(sock: Path, text: str, n: int, tag: str) -> tuple[float, str, int]:
    """One greedy stream on our socket, read as raw JSON lines: (decode tok/s, text,
    tokens). Drafts verified and accepted are added to ``DRAFTS``."""
    import socket

    body = {"Generate": {"request_id": tag, "model": "bench", "prompt": text,
                         "max_tokens": n, "temperature": 0.0, "format": "raw",
                         "usage": True}}
    out, count, first, last = [], 0, 0.0, 0.0
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(json.dumps(body).encode() + b"\n")
        reader = s.makefile("rb")
        for line in reader:
            ev = json.loads(line)
            tokens = ev.get("Tokens")
            if tokens is None:
                if "Error" in ev:
                    raise SystemExit(f"ours: {ev['Error']}")
                usage = ev.get("Usage")
                if usage is not None:
                    DRAFTS[0] += usage.get("draft_n") or 0
                    DRAFTS[1] += usage.get("draft_n_accepted") or 0
                continue
            ids = tokens["chunk"]["ids"]
            if ids:
                now = time.perf_counter()
                first, last = first or now, now
                count += len(ids)
            out.append(tokens["chunk"]["text"])
            if tokens["finished"]:
                break
    return (count - 1) / (last - first), "".join(out), count


DRAFTS = [0, 0]
"""Draft tokens verified and accepted on the side running now (both report them)."""


def theirs(port: int, text: str, n: int) -> tuple[float, str, int]:
    """One greedy stream from llama-server's /completion: (decode tok/s, text, tokens)."""
    import socket

    body = json.dumps({"prompt": text, "n_predict": n, "temperature": 0.0, "top_k": 1,
                       "stream": True, "cache_prompt": False}).encode()
    out, count, first, last = [], 0, 0.0, 0.0
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /completion HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                  b"application/json\r\n" + f"Content-Length: {len(body)}\r\nConnection: "
                  f"close\r\n\r\n".encode() + body)
        for line in s.makefile("rb"):
            if not line.startswith(b"data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("content"):
                now = time.perf_counter()
                first, last = first or now, now
                out.append(ev["content"])
            if ev.get("stop"):
                timings = ev.get("timings", {})
                # (its count has the end-of-generation token: ours does not)
                count = timings.get("predicted_n", count) - (ev.get("stop_type") == "eos")
                DRAFTS[0] += timings.get("draft_n") or 0
                DRAFTS[1] += timings.get("draft_n_accepted") or 0
                break
    return (count - 1) / (last - first), "".join(out), count


Side = dict[str, tuple[float, str, int]]
"""Each prompt's best decode tok/s over the rounds (summed over its streams), its text
and its tokens (the first stream's)."""


def sides(servers: dict[str, tuple[contextlib.AbstractContextManager[object], object]],
          k: int, n: int, rounds: int) -> dict[str, Side]:
    """Every prompt ``rounds`` times on each server (``k`` streams at once), all of them
    up together and taking turns prompt by prompt (a burst of noise on this machine
    falls on every side alike); each prompt's best round kept."""
    from concurrent.futures import ThreadPoolExecutor

    best: dict[str, Side] = {name: {} for name in servers}
    drafts = {name: [0, 0] for name in servers}
    with contextlib.ExitStack() as stack:
        handles = {name: stack.enter_context(start) for name, (start, _) in servers.items()}

        def one(name: str, text: str, tokens: int) -> list[tuple[float, str, int]]:
            call = servers[name][1]
            assert callable(call)
            DRAFTS[:] = [0, 0]
            with ThreadPoolExecutor(k) as pool:
                got = list(pool.map(lambda i: call(handles[name], text, tokens, i),
                                    range(k)))
            drafts[name][0] += DRAFTS[0]
            drafts[name][1] += DRAFTS[1]
            time.sleep(0.2)  # (the last one's OpenMP threads spin a while after it)
            return got

        for name in servers:
            one(name, PROMPTS["prose"], 8)  # warm-up
        for name in servers:
            drafts[name] = [0, 0]
        for _ in range(rounds):
            for prompt, text in PROMPTS.items():
                for name in servers:
                    got = one(name, text, n)
                    rate = sum(r for r, _, _ in got)
                    if rate > best[name].get(prompt, (0.0, "", 0))[0]:
                        best[name][prompt] = (rate, got[0][1], got[0][2])
    for name, side in best.items():
        drafted, accepted = drafts[name]
        said = (f"; {accepted}/{drafted} drafted tokens accepted" if drafted
                else "; nothing drafted" if "draft" in name or "-md" in name else "")
        print(f"  {name:<26} " + "  ".join(f"{p} {side[p][0]:6.1f} ({side[p][2]})"
                                           for p in PROMPTS)
              + f" tok/s (tokens){said}", flush=True)
    return best


def compare(label: str, a: Side, b: Side) -> None:
    """``a`` over ``b``: the mean of the prompts' ratios, over the prompts where both
    generated as many tokens (the same work); whether their texts are the same."""
    same = [p for p in PROMPTS if a[p][2] == b[p][2]]
    if not same:
        print(f"  {label}: not compared: no prompt made as many tokens on both sides")
        return
    ratio = statistics.mean(a[p][0] / b[p][0] for p in same)
    texts = sum(a[p][1] == b[p][1] for p in same)
    left = [f"{p} {a[p][2]} vs {b[p][2]} tokens" for p in PROMPTS if p not in same]
    print(f"  {label}: {ratio:.3f} over {', '.join(same)} (same text on {texts}/{len(same)})"
          + (f"; left out: {', '.join(left)}" if left else ""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-k", type=int, default=1, help="streams at once (slots on each side)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--draft-max", type=int, default=3,
                    help="both sides' most draft tokens a step (llama-server's default: 3)")
    ap.add_argument("--target", type=Path, help="default: SmolLM2-135M's Q4_1 as F16")
    ap.add_argument("--draft", type=Path, help="default: SmolLM2-135M's Q4_1")
    ap.add_argument("--ngl", type=int, default=0,
                    help="llama-server's -ngl and -ngld (99 on a GPU; ours places itself)")
    args = ap.parse_args()
    shipped = local_file(load_registry().get("smollm2-135m"))
    cache = Path.home() / ".cache" / "everycycle-bench"
    cache.mkdir(parents=True, exist_ok=True)
    target = args.target or f16_target(shipped, cache)
    draft = args.draft or shipped
    ctx, k, n = 4096, args.k, args.n
    print(f"target {target.name}, draft {draft.name}, {k} stream(s) x {n} tokens x "
          f"{len(PROMPTS)} prompts, greedy, {args.threads} threads, {args.rounds} rounds "
          f"(best shown), draft max {args.draft_max}")
    spec = ("--spec-draft-n-max", str(args.draft_max), "-ngld", str(args.ngl))

    def server(extra: Sequence[str]) -> contextlib.AbstractContextManager[object]:
        @contextlib.contextmanager
        def run() -> Iterator[int]:
            with llama_server_process(args.llama_server, target, k, args.threads, ctx=ctx,
                                      extra=("-ngl", str(args.ngl), *extra)) as (port, _):
                yield port
        return run()

    def our(sock: Path, text: str, n: int, i: int) -> tuple[float, str, int]:
        return ours(sock, text, n, f"b{i}-{time.monotonic_ns()}")

    def their(port: int, text: str, n: int, i: int) -> tuple[float, str, int]:
        return theirs(port, text, n)

    got = sides({
        "everycycle": (daemon(target, None, k, args.threads, ctx), our),
        "everycycle draft_model": (daemon(target, draft, k, args.threads, ctx,
                                          args.draft_max), our),
        "llama-server": (server(()), their),
        "llama-server -md": (server(("-md", str(draft), "--spec-type", "draft-simple",
                                     *spec)), their),
    }, k, n, args.rounds)
    results = {"ours": got["everycycle"], "ours+draft": got["everycycle draft_model"],
               "theirs": got["llama-server"], "theirs+draft": got["llama-server -md"]}
    print("ratios (each prompt's best round):")
    compare("ours with draft / ours without (our gain)", results["ours+draft"],
            results["ours"])
    compare("llama-server -md / without (its gain)", results["theirs+draft"],
            results["theirs"])
    compare("ours with draft / llama-server -md", results["ours+draft"],
            results["theirs+draft"])
    compare("ours without / llama-server without", results["ours"], results["theirs"])


if __name__ == "__main__":
    main()
