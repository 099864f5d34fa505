"""The test process and native faults: in-process llama.cpp loads obey the CPU-kernel
verdict, and a test that kills the process is named last.

- ``obey_the_verdict()``: every llama.cpp model a test loads in its own process
  (``Llama(...)`` references, raw decode loops, ``Runner``) takes its extra buffer types
  (AMX, repacked weights) from ``cpukernels.decide``, as an engine process does. On an
  Intel CPU whose AMX kernels fault, a reference vector or an exactness check would
  otherwise kill the whole run. With ``cpukernels.CRASH_ENV=1`` a load that still asks
  for them dies of SIGSEGV, as it would there: the suite run that way is the check.
- ``DeathWatch``: a small watcher process that hears which test is running; if the test
  process dies (a signal, the OOM killer), it writes that test's name as the last line
  of the output, after the fault report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import IO, Any

from everycycle import paths
from everycycle.hardware import cpukernels


def obey_the_verdict() -> None:
    """Patch llama-cpp-python's default model params and model loader (in this process)."""
    import llama_cpp
    import llama_cpp.llama_cpp as raw

    defaults = raw.llama_model_default_params
    load = raw.llama_model_load_from_file

    def default_params() -> Any:
        params = defaults()
        params.use_extra_bufts = cpukernels.decide(paths.state_dir()).extra
        return params

    def load_from_file(path: bytes, params: Any) -> Any:
        cpukernels.crash_if_simulated(bool(params.use_extra_bufts))
        return load(path, params)

    for module in (llama_cpp, raw):
        module.llama_model_default_params = default_params  # type: ignore[assignment]
        module.llama_model_load_from_file = load_from_file  # type: ignore[assignment]


_WATCHER = r"""
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, current, buf = os.getppid(), "", b""
while True:
    ready, _, _ = select.select([0], [], [], 0.5)
    if not ready:
        if os.getppid() != parent:
            break
        continue
    data = os.read(0, 65536)
    if not data:
        break
    buf += data
    *lines, buf = buf.split(b"\n")
    for line in lines:
        current = line.decode("utf-8", "replace")
        if current == "\0done":
            sys.exit(0)
where = f"while running {current}" if current else "before any test ran"
sys.stderr.write(f"\ntests: the test process died {where} (its fault report, if any, "
                 "is above)\n")
"""


class DeathWatch:
    """The pytest plugin: tells the watcher each test's id as it starts."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _WATCHER], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, start_new_session=True)
        assert self._proc.stdin is not None
        self._pipe: IO[bytes] = self._proc.stdin

    def _say(self, line: str) -> None:
        try:
            self._pipe.write(line.encode("utf-8", "replace") + b"\n")
            self._pipe.flush()
        except OSError:  # the watcher is gone: nothing to tell
            pass

    def pytest_runtest_logstart(self, nodeid: str, location: object) -> None:
        self._say(nodeid)

    def close(self) -> None:
        self._say("\0done")
        try:
            self._pipe.close()
        except OSError:
            pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def watching() -> bool:
    """Whether to start the watcher (not in a child pytest a test starts, nor when asked
    not to)."""
    return os.environ.get("EVERYCYCLE_TEST_NO_DEATHWATCH") != "1"
