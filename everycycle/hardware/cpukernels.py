"""Whether this CPU can run ggml's optional CPU kernels (AMX, repacked weights).

llama.cpp puts a CPU model's weights in "extra" buffer types when the CPU reports the
instructions for them (AMX tiles on recent Xeons, repacked Q4_0/Q4_K for AVX2 and
NEON). Some CPUs report AMX and fault on it (SIGILL at ``tilezero``, seen under KVM),
and a fault in the daemon's own process would end every client. So before the first
load, a child process (``python -m everycycle.engine.llama.kernelprobe``: it decodes through the
engine's Runner, so it lives in the engine) loads a small generated GGUF with Q4_0
weights (``write_probe_model``), extra buffers on, and decodes a batch through them.
If the child dies by a signal, every model loads with ``use_extra_bufts = false``.

The verdict is kept in ``<state_dir>/cpu-kernels.json``, keyed by the CPU's model and
flags, the kernel release and the llama.cpp build, so the probe runs once per machine
and build. ``EVERYCYCLE_CPU_EXTRA=on|off`` overrides it (``auto``, the default,
probes). This module imports llama_cpp only in the child.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .. import statefile
from ..errors import FileBusyError

log = logging.getLogger(__name__)

ENV = "EVERYCYCLE_CPU_EXTRA"
FAULT_ENV = "EVERYCYCLE_CPU_PROBE_FAULT"
"""For tests: ``sigill`` makes the probe's child execute an illegal instruction (ud2)
before it loads anything, as a CPU that cannot run its kernels does (before the load,
so that the fault named is this one whatever the host's own kernels do)."""
CRASH_ENV = "EVERYCYCLE_TEST_EXTRA_BUFTS_CRASH"
"""For tests, on any CPU: ``1`` makes every llama.cpp load with extra buffer types on
die of SIGSEGV, as on an Intel CPU whose AMX kernels fault: the probe's child, an
engine told to use them, and (through the tests' conftest) any load a test makes in
its own process."""
CHILD = "everycycle.engine.llama.kernelprobe"
"""The probe's child, run by name: it loads a model through the engine's Runner (this
module imports nothing of the engine)."""
CACHE_NAME = "cpu-kernels.json"
_OFF = "CPU extra buffer types (AMX, repacked weights) off"
PROBE_TIMEOUT = 120.0


@dataclass(frozen=True, slots=True)
class Verdict:
    extra: bool
    """Whether models load with the CPU's extra buffer types."""
    note: str | None = None
    """One line for ``fleet`` and ``models`` when they are off: why."""
    source: str = "probe"
    """probe, cache or override."""


def signal_cause(code: int) -> str:
    """A process's exit code as words: ``SIGILL (illegal instruction)``, ``exit code 3``."""
    if code < 0:
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return f"signal {-code}"
        words = (signal.strsignal(sig) or sig.name).lower()
        return f"{sig.name} ({words})"
    return f"exit code {code}"


def crash_if_simulated(extra_bufts: bool) -> None:
    """Die of SIGSEGV here when ``CRASH_ENV`` is set and a load would use extra buffer
    types (a test-only stand-in for a CPU whose AMX kernels fault)."""
    if extra_bufts and os.environ.get(CRASH_ENV) == "1":
        os.kill(os.getpid(), signal.SIGSEGV)


def _cpu_identity() -> list[str]:
    model = flags = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8",
                                            errors="replace") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model", "CPU part") and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.strip()
            elif not line.strip() and model:
                break
    return [model or platform.processor() or platform.machine(), flags]


def build_identity() -> list[str]:
    """The llama.cpp build: llama-cpp-python's version and its libraries' size and mtime
    (a rebuild with other CMAKE_ARGS keeps the version, not the files)."""
    out: list[str] = []
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out.append(importlib.metadata.version("llama-cpp-python"))
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.submodule_search_locations:
        lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
        for f in sorted(lib.glob("lib*ggml*")):
            with contextlib.suppress(OSError):
                st = f.stat()
                out.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return out


