"""The soak, long: hostile clients mixed into 4 normal streams against a real daemon.

Slow readers, never-readers, endless HTTP headers, mid-stream disconnects and dead-end
grammars (socket and HTTP) come and go while 4 normal clients stream greedy
generations on the tests' tiny model; prints how many of each ran, whether any normal
answer changed, and the daemon's RSS at start, peak and end (tests/soak.py).

    .venv/bin/python bench/soak.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from daemonhelp import daemon_process
from soak import soak
from tinymodel import write_tiny_gguf

from everycycle import paths
from everycycle.client import SyncClient


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60)
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="ecsoak", dir="/tmp"))
    os.environ["EVERYCYCLE_HOME"] = str(home)
    model = write_tiny_gguf(home / "tiny.gguf")
    models = home / "models.toml"
    models.write_text(f'[models.tiny4]\npath = "{model}"\ncontext = 512\nparallel = 4\n')
    with daemon_process("--models", str(models), "--http", "127.0.0.1:0") as proc:
        with SyncClient() as c:
            c.load("tiny4")
            url = c.describe_fleet().http
        assert url is not None
        host, _, port = url.removeprefix("http://").rpartition(":")
        result = soak(paths.socket_path(), (host, int(port)), proc.pid, args.seconds)
        alive = proc.poll() is None
    for line in result.lines():
        print(line)
    print(f"daemon alive at the end: {alive}; errors: {result.errors or 'none'}")


if __name__ == "__main__":
    main()
