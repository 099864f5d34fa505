"""Real traffic, measured by the field's own benchmark: guidellm against our daemon and
llama-server on the same GGUF, one after the other, side by side in one run.

guidellm (pinned, in its own venv under ~/.cache/everycycle-bench, made on first use)
sends synthetic prompts of a fixed token count asking for a fixed count back
(``ignore_eos``), in these profiles:

- ``c4``, ``c8``: 4 or 8 concurrent streams (requests arrive as others finish: staggered);
- ``poisson``: Poisson arrivals at 0.9x llama-server's measured request rate at the
  first concurrency (the same rate for every side);
- ``prefix``: concurrent streams whose prompts share one 1,024-token prefix.

Three sides: our daemon (``parallel = N``, prompt lookup off as llama-server drafts
none), llama-server ``-np N`` and ``-np N -kvu`` (unified KV), each with the same
threads and per-slot context. Sides take turns run by run (``--runs`` alternating
runs a side); each figure is the median with the spread (min-max). guidellm's tokenizer
is made from the GGUF with transformers' GGUF loader, offline, once; its worker
processes are kept to one (its load is part of the machine).

Before printing a ratio the bench checks both sides did the same work: every finished
request got exactly the output tokens asked for (``ignore_eos`` honoured) and the
prompts were the same size; otherwise it says so and prints no ratio.

    .venv/bin/python bench/traffic.py --llama-server PATH [--model smollm2-135m|PATH ...]
        [--profiles c4,c8,poisson,prefix] [--seconds 60] [--runs 3]
        [--prompt-tokens 256] [--output-tokens 128]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from load import llama_server_process  # (bench/ is the script's path)

from everycycle.models.registry import load_registry, local_file

GUIDELLM = "0.8.1"
CACHE = Path.home() / ".cache" / "everycycle-bench"
CONTEXT = 4096  # per slot, both sides
PROFILES = ("c4", "c8", "poisson", "prefix")
METRICS = ("tok/s", "all tok/s", "TTFT p50", "TTFT p90", "ITL p50", "ITL p90")


@contextlib.contextmanager
def _installing() -> Iterator[None]:
    """One bench at a time installs into CACHE (another waits, then finds it done)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def guidellm_bin() -> Path:
    """guidellm's command, installed (pinned, with ``gguf`` for the tokenizer) on first use;
    a venv whose install did not finish (killed) is made again."""
    venv = CACHE / f"guidellm-{GUIDELLM}"
    done = venv / ".installed"
    if not done.exists():
        with _installing():
            if not done.exists():
                print(f"installing guidellm {GUIDELLM} into {venv} …", file=sys.stderr)
                shutil.rmtree(venv, ignore_errors=True)
                subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
                subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                                f"guidellm=={GUIDELLM}", "gguf"], check=True)
                done.touch()
    return venv / "bin" / "guidellm"


