"""llama.cpp's process-wide set-up: its backends, and its log.

llama.cpp logs through one callback for the whole process. Everything it logs goes to
``logging`` (never to stdout); what it logs while a call runs on a thread inside
``log_capture`` — the KV cache it allocated, the layers it offloaded, its error lines —
is also collected for that call. Captures are per thread, so one model's load never
waits for another's grammar, nor the other way round.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("everycycle.engine.worker.runner")

_KV_SIZE = re.compile(rb"^llama_kv_cache: size = +([0-9.]+) MiB")
_OFFLOADED = re.compile(rb"offloaded (\d+)/(\d+) layers to GPU")


@dataclass
class Captured:
    """What llama.cpp reported during one call on one thread."""

    kv_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    offloaded: tuple[int, int] | None = None
    """(layers on devices, layers) as llama.cpp reports loading a model (the output
    head counts as a layer there)."""


_local = threading.local()


@contextlib.contextmanager
def log_capture() -> Iterator[Captured]:
    """Collect what llama.cpp logs on this thread while the block runs."""
    captured = Captured()
    outer = getattr(_local, "capture", None)
    _local.capture = captured
    try:
        yield captured
    finally:
        _local.capture = outer


def _quiet_log(level: int, text: bytes, user_data: Any) -> None:
    """llama.cpp's log, routed to ``logging`` (it must never reach stdout)."""
    if not text:
        return
    captured: Captured | None = getattr(_local, "capture", None)
    if captured is not None:
        if level == 2:  # GGML_LOG_LEVEL_INFO
            m = _KV_SIZE.match(text)
            if m:
                captured.kv_bytes += int(float(m.group(1)) * (1 << 20))
            m = _OFFLOADED.search(text)
            if m:
                captured.offloaded = (int(m.group(1)), int(m.group(2)))
        elif level == 4:  # GGML_LOG_LEVEL_ERROR
            captured.errors.append(text.decode("utf-8", "replace").strip())
    if level == 4:  # GGML_LOG_LEVEL_ERROR
        log.warning("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())
    elif level == 3:  # GGML_LOG_LEVEL_WARN: model quirks, not the user's concern
        log.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())


_backend_lock = threading.Lock()
_backend_state: dict[str, Any] = {}


def backend_init() -> None:
    """Once per process: route llama.cpp's log and initialise its backends."""
    with _backend_lock:
        if _backend_state:
            return
        import llama_cpp as L

        callback = L.llama_log_callback(_quiet_log)
        _backend_state["log"] = callback  # keep the ctypes callback alive
        L.llama_log_set(callback, ctypes.c_void_p(0))
        L.llama_backend_init()


def route_mtmd_log(mtmd: Any) -> None:
    """libmtmd logs through a callback of its own: send it where llama.cpp's goes."""
    backend_init()
    with _backend_lock:
        if "mtmd" not in _backend_state:
            _backend_state["mtmd"] = True
            mtmd.mtmd_helper_log_set(_backend_state["log"], ctypes.c_void_p(0))
