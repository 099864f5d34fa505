"""The test process and native faults (nativeguard.py): with the AMX-fault switch on, a
llama.cpp load that asks for extra buffer types dies of SIGSEGV on any CPU, the verdict
turns them off for every other load, and a test that kills the run is named last."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from everycycle.hardware import cpukernels

HERE = Path(__file__).parent


def test_a_test_that_kills_the_run_is_named_on_its_last_line() -> None:
    env = {**os.environ, cpukernels.CRASH_ENV: "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(HERE / "nativevictim.py")], capture_output=True, text=True,
                         env=env, timeout=300, check=False, cwd=HERE.parent)
    assert out.returncode == -signal.SIGSEGV, (out.returncode, out.stdout, out.stderr)
    assert "Segmentation fault" in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last == ("tests: the test process died while running "
                    "tests/nativevictim.py::test_a_load_with_extra_buffers (its fault "
                    "report, if any, is above)"), out.stderr[-2000:]


def test_the_switch_makes_the_probe_die_and_the_verdict_off(tmp_path: Path) -> None:
    env = {**os.environ, cpukernels.CRASH_ENV: "1", "EVERYCYCLE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", (
        "from everycycle import paths; from everycycle.hardware import cpukernels; "
        "v = cpukernels.decide(paths.state_dir()); print(v.extra, v.note)")],
        capture_output=True, text=True, env=env, timeout=300, check=True)
    assert out.stdout.strip() == ("False CPU extra buffer types (AMX, repacked weights) "
                                  "off: a probe using them died with SIGSEGV "
                                  "(segmentation fault)")
