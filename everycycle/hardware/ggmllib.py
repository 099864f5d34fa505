"""The ggml library that ships with llama-cpp-python, loaded without llama_cpp itself.

The daemon asks ggml's backend registry for its executors and their memory, and
whether the build has the RPC backend; it never loads a model. Importing llama_cpp for
that would bring its bindings and numpy into the daemon (about 20 MB of RSS), so the
library is opened directly from llama-cpp-python's ``lib`` directory. In a process that
imported llama_cpp already (an engine, embedded mode), its own handle is used: the same
library either way.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
from pathlib import Path

_NAMES = {"win32": ("ggml.dll", "libggml.dll"), "darwin": ("libggml.dylib", "libggml.so")}


@functools.cache
def libggml() -> ctypes.CDLL:
    """ggml's shared library (the one llama_cpp uses)."""
    if "llama_cpp" in sys.modules:
        from llama_cpp import _ggml

        lib: ctypes.CDLL = _ggml.libggml
        return lib
    spec = importlib.util.find_spec("llama_cpp")
    if spec is not None and spec.submodule_search_locations:
        base = Path(next(iter(spec.submodule_search_locations))) / "lib"
        for name in _NAMES.get(sys.platform, ("libggml.so",)):
            if (base / name).exists():
                return ctypes.CDLL(str(base / name), mode=ctypes.RTLD_GLOBAL)
    from llama_cpp import _ggml  # (a layout we do not know: let llama_cpp find it)

    found: ctypes.CDLL = _ggml.libggml
    return found
