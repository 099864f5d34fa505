"""llama.cpp's RPC backend (ggml-rpc): serving this host's devices, and using another's.

ggml-rpc ends the whole process (GGML_ABORT) when a server cannot be reached or goes
away, and a registered server is asked for its memory whenever devices are listed.
So the daemon never registers one itself: probing a host (``probe``, run through
``python -m everycycle.hardware.rpc probe ENDPOINT`` by ``probe_in_child``) and running
a model on it (an engine process, ``engine/process.py``) happen in child processes,
where an abort costs only that child. The RPC protocol has no authentication: whoever
reaches a server's port can use its devices and read what they hold.
"""

from __future__ import annotations

import ctypes
import json
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, InternalError

PROBE_TIMEOUT = 20.0


@dataclass(frozen=True, slots=True)
class RemoteDevice:
    """One device a remote RPC server offers."""

    index: int
    memory_total: int
    memory_free: int


def executor_name(endpoint: str) -> str:
    return f"rpc:{endpoint}"


def parse_endpoint(text: str) -> str:
    """``HOST:PORT`` (``[v6]:PORT`` too), checked. Raises ConfigError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"RPC endpoint {text!r}: expected HOST:PORT")
    return text


def _lib() -> Any:
    from .ggmllib import libggml

    lib = libggml()
    vp, cp = ctypes.c_void_p, ctypes.c_char_p
    lib.ggml_backend_reg_by_name.argtypes, lib.ggml_backend_reg_by_name.restype = [cp], vp
    lib.ggml_backend_reg_get_proc_address.argtypes = [vp, cp]
    lib.ggml_backend_reg_get_proc_address.restype = vp
    lib.ggml_backend_register.argtypes, lib.ggml_backend_register.restype = [vp], None
    return lib


def available() -> bool:
    """Whether this llama.cpp build has the RPC backend (``-DGGML_RPC=on``)."""
    return bool(_lib().ggml_backend_reg_by_name(b"RPC"))


def _proc(name: str, restype: Any, argtypes: list[Any]) -> Any:
    lib = _lib()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise ConfigError("this llama.cpp build has no RPC backend: reinstall llama-cpp-python "
                          "with CMAKE_ARGS=\"-DGGML_RPC=on\" (docs/operations.md: remote executors)")
    address = lib.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not address:
        raise InternalError(f"the RPC backend has no {name}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


def reachable(endpoint: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``endpoint`` (before risking an abort)."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def register(endpoint: str) -> list[int]:
    """Add the server at ``endpoint`` to ggml's devices (in a child process only: an
    unreachable server aborts the process); returns its device handles in order."""
    import llama_cpp  # noqa: F401

    if not reachable(endpoint):
        raise InternalError(f"RPC host {endpoint} is unreachable")
    add = _proc("ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
    reg = add(endpoint.encode())
    if not reg:
        raise InternalError(f"RPC host {endpoint} offers no devices")
    lib = _lib()
    lib.ggml_backend_register(reg)
    lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
    return [lib.ggml_backend_reg_dev_get(reg, i) for i in range(lib.ggml_backend_reg_dev_count(reg))]


def probe(endpoint: str) -> list[RemoteDevice]:
    """The devices of the server at ``endpoint`` (aborts the process if it goes away
    meanwhile: call through ``probe_in_child``)."""
    handles = register(endpoint)
    lib = _lib()
    sz = ctypes.c_size_t
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(sz),
                                            ctypes.POINTER(sz)]
    lib.ggml_backend_dev_memory.restype = None
    found = []
    for i, dev in enumerate(handles):
        free, total = sz(0), sz(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(RemoteDevice(i, total.value, free.value))
    return found


def probe_in_child(endpoint: str, timeout: float = PROBE_TIMEOUT) -> list[RemoteDevice]:
    """``probe`` in a child process. Raises InternalError naming the host when it cannot
    be reached, and ConfigError when this build has no RPC backend."""
    try:
        out = subprocess.run([sys.executable, "-m", "everycycle.hardware.rpc", "probe", endpoint],
                             capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise InternalError(f"RPC host {endpoint} did not answer in {timeout:g} s") from None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        reason = (lines[-1] if lines else "") or out.stderr.strip().splitlines()[-1:] or [""]
        text = reason if isinstance(reason, str) else reason[0]
        if text.startswith("config:"):
            raise ConfigError(text.removeprefix("config:").strip())
        raise InternalError(f"RPC host {endpoint} is unreachable"
                            + (f" ({text.removeprefix('error:').strip()})" if text else ""))
    return [RemoteDevice(**d) for d in json.loads(lines[-1])]


def serve(endpoint: str, devices: Sequence[int], *, threads: int,
          cache_dir: str | None = None) -> None:
    """Serve ``devices`` (ggml device handles) at ``endpoint`` until the process ends."""
    start = _proc("ggml_backend_rpc_start_server", None,
                  [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                   ctypes.c_void_p])
    array = (ctypes.c_void_p * len(devices))(*devices)
    start(endpoint.encode(), cache_dir.encode() if cache_dir else None, threads, len(devices),
          ctypes.cast(array, ctypes.c_void_p))


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "probe":
        from ..errors import EverycycleError

        try:
            found = probe(argv[1])
        except ConfigError as exc:
            sys.stdout.write(f"config: {exc.message}\n")
            return 2
        except EverycycleError as exc:
            sys.stdout.write(f"error: {exc.message}\n")
            return 1
        sys.stdout.write(json.dumps([{"index": d.index, "memory_total": d.memory_total,
                                      "memory_free": d.memory_free} for d in found]) + "\n")
        return 0
    sys.stderr.write("usage: python -m everycycle.hardware.rpc probe HOST:PORT\n")
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
