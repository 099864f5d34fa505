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

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    """Bytes a model needs: its weights and the KV cache for its slots, and both per
    repeating layer (what partial offload moves to a device, layer by layer)."""

    weights: int
    kv: int
    layer_weights: tuple[int, ...] = field(default=())
    """Each repeating layer's tensors (``blk.N.*``)."""
    other_weights: int = 0
    """Embeddings, output norm and head: the rest of the file."""
    layer_kv: tuple[int, ...] = field(default=())

    @property
    def total(self) -> int:
        return self.weights + self.kv

    @property
    def n_layer(self) -> int:
        return len(self.layer_weights)


DEVICE_RESERVE = 256 << 20
"""Kept free on each device for llama.cpp's compute buffers and the driver."""


@dataclass(frozen=True, slots=True)
class Offload:
    """How much of a model goes on a set of devices; the rest stays on the CPU.

    llama.cpp offloads the *last* ``gpu_layers`` repeating layers (and their KV cache),
    and with all of them the output head too (``n_gpu_layers = n_layer + 1``).
    """

    gpu_layers: int
    n_layer: int
    output: bool
    device_bytes: tuple[int, ...]
    """What each device will hold (weights + KV)."""
    cpu_bytes: int
    """What stays in host memory (weights + KV)."""
    split: tuple[float, ...] = ()
    """llama.cpp's tensor_split: each device's share; empty for a single device."""

    @property
    def n_gpu_layers(self) -> int:
        return self.gpu_layers + (1 if self.output else 0)

    @property
    def full(self) -> bool:
        return self.output and self.gpu_layers == self.n_layer


def fit(plan: MemoryPlan, free: Sequence[int], *, reserve: int = DEVICE_RESERVE,
        max_layers: int | None = None) -> Offload:
    """As many layers as the devices' free memory holds (after ``reserve`` each), and
    at most ``max_layers`` (models.toml's ``gpu_layers``) when given.

    Several devices share the layers in proportion to their room (llama.cpp's
    tensor split); since layers are whole, each device keeps one layer's worth spare.
    """
    n = plan.n_layer
    room = [max(0, f - reserve) for f in free]
    total_room = sum(room)
    slack = (max(plan.layer_weights, default=0) + max(plan.layer_kv, default=0)
             if len(room) > 1 else 0)

    def need(k: int) -> int:
        return sum(plan.layer_weights[n - k:]) + sum(plan.layer_kv[n - k:])

    everything = plan.total
    chosen, output = 0, False
    top = n if max_layers is None else max(0, min(n, max_layers))
    if (n and top == n and all(r >= slack for r in room)
            and everything + slack * len(room) <= total_room):
        chosen, output = n, True
    else:
        for k in range(top, 0, -1):
            if need(k) + slack * len(room) <= total_room:
                chosen = k
                break
    on_devices = everything if output else need(chosen) if chosen else 0
    if len(room) > 1 and total_room:
        split = tuple(r / total_room for r in room)
        shares = [int(on_devices * share) for share in split]
        shares[-1] += on_devices - sum(shares)  # rounding: the last device takes the rest
        device_bytes = tuple(shares)
    else:
        split, device_bytes = (), (on_devices,) * len(room)
    return Offload(gpu_layers=chosen, n_layer=n, output=output, device_bytes=device_bytes,
                   cpu_bytes=everything - on_devices, split=split if chosen else ())


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


def _header(path: Path) -> tuple[dict[str, Any], tuple[int, list[int], int]]:
    """``path``'s metadata and its weights' bytes (every part of a split GGUF: all, per
    layer, the rest), read once while the file stays as it is (a context is fitted by
    planning several). Not to be changed by the caller."""
    try:
        st = path.stat()
    except OSError:
        from .gguf import read_metadata

        read_metadata(path)  # (its error: the file is not a readable GGUF)
        raise
    return _read_header(path, st.st_mtime_ns, st.st_size, st.st_ino)


@functools.lru_cache(maxsize=64)
def _read_header(path: Path, mtime_ns: int, size: int, inode: int
                 ) -> tuple[dict[str, Any], tuple[int, list[int], int]]:
    from .gguf import model_bytes, read_metadata

    meta = read_metadata(path, wanted_suffixes=(".attention.sliding_window_pattern",))
    return meta, model_bytes(path)


def plan(path: Path, *, context: int, parallel: int, kv_cache_type: str = "f16",
         n_ubatch: int = 512) -> MemoryPlan:
    """The memory ``path`` needs with ``parallel`` slots of ``context`` tokens.

    Raises InvalidRequestError for a file that is not a readable GGUF, ConfigError for
    an unknown ``kv_cache_type``.
    """
    kv_type_id(kv_cache_type)
    per_element = KV_CACHE_TYPES[kv_cache_type][1]
    meta, (size, layers, other) = _header(path)
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
    layer_kv = tuple(int(parallel * (swa_cells if swa else per_seq) * n_head_kv
                         * (k_dim + v_dim) * per_element)
                     for swa in swa_layers(meta, arch, n_layer))
    if len(layers) != n_layer:  # an architecture whose layers are not blk.N: one lump
        layers, other = [0] * n_layer, size
    return MemoryPlan(weights=size, kv=sum(layer_kv),
                      layer_weights=tuple(layers), other_weights=other, layer_kv=layer_kv)


DEFAULT_TRAINED = 4096
"""A GGUF that does not say what context it was trained for is taken for this."""
AGENT_CONTEXT = 32768
"""The context a default aims at where the model was trained for it: a coding agent's
first prompt is 7-15k tokens, and its session grows from there."""
GROWTH_SHARE = 0.75
"""A default context grows past ``AGENT_CONTEXT`` only into this share of the memory
that is free (the rest stays for the other models, the prompt caches, the system)."""


def trained_context(path: Path) -> int:
    """The context ``path``'s model was trained for (GGUF ``{arch}.context_length``)."""
    meta = _header(path)[0]
    value = meta.get(f"{meta.get('general.architecture', '')}.context_length")
    return value if isinstance(value, int) and value > 0 else DEFAULT_TRAINED


def fit_context(path: Path, *, parallel: int, kv_cache_type: str, free: int,
                total: int) -> int:
    """The context a slot gets when models.toml names none: the largest power of two
    (the trained length itself where that is one) not past what the model was trained
    for whose plan — weights and ``parallel`` slots of KV cache of ``kv_cache_type`` —
    fits: up to ``AGENT_CONTEXT`` in the executor's ``total`` memory (making room there
    is the load's business, as for any model), and past it only into ``GROWTH_SHARE`` of
    what is ``free`` now. Never below 256 tokens."""
    trained = trained_context(path)
    top = 1 << (trained.bit_length() - 1)  # (the largest power of two <= trained)

    def fits(context: int, room: float) -> bool:
        return plan(path, context=context, parallel=parallel,
                    kv_cache_type=kv_cache_type).total <= room

    context = min(top, AGENT_CONTEXT)
    while context > 256 and not fits(context, total):
        context //= 2
    while context < top and context >= AGENT_CONTEXT and fits(2 * context,
                                                              free * GROWTH_SHARE):
        context *= 2
    return context
