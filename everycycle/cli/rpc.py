"""``everycycle rpc-serve``: this host's executors for other daemons, over llama.cpp's RPC
backend (ggml-rpc)."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from ..errors import EverycycleError
from .common import app, exit_for, fail

DEFAULT_RPC_PORT = 50052
"""llama.cpp's rpc-server default."""


@app.command("rpc-serve")
def rpc_serve(
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535,
                                      help="The port to serve on.")] = DEFAULT_RPC_PORT,
    executor: Annotated[list[str] | None, typer.Option(
        "--executor", help="Executor to serve (repeat; default: cpu).")] = None,
    threads: Annotated[int | None, typer.Option("--threads", min=1,
                                                help="CPU threads (default: all).")] = None,
    cache_dir: Annotated[str | None, typer.Option(
        "--cache-dir", help="Keep received tensors here, so reloads send less.")] = None,
    allow_remote: Annotated[bool, typer.Option(
        "--allow-remote", help="Listen on a non-loopback address. ggml RPC has NO "
        "authentication and no encryption: anyone who reaches the port can use these "
        "devices and read what they hold.")] = False,
) -> None:
    """Serve this host's executors to other daemons (`everycycle daemon --rpc HOST:PORT`).

    ggml RPC has no authentication and no encryption: it listens on loopback unless
    --allow-remote, and then only belongs on a network you trust (SECURITY.md).

    \b
    Example:
      everycycle rpc-serve --port 50052 --executor cpu
    """
    import ipaddress
    import socket

    from ..hardware import executors as ex
    from ..hardware import rpc

    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback and not allow_remote:
        fail(f"--host {host} is not a loopback address; ggml RPC has no authentication: "
             "add --allow-remote only on a network you trust", 2)
    wanted = executor or ["cpu"]
    try:
        if not rpc.available():
            fail("this llama.cpp build has no RPC backend: reinstall llama-cpp-python with "
                 'CMAKE_ARGS="-DGGML_RPC=on" (see docs/operations.md, remote executors)', 2)
        found = {e.name: e for e in ex.discover()}
        devices: list[int] = []
        for name in wanted:
            if name not in found:
                fail(f"executor '{name}' is not in this build (have: {', '.join(found)})", 2)
            devices.extend(ex.device_handles(name, gpu_only=False))
    except EverycycleError as exc:
        exit_for(exc)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}", 1)
    if not loopback:
        sys.stderr.write(f"everycycle: WARNING: serving {', '.join(wanted)} on {host}:{port} "
                         "with NO authentication and NO encryption\n")
    sys.stderr.write(f"everycycle: serving {', '.join(wanted)} over ggml RPC on "
                     f"{host}:{port} (pid {os.getpid()})\n")
    sys.stderr.flush()
    sys.stdout.flush()
    rpc.serve(f"{host}:{port}", devices, threads=threads or os.cpu_count() or 1,
              cache_dir=cache_dir)
    fail(f"the RPC server on {host}:{port} stopped", 1)