def tokenizer_dir(model: Path) -> Path:
    """A Hugging Face tokenizer directory made from ``model``'s own vocabulary
    (transformers' GGUF loader), once per file: written beside, then renamed into place."""
    stat = model.stat()
    out = CACHE / "tokenizers" / f"{model.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if out.is_dir():
        return out
    python = guidellm_bin().parent / "python"
    code = ("import sys\nfrom transformers import AutoTokenizer\n"
            "t = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])\n"
            "t.save_pretrained(sys.argv[3])\n")
    with _installing():
        if not out.is_dir():
            out.parent.mkdir(parents=True, exist_ok=True)
            partial = Path(tempfile.mkdtemp(prefix=out.name, dir=out.parent))
            subprocess.run([str(python), "-c", code, str(model.parent), model.name,
                            str(partial)], check=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL)
            partial.rename(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def our_daemon(model: Path, slots: int, threads: int) -> Iterator[str]:
    """Our daemon with its HTTP API on ``model`` (``parallel = slots``, no prompt
    lookup), the model loaded; yields its URL."""
    home = Path(tempfile.mkdtemp(prefix="ect", dir="/tmp"))
    models = home / "models.toml"
    models.write_text(f'[models.bench]\npath = "{model.resolve()}"\ncontext = {CONTEXT}\n'
                      f"parallel = {slots}\nthreads = {threads}\nspeculative = false\n")
    port = free_port()
    env = {**os.environ, "EVERYCYCLE_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "everycycle", "daemon", "--models",
                             str(models), "--http", f"127.0.0.1:{port}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sock = home / "run" / "everycycle.sock"
        while not sock.exists():
            if proc.poll() is not None:
                raise SystemExit("the daemon did not start")
            time.sleep(0.05)
        subprocess.run([sys.executable, "-m", "everycycle", "load", "bench"], env=env,
                       check=True, stdout=subprocess.DEVNULL, timeout=300)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


@dataclass
class Result:
    """One guidellm run's figures (ms for latencies) and the work it did."""

    figures: dict[str, float]
    requests: int
    output_tokens: list[int]
    prompt_tokens: list[int]
    rate: float  # finished requests a second
    arrivals: list[float]  # when each request was sent, from the run's start (s)

    def same_work(self, other: Result, wanted: int, paced: bool) -> str | None:
        """Why this run and ``other`` did not do the same work (None: they did);
        ``paced``: requests were sent on a schedule (Poisson), the same for both."""
        for name, run in ((" of ours", self), (" of theirs", other)):
            if not run.output_tokens:
                return f"a run{name} finished no request"
            wrong = [n for n in run.output_tokens if n != wanted]
            if wrong:
                return (f"{len(wrong)} of {len(run.output_tokens)} requests{name} did not "
                        f"get {wanted} tokens (e.g. {wrong[0]}): ignore_eos not honoured")
        late = [abs(x - y) for x, y in zip(self.arrivals, other.arrivals, strict=False)]
        if paced and len(late) > 1 and max(late[:len(late) // 2]) > 1.0:
            return "requests did not arrive alike (a client's start-up, not the server's)"
        a, b = statistics.median(self.prompt_tokens), statistics.median(other.prompt_tokens)
        if abs(a - b) > 0.02 * max(a, b):
            return f"prompts differ in size: median {a:.0f} against {b:.0f} tokens"
        return None


def _percentile(stats: dict[str, Any], p: str) -> float:
    return float(stats["percentiles"][p])


def parse(report: Path) -> Result:
    """The figures of guidellm's JSON report (one benchmark in it)."""
    bench = json.loads(report.read_text())["benchmarks"][0]
    metrics = bench["metrics"]
    done = bench["requests"]["successful"]
    ttft = metrics["time_to_first_token_ms"]["successful"]
    itl = metrics["inter_token_latency_ms"]["successful"]
    figures = {
        "tok/s": float(metrics["output_tokens_per_second"]["successful"]["mean"]),
        "TTFT p50": _percentile(ttft, "p50"), "TTFT p90": _percentile(ttft, "p90"),
        "ITL p50": _percentile(itl, "p50"), "ITL p90": _percentile(itl, "p90"),
    }
    # (guidellm counts finished requests' tokens only: in a short run that is a few
    # requests' worth a side; what every stream delivered in the window is finer)
    streamed = sum(int(r["output_tokens"] or 0) for kind in ("successful", "incomplete")
                   for r in bench["requests"][kind])
    figures["all tok/s"] = streamed / float(bench["duration"])
    rate = float(metrics["requests_per_second"]["successful"]["mean"])
    sent = sorted(float(r["request_start_time"]) - float(bench["start_time"])
                  for kind in ("successful", "incomplete", "errored")
                  for r in bench["requests"][kind])
    return Result(figures, len(done), [int(r["output_tokens"] or 0) for r in done],
                  [int(r["prompt_tokens"] or 0) for r in done], rate, sent)


def scenario(url: str, model: str, fmt: str, profile: dict[str, Any], data: dict[str, Any],
             tokenizer: Path, seconds: int, out: Path, seed: int) -> dict[str, Any]:
    return {"metadata": {"name": "everycycle-traffic"}, "spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model,
                    "request_format": fmt, "timeout": 600},
        "profile": profile,
        "data": [data],
        "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
        "seed": {"kind": "static", "value": seed},
        "constraints": [{"kind": "max_duration", "seconds": seconds}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}


def run_guidellm(spec: dict[str, Any], work: Path) -> Result:
    path = work / "scenario.json"
    path.write_text(json.dumps(spec))
    report = Path(spec["spec"]["outputs"][0]["path"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    done = subprocess.run([str(guidellm_bin()), "run", "--scenario", str(path),
                           "--disable-console-interactive"], check=False, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0 or not report.exists():
        raise SystemExit(f"guidellm failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return parse(report)


@dataclass
class Side:
    name: str
    url: str
    model: str  # the name requests carry


def spread(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.median(values):.1f} ({min(values):.0f}-{max(values):.0f})"


def report(profile: str, sides: list[Side], runs: dict[str, list[Result]],
           wanted: int, paced: bool) -> None:
    print(f"\n{profile}: median (min-max) of {len(runs[sides[0].name])} runs a side")
    print(f"{'side':<24}" + "".join(f"{m:>20}" for m in METRICS) + "  requests")
    for side in sides:
        rs = runs[side.name]
        print(f"{side.name:<24}" + "".join(f"{spread([r.figures[m] for r in rs]):>20}"
                                           for m in METRICS)
              + f"  {sum(r.requests for r in rs)}")
    ours = runs[sides[0].name]
    for side in sides[1:]:
        theirs = runs[side.name]
        whys = [o.same_work(t, wanted, paced) for o, t in zip(ours, theirs, strict=True)]
        kept = [i for i, why in enumerate(whys) if why is None]
        if not kept:
            print(f"ours / {side.name}: no ratio, the sides did not do the same work: "
                  f"{whys[0]}")
            continue
        ratios = []
        for m in METRICS:
            o, t = (statistics.median(x[i].figures[m] for i in kept) for x in (ours, theirs))
            ratios.append(f"{m} {o / t:.3f}x")
        aside = [f"run {i + 1}: {why}" for i, why in enumerate(whys) if why is not None]
        print(f"ours / {side.name}: " + ", ".join(ratios)
              + (f"  ({len(aside)} of {len(whys)} runs set aside: {'; '.join(aside)})"
                 if aside else ""))
    print("(tok/s: guidellm's, finished requests' tokens over the run; all tok/s: every "
          "token streamed in it; tok/s higher is better, latencies lower)")


def bench_model(model: Path, args: argparse.Namespace) -> None:
    threads = args.threads or os.cpu_count() or 1
    tok = tokenizer_dir(model)
    chat = (tok / "chat_template.jinja").exists() or "chat_template" in json.loads(
        (tok / "tokenizer_config.json").read_text())
    fmt = "/v1/chat/completions" if chat else "/v1/completions"
    profiles = args.profiles.split(",")
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown:
        raise SystemExit(f"unknown profile {unknown[0]!r} (profiles: {', '.join(PROFILES)})")
    counts = {p: (8 if p == "c8" else args.streams) for p in profiles}
    print(f"model {model.name}; {fmt}; {threads} threads, {CONTEXT} tokens a slot; guidellm "
          f"{GUIDELLM}, {args.prompt_tokens}-token prompts, {args.output_tokens} tokens asked "
          f"(ignore_eos), {args.seconds} s a run, {args.runs} alternating runs a side")
    for slots in sorted(set(counts.values())):
        bench_slots(model, args, threads, tok, fmt, slots,
                    [p for p in profiles if counts[p] == slots])


def bench_slots(model: Path, args: argparse.Namespace, threads: int, tok: Path, fmt: str,
                slots: int, profiles: list[str]) -> None:
    """The ``profiles`` run with ``slots`` streams, each side started with ``slots`` slots."""
    work = Path(tempfile.mkdtemp(prefix="ectr", dir="/tmp"))
    base = {"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens}
    with contextlib.ExitStack() as stack:
        sides = [Side("everycycle", stack.enter_context(our_daemon(model, slots, threads)),
                      "bench")]
        for name, extra in ((f"llama-server -np {slots}", ()),
                            (f"llama-server -np {slots} -kvu", ("-kvu",))):
            port, _ = stack.enter_context(llama_server_process(
                args.llama_server, model, slots, threads, ctx=CONTEXT, extra=extra))
            sides.append(Side(name, f"http://127.0.0.1:{port}", model.stem))
        measured_rate: float | None = None
        for profile in profiles:
            data = dict(base)
            if profile == "prefix":
                data.update(prefix_tokens=1024, prefix_count=1)
            if profile == "poisson":
                if measured_rate is None:
                    raise SystemExit("poisson needs a concurrent profile before it")
                shape: dict[str, Any] = {"kind": "poisson", "rate": [0.9 * measured_rate]}
            else:
                shape = {"kind": "concurrent", "streams": [slots]}

            def one(side: Side, seconds: int, name: str, seed: int,
                    shape: dict[str, Any] = shape, data: dict[str, Any] = data) -> Result:
                return run_guidellm(scenario(side.url, side.model, fmt, shape, data, tok,
                                             seconds, work / name, seed), work)

            # (each profile its own prompts, the same for every side and run: no side's
            # cache holds another profile's; a short run first, discarded, of other
            # prompts: guidellm's first run in a process tree is slow to start)
            seed = 42 + PROFILES.index(profile)
            one(sides[0], 5, f"{profile}-warm.json", seed + 1000)
            runs: dict[str, list[Result]] = {s.name: [] for s in sides}
            for n in range(args.runs):
                for side in (sides if n % 2 == 0 else sides[::-1]):
                    result = one(side, args.seconds, f"{profile}-{n}-{side.url[-5:]}.json", seed)
                    runs[side.name].append(result)
                    print(f"  {profile} run {n + 1} {side.name}: "
                          f"{result.figures['tok/s']:.1f} tok/s, {result.requests} requests",
                          file=sys.stderr)
            if profile.startswith("c") and measured_rate is None:
                measured_rate = max(statistics.median(r.rate for r in runs[s.name])
                                    for s in sides[1:])
            if profile == "poisson":
                print(f"\npoisson rate {shape['rate'][0]:.3f} requests/s (0.9x llama-server's)")
            report(f"{profile} ({slots} slots a side)", sides, runs, args.output_tokens,
                   paced=profile == "poisson")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--model", action="append",
                    help="a registry name or a GGUF path (repeatable; default smollm2-135m)")
    ap.add_argument("--profiles", default=",".join(PROFILES))
    ap.add_argument("--streams", type=int, default=4, help="streams of c4/poisson/prefix")
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    reg = load_registry()
    for name in args.model or ["smollm2-135m"]:
        path = Path(name)
        bench_model(path if path.suffix == ".gguf" else local_file(reg.get(name)), args)


if __name__ == "__main__":
    main()