def cache_key() -> str:
    """What the verdict depends on: the CPU, the kernel, the llama.cpp build."""
    parts = [*_cpu_identity(), platform.release(), *build_identity()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _read_cache(path: Path, key: str) -> Verdict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    extra, note = data.get("extra"), data.get("note")
    if not isinstance(extra, bool) or not (note is None or isinstance(note, str)):
        return None
    return Verdict(extra, note, "cache")


def _write_cache(path: Path, key: str, verdict: Verdict) -> None:
    try:
        statefile.write(path, json.dumps({"key": key, "extra": verdict.extra,
                                          "note": verdict.note}))
    except (OSError, FileBusyError) as exc:
        log.warning("cannot keep the CPU kernel verdict in %s: %s", path, exc)


def run_probe() -> Verdict:
    """Run the child and read its end (blocking, about a second). The child writes its
    model into a folder made here: a child that faults cannot clean up after itself."""
    env = {**os.environ, "GGML_NO_BACKTRACE": "1", "OMP_NUM_THREADS": "2"}
    try:
        with tempfile.TemporaryDirectory(prefix="everycycle-probe") as folder:
            done = subprocess.run([sys.executable, "-m", CHILD, folder],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, env=env, timeout=PROBE_TIMEOUT,
                                  check=False)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"{_OFF}: a probe using them hung for {PROBE_TIMEOUT:g} s")
    except OSError as exc:
        log.warning("cannot run the CPU kernel probe: %s", exc)
        return Verdict(True, None, "unprobed")
    if done.returncode < 0:
        return Verdict(False, f"{_OFF}: a probe using them died with "
                              f"{signal_cause(done.returncode)}")
    if done.returncode != 0:
        # The probe itself could not run (not the kernels): say so, keep llama.cpp's
        # default, and try again next time.
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
        log.warning("the CPU kernel probe failed (%s)%s", signal_cause(done.returncode),
                    f": {tail[0]}" if tail else "")
        return Verdict(True, None, "unprobed")
    return Verdict(True, None, "probe")


_memo: dict[str, tuple[str, Verdict]] = {}
"""Per cache file: (its key, the verdict)."""
_memo_lock = threading.Lock()


def decide(state_dir: Path) -> Verdict:
    """The verdict for this machine: the override, else the cache, else a probe (whose
    verdict is cached). Once per process after the first call."""
    wanted = os.environ.get(ENV, "auto").strip().lower()
    if wanted in ("on", "1", "true"):
        return Verdict(True, None, "override")
    if wanted in ("off", "0", "false"):
        return Verdict(False, f"{_OFF}: {ENV}=off", "override")
    if wanted not in ("auto", ""):
        log.warning("%s=%s: expected auto, on or off; probing", ENV, wanted)
    with _memo_lock:
        key = cache_key()
        path = state_dir / CACHE_NAME
        if (memo := _memo.get(str(path))) is not None and memo[0] == key:
            return memo[1]
        verdict = _read_cache(path, key)
        if verdict is None:
            verdict = run_probe()
            if verdict.extra is False:
                log.warning("%s", verdict.note)
            if verdict.source == "probe" or not verdict.extra:
                _write_cache(path, key, verdict)
        _memo[str(path)] = (key, verdict)
        return verdict


def cached(state_dir: Path) -> Verdict | None:
    """The verdict without probing (the CLI's ``models``): override or cache, else None."""
    if os.environ.get(ENV, "auto").strip().lower() in ("on", "off", "1", "0", "true", "false"):
        return decide(state_dir)
    return _read_cache(state_dir / CACHE_NAME, cache_key())


# -------------------------------------------------------------- the probe's model


def write_probe_model(path: Path) -> None:
    """A random-weight llama GGUF whose layers' matrices are Q4_0 (n_embd 256): the
    weights the CPU's extra buffer types take (AMX, repacked)."""
    import gguf as g  # the reference GGUF writer
    import numpy as n

    from .ggufwrite import finish, write_hparams

    n_embd, n_ff, n_head, n_layer = 256, 512, 4, 1
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = ([g.TokenType.UNKNOWN, g.TokenType.CONTROL, g.TokenType.CONTROL]
             + [g.TokenType.BYTE] * 256)
    rng = n.random.default_rng(7)
    w = g.GGUFWriter(str(path), "llama")
    write_hparams(w, n_ctx=256, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head,
                  file_type=g.LlamaFileType.MOSTLY_Q4_0, tokens=tokens,
                  scores=[0.0] * len(tokens), types=[int(t) for t in types])

    def f32(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(n.float32))

    def q4(name: str, rows: int, cols: int) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.1).astype(n.float32)
        q = g.quants.quantize(data, g.GGMLQuantizationType.Q4_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=g.GGMLQuantizationType.Q4_0)

    f32("token_embd.weight", len(tokens), n_embd)
    w.add_tensor("output_norm.weight", n.ones(n_embd, dtype=n.float32))
    f32("output.weight", len(tokens), n_embd)
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", n.ones(n_embd, dtype=n.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", n.ones(n_embd, dtype=n.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            q4(f"blk.{i}.{name}.weight", n_embd, n_embd)
        q4(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        q4(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        q4(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    finish(w)

