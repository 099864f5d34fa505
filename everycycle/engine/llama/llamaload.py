"""Loading a GGUF into llama.cpp: the model pinned to an executor's devices, and a
context for N slots. The Runner owns what these return."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import AllocationError, InternalError, InvalidRequestError
from ...hardware.cpukernels import crash_if_simulated
from ...hardware.memory import kv_type_id
from ..core.stepcost import N_UBATCH
from .llamalog import backend_init, log_capture


def devices_for(executor: str, device_indices: Sequence[int],
                rpc_endpoints: Sequence[str]) -> list[int]:
    """The ggml device handles a model's load options name: its RPC servers' (registered
    here), or the executor's devices; none for the CPU."""
    from ...hardware import executors as ex

    backend_init()
    if rpc_endpoints:
        from ...hardware import rpc

        devices: list[int] = []
        for i, endpoint in enumerate(rpc_endpoints):
            handles = rpc.register(endpoint)
            if i == 0:
                devices = [handles[device_indices[0]]]
        return devices
    if device_indices:
        return ex.device_handles(executor, list(device_indices))
    return []


_ALLOCATION = ("failed to allocate", "insufficient memory", "out of memory",
               "unable to allocate", "allocation of size", "cudamalloc failed")


def _allocation_failure(errors: list[str]) -> str | None:
    """The first of llama.cpp's error lines that says an allocation failed, if any."""
    return next((e for e in errors if any(s in e.lower() for s in _ALLOCATION)), None)


@dataclass(eq=False)
class Weights:
    """A loaded llama_model, and the ctypes arrays its params point at (kept alive)."""

    model: Any
    offloaded: tuple[int, int] | None
    """(layers on the devices, layers + output head), as llama.cpp reported them."""
    _keep: tuple[Any, ...]


def load_model(L: Any, path: Path, *, gpu_devices: list[int], n_gpu_layers: int | None,
               tensor_split: tuple[float, ...] | list[float], extra_bufts: bool,
               load_mtp: bool = False) -> Weights:
    """``path``'s weights, the last ``n_gpu_layers`` layers (all: None) on
    ``gpu_devices``; ``load_mtp``: its multi-token-prediction layers too (``spec/mtp.py``).
    Raises InvalidRequestError for a file llama.cpp cannot load."""
    backend_init()
    mparams = L.llama_model_default_params()
    # Pin the model to the executor's devices: a NULL-terminated list (empty = CPU).
    devices = (ctypes.c_void_p * (len(gpu_devices) + 1))(*gpu_devices, None)
    mparams.devices = ctypes.cast(devices, ctypes.c_void_p).value
    # The last n_gpu_layers layers go on the devices (n_layer + 1: the output head too);
    # the rest stay on the CPU.
    mparams.n_gpu_layers = (0 if not gpu_devices else 999 if n_gpu_layers is None
                            else n_gpu_layers)
    # The CPU's extra buffer types (AMX, repacked weights): only where a child process
    # showed they run on this CPU (hardware/cpukernels.py).
    mparams.use_extra_bufts = extra_bufts
    mparams.load_mtp = load_mtp
    crash_if_simulated(extra_bufts)
    split: Any = None
    if tensor_split and len(gpu_devices) > 1:
        size = max(len(tensor_split), int(L.llama_max_devices()))
        split = (ctypes.c_float * size)(*tensor_split)
        mparams.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
    if not path.is_file():
        raise InvalidRequestError(f"{path} is not a file")
    with log_capture() as loading:
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        cause = _allocation_failure(loading.errors)
        if cause is not None:
            raise AllocationError(f"llama.cpp could not allocate the weights of {path}: "
                                  f"{cause}")
        raise InvalidRequestError(f"llama.cpp could not load {path} (not a valid GGUF?)")
    return Weights(model, loading.offloaded, (devices, split))


def create_context(L: Any, weights: Weights, path: Path, *, context: int, parallel: int,
                   n_batch: int, threads: int, kv_cache_type: str,
                   mtp_of: Any = None) -> tuple[Any, int]:
    """(a llama_context for ``parallel`` slots of ``context`` tokens, its KV cache size
    as llama.cpp reported it); ``mtp_of``: the target context whose model's MTP layers
    this one runs (``LLAMA_CONTEXT_TYPE_MTP``). Frees the model and raises InternalError
    on failure (an MTP context's failure frees nothing: ``InternalError`` alone)."""
    cparams = L.llama_context_default_params()
    if mtp_of is not None:
        cparams.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = mtp_of
    cparams.n_ctx = context * parallel
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(n_batch, N_UBATCH)
    cparams.n_seq_max = parallel
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.no_perf = True
    cparams.kv_unified = False
    # Sliding-window layers keep only their window (as llama-server does); prefix reuse
    # checks what the window still holds (Runner._start).
    cparams.swa_full = False
    kv_type = kv_type_id(kv_cache_type)
    cparams.type_k = kv_type
    cparams.type_v = kv_type
    if kv_cache_type != "f16":  # a quantized V cache needs flash attention
        cparams.flash_attn_type = 1  # LLAMA_FLASH_ATTN_TYPE_ENABLED
    with log_capture() as reported:
        ctx = L.llama_init_from_model(weights.model, cparams)
    if not ctx and mtp_of is not None:
        raise InternalError(f"llama.cpp could not create the MTP context of {path}")
    if not ctx:
        L.llama_model_free(weights.model)
        cause = _allocation_failure(reported.errors)
        if cause is not None:
            raise AllocationError(f"llama.cpp could not allocate the KV cache and compute "
                                  f"buffers of {path}: {cause}")
        raise InternalError(f"llama.cpp could not create a context for {path}")
    return ctx, reported.kv_bytes
