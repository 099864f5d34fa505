"""What a model will need in memory before it is loaded: weights plus its KV cache.

The arithmetic is llama.cpp's (llama-context.cpp, llama-kv-cache-iswa.cpp) for the
context the engine creates: one KV stream per slot (``kv_unified`` off), each of
``context`` cells padded to 256; layers with sliding-window attention keep only
``min(context, n_swa + n_ubatch)`` cells (padded to 256), as llama-server does with
``swa_full`` off. Placement, ``everycycle models`` and the fleet view all use it; the
engine reports llama.cpp's own figure once a model is loaded (tests hold the two within
5% of each other). Only the GGUF's metadata header is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

KV_CACHE_TYPES: dict[str, tuple[int, float]] = {
    # name: (ggml_type, bytes per element)
    "f16": (1, 2.0),
    "q8_0": (8, 34 / 32),
    "q4_0": (2, 18 / 32),
}
"""KV cache types llama.cpp supports on every backend (llama-server's -ctk/-ctv)."""

# Architectures whose sliding-window layers follow a fixed pattern when the GGUF does
# not say: in each group of N layers all but the last use the window (llama.cpp's
# set_swa_pattern). An architecture not listed is sized as all full layers: too much
# rather than too little.
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4}
_PAD = 256


def _pad(n: int) -> int:
    return (n + _PAD - 1) // _PAD * _PAD


def kv_type_id(name: str) -> int:
    """The ggml type of a KV cache type name. Raises ConfigError for an unknown one."""
    try:
        return KV_CACHE_TYPES[name][0]
    except KeyError:
        allowed = ", ".join(KV_CACHE_TYPES)
        raise ConfigError(f"kv_cache_type '{name}' is not one of {allowed}") from None


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes a model needs: its weights and the KV cache for its slots."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def swa_layers(meta: dict[str, Any], arch: str, n_layer: int) -> list[bool]:
    """Which layers attend through a sliding window."""
    window = meta.get(f"{arch}.attention.sliding_window")
    if not isinstance(window, int) or window <= 0:
        return [False] * n_layer
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERN.get(arch))
    if isinstance(pattern, list) and len(pattern) >= n_layer:
        return [bool(x) for x in pattern[:n_layer]]
    if isinstance(pattern, int) and pattern > 0:
        return [i % pattern < pattern - 1 for i in range(n_layer)]
    return [False] * n_layer


def plan(path: Path, *, context: int, parallel: int, kv_cache_type: str = "f16",
         n_ubatch: int = 512) -> MemoryPlan:
    """The memory ``path`` needs with ``parallel`` slots of ``context`` tokens.

    Raises InvalidRequestError for a file that is not a readable GGUF, ConfigError for
    an unknown ``kv_cache_type``.
    """
    from .gguf import read_metadata

    kv_type_id(kv_cache_type)
    per_element = KV_CACHE_TYPES[kv_cache_type][1]
    meta = read_metadata(path, wanted_suffixes=(".attention.sliding_window_pattern",))
    arch = meta.get("general.architecture", "")

    def num(key: str, default: int) -> int:
        value = meta.get(f"{arch}.{key}", default)
        return value if isinstance(value, int) and value > 0 else default

    n_layer = num("block_count", 1)
    n_embd = num("embedding_length", 1)
    n_head = num("attention.head_count", 1)
    n_head_kv = num("attention.head_count_kv", n_head)
    k_dim = num("attention.key_length", n_embd // n_head)
    v_dim = num("attention.value_length", k_dim)
    window = num("attention.sliding_window", 0)
    per_seq = _pad(context)
    swa_cells = _pad(min(per_seq, window + n_ubatch)) if window else per_seq
    cells = sum(swa_cells if swa else per_seq for swa in swa_layers(meta, arch, n_layer))
    kv = int(parallel * cells * n_head_kv * (k_dim + v_dim) * per_element)
    return MemoryPlan(weights=path.stat().st_size, kv=kv)
