"""Executors: the ggml backends this build of llama.cpp has, their devices, and placement.

Discovery reads llama.cpp's own backend registry inside the ggml library that ships
with llama-cpp-python (through ctypes), never vendor tools. One executor per backend
(cuda, metal, vulkan, rocm, sycl, cpu) with its devices, their memory and the
hardware vendor. Placement is pure logic over those descriptions, so it is tested
on executor lists built as data.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError, RejectedError
from .memory import DEVICE_RESERVE, MemoryPlan, Offload, fit

# ggml_backend_dev_type (ggml-backend.h). ACCEL devices (BLAS, AMX) work alongside the
# CPU backend and META devices wrap others: neither is an executor of its own.
_DEV_CPU, _DEV_GPU, _DEV_IGPU, _DEV_ACCEL, _DEV_META = 0, 1, 2, 3, 4
_GPU_TYPES = (_DEV_GPU, _DEV_IGPU)

_BACKEND_NAMES = {
    "cuda": "cuda",
    "metal": "metal",
    "mtl": "metal",
    "vulkan": "vulkan",
    "rocm": "rocm",
    "hip": "rocm",
    "sycl": "sycl",
    "cpu": "cpu",
}
_BACKEND_VENDORS = {"cuda": "NVIDIA", "metal": "Apple", "rocm": "AMD", "sycl": "Intel"}
_VENDOR_WORDS = (
    ("nvidia", "NVIDIA"),
    ("geforce", "NVIDIA"),
    ("apple", "Apple"),
    ("amd", "AMD"),
    ("radeon", "AMD"),
    ("intel", "Intel"),
    ("qualcomm", "Qualcomm"),
    ("adreno", "Qualcomm"),
    ("mali", "Arm"),
    ("llvmpipe", "Mesa"),  # lavapipe: Mesa's Vulkan driver on the CPU
    ("lavapipe", "Mesa"),
    ("swiftshader", "Google"),
)


@dataclass(frozen=True, slots=True)
class Device:
    """One ggml device of an executor."""

    name: str
    description: str
    memory_total: int
    memory_free: int
    is_gpu: bool


@dataclass(frozen=True, slots=True)
class Executor:
    """One ggml backend with its devices."""

    name: str
    vendor: str
    devices: tuple[Device, ...]
    remote: str | None = None
    """The RPC server (HOST:PORT) of a remote executor; None for this host's own."""

    @property
    def is_gpu(self) -> bool:
        return any(d.is_gpu for d in self.devices)

    @property
    def memory_total(self) -> int:
        return sum(d.memory_total for d in self.devices)

    @property
    def memory_free(self) -> int:
        return sum(d.memory_free for d in self.devices)


def cpu_vendor() -> str:
    """The CPU's vendor, from the OS (``/proc/cpuinfo`` or the platform module)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    vendor_id = fields.get("vendor_id", "")
    known = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon"}
    if vendor_id in known:
        return known[vendor_id]
    if vendor_id:
        return vendor_id
    implementer = fields.get("CPU implementer", "").lower()
    arm = {"0x41": "Arm", "0x61": "Apple", "0x51": "Qualcomm", "0x48": "HiSilicon",
           "0xc0": "Ampere", "0x4e": "NVIDIA"}
    if implementer in arm:
        return arm[implementer]
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        return "Apple"
    return platform.processor() or platform.machine() or "unknown"


def vendor_of(backend: str, descriptions: Sequence[str]) -> str:
    """The hardware vendor of a backend, from its name or its devices' descriptions."""
    if backend == "cpu":
        return cpu_vendor()
    if backend in _BACKEND_VENDORS:
        return _BACKEND_VENDORS[backend]
    for desc in descriptions:
        low = desc.lower()
        for word, vendor in _VENDOR_WORDS:
            if word in low:
                return vendor
    return "unknown"


def _ggml() -> Any:
    """The ggml library llama-cpp-python ships, with the registry functions typed."""
    from .ggmllib import libggml

    lib = libggml()
    vp, sz, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
    for fn, args, res in (
        ("ggml_backend_reg_count", [], sz),
        ("ggml_backend_reg_get", [sz], vp),
        ("ggml_backend_reg_name", [vp], cp),
        ("ggml_backend_reg_dev_count", [vp], sz),
        ("ggml_backend_reg_dev_get", [vp, sz], vp),
        ("ggml_backend_dev_name", [vp], cp),
        ("ggml_backend_dev_description", [vp], cp),
        ("ggml_backend_dev_type", [vp], ctypes.c_int),
        ("ggml_backend_dev_memory", [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None),
    ):
        f = getattr(lib, fn)
        f.argtypes, f.restype = args, res
    return lib


def _backend_key(reg_name: str) -> str:
    low = reg_name.lower()
    return _BACKEND_NAMES.get(low, low)


MEMORY_OVERRIDE_ENV = "EVERYCYCLE_TEST_MEMORY"
"""Tests only: ``cpu=300MiB,vulkan=1GiB`` gives each named executor that much memory in
all, of which what the daemon's own models hold (``held``) is not free, as a device
would report it, in place of the hardware's figures: memory budgets for the tests of
making room, through the same placement a real figure takes."""

_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def host_available() -> int | None:
    """The host memory a new model can have: Linux's MemAvailable (free memory plus the
    page cache the kernel can reclaim); None where the OS does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_overrides() -> dict[str, int]:
    spec = os.environ.get(MEMORY_OVERRIDE_ENV, "")
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, size = part.partition("=")
        number = re.sub(r"[A-Za-z]+$", "", size)
        out[name] = int(float(number) * _SIZE_UNITS[size[len(number):].lower()])
    return out


def _with_overrides(found: list[Executor], held: Mapping[str, int]) -> list[Executor]:
    budgets = _memory_overrides()
    if not budgets:
        return found
    out = []
    for e in found:
        budget = budgets.get(e.name)
        if budget is not None:
            each, free = budget // len(e.devices), max(0, budget - held.get(e.name, 0))
            e = replace(e, devices=tuple(replace(d, memory_total=each,
                                                 memory_free=free // len(e.devices))
                                         for d in e.devices))
        out.append(e)
    return out


def discover(held: Mapping[str, int] | None = None) -> list[Executor]:
    """Every backend this llama.cpp build has, GPU executors first, cpu last; the host's
    free memory is what it has available (ggml reports all of it as free).

    ``held``: bytes the caller's own models hold, by executor name (only a test's
    memory override needs it: real devices report their free memory themselves).
    A backend with no CPU or GPU device of its own (BLAS, AMX, meta devices) is not an
    executor. Loads ggml (not llama_cpp) on first use.
    """
    lib = _ggml()
    found: list[Executor] = []
    for r in range(lib.ggml_backend_reg_count()):
        reg = lib.ggml_backend_reg_get(r)
        key = _backend_key(lib.ggml_backend_reg_name(reg).decode("utf-8", "replace"))
        devices = []
        for d in range(lib.ggml_backend_reg_dev_count(reg)):
            dev = lib.ggml_backend_reg_dev_get(reg, d)
            kind = lib.ggml_backend_dev_type(dev)
            if kind not in (_DEV_CPU, *_GPU_TYPES):
                continue
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            available = host_available() if kind == _DEV_CPU else None
            devices.append(
                Device(
                    name=lib.ggml_backend_dev_name(dev).decode("utf-8", "replace"),
                    description=lib.ggml_backend_dev_description(dev).decode("utf-8", "replace"),
                    memory_total=total.value,
                    memory_free=free.value if available is None else min(available,
                                                                        total.value),
                    is_gpu=kind in _GPU_TYPES,
                )
            )
        if not devices:
            continue
        vendor = vendor_of(key, [dv.description for dv in devices])
        found.append(Executor(name=key, vendor=vendor, devices=tuple(devices)))
    found.sort(key=lambda e: (not e.is_gpu, e.name == "cpu"))
    return _with_overrides(found, held or {})


def device_handles(executor: str, indices: Sequence[int] | None = None, *,
                   gpu_only: bool = True) -> list[int]:
    """The ggml device pointers of ``executor``'s GPU devices (those at ``indices`` in
    its device list, or all), for llama_model_params; with ``gpu_only`` off, its CPU
    devices too (to serve them over RPC)."""
    lib = _ggml()
    kinds = _GPU_TYPES if gpu_only else (_DEV_CPU, *_GPU_TYPES)
    out: list[int] = []
    for r in range(lib.ggml_backend_reg_count()):
        reg = lib.ggml_backend_reg_get(r)
        if _backend_key(lib.ggml_backend_reg_name(reg).decode("utf-8", "replace")) != executor:
            continue
        gpus = [dev for d in range(lib.ggml_backend_reg_dev_count(reg))
                if lib.ggml_backend_dev_type(dev := lib.ggml_backend_reg_dev_get(reg, d))
                in kinds]
        out.extend(gpus if indices is None else [gpus[i] for i in indices])
    return out


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a model goes: an executor, which of its GPU devices, how many layers."""

    executor: Executor
    device_indices: tuple[int, ...]
    """Indices into the executor's devices; empty on the CPU."""
    offload: Offload | None
    """None on the CPU."""
    pinned: bool = False
    """Named with a device index (``cuda:1``)."""

    @property
    def name(self) -> str:
        """``cuda``, ``cuda:1`` when pinned to one device, ``cpu``."""
        if self.pinned:
            return f"{self.executor.name}:{self.device_indices[0]}"
        return self.executor.name


def _fit_on(e: Executor, indices: Sequence[int], plan: MemoryPlan,
            max_layers: int | None) -> Placement:
    free = [e.devices[i].memory_free for i in indices]
    return Placement(e, tuple(indices), fit(plan, free, max_layers=max_layers))


def with_layers(placement: Placement, plan: MemoryPlan, layers: int) -> Placement:
    """``placement`` with at most ``layers`` repeating layers on its devices (the rest,
    and the output head unless all of them go, on the CPU)."""
    return Placement(placement.executor, placement.device_indices,
                     _fit_on(placement.executor, placement.device_indices, plan,
                             layers).offload, placement.pinned)


def _check_host(placement: Placement, executors: Sequence[Executor], plan: MemoryPlan
                ) -> Placement:
    """What stays on the CPU must fit the host's available memory."""
    host = next((e for e in executors if e.name == "cpu"), None)
    on_host = placement.offload.cpu_bytes if placement.offload else plan.total
    if host is not None and host.memory_total and on_host > host.memory_free:
        raise RejectedError(
            f"the model needs {_mib(on_host)} of host memory beside what its executor "
            f"holds; this machine has {_mib(host.memory_free)} available of "
            f"{_mib(host.memory_total)}")
    return placement


@dataclass(frozen=True)
class Wanted:
    """Where a model is asked to go, parsed once at the edge (models.toml's
    ``executor``, ``load --executor``): ``auto``; an executor by name (``cpu``,
    ``vulkan``: all its GPUs; ``rpc:HOST:PORT/0``, an RPC server's device); or one
    device of a GPU executor (``cuda:1``)."""

    name: str
    """The executor's name (``auto``: any)."""
    index: int | None = None
    """One of its GPUs (``cuda:1``); None: all."""

    @classmethod
    def parse(cls, text: str) -> Wanted:
        """Raises InvalidRequestError for a device index that is not a number."""
        if text.startswith("rpc:") or ":" not in text:
            return cls(text)
        base, _, index = text.partition(":")
        if not index.isdigit():
            raise InvalidRequestError(
                f"executor '{text}': a device of {base} is named by its number ({base}:0)")
        return cls(base, int(index))

    def __str__(self) -> str:
        return self.name if self.index is None else f"{self.name}:{self.index}"

    @property
    def auto(self) -> bool:
        return self.name == "auto"

    @property
    def rpc_host(self) -> str | None:
        """``HOST:PORT`` of an RPC server's executor; None for any other."""
        if not self.name.startswith("rpc:"):
            return None
        return self.name.removeprefix("rpc:").rpartition("/")[0]


def place(wanted: Wanted, executors: Sequence[Executor], plan: MemoryPlan, *,
          max_layers: int | None = None) -> Placement:
    """Choose where a model needing ``plan`` goes.

    ``auto``: the first GPU executor that holds all of it; else the GPU executor that
    holds the most layers (the rest on the CPU, as Ollama and llama-server's ``--fit``
    do); else the CPU. ``vulkan`` (a backend): all its GPUs, layers split by their free
    memory. ``cuda:1``: that device alone. A named executor must be in this build (else
    InvalidRequestError) and hold at least one layer (else RejectedError, with the
    numbers). ``max_layers`` caps the layers on any GPU (models.toml's ``gpu_layers``).
    """
    by_name = {e.name: e for e in executors}
    if wanted.auto:
        best: Placement | None = None
        for e in executors:
            if not e.is_gpu or e.remote:  # a remote executor only when named
                continue
            here = _fit_on(e, [i for i, d in enumerate(e.devices) if d.is_gpu], plan,
                           max_layers)
            assert here.offload is not None
            if here.offload.full:
                return _check_host(here, executors, plan)
            if here.offload.gpu_layers and (
                    best is None or best.offload is None
                    or here.offload.gpu_layers > best.offload.gpu_layers):
                best = here
        if best is not None:
            return _check_host(best, executors, plan)
        if "cpu" in by_name:
            return _check_host(Placement(by_name["cpu"], (), None), executors, plan)
        raise RejectedError(f"no executor has {_mib(plan.total)} free for this model")
    base, index = wanted.name, wanted.index
    chosen = by_name.get(base)
    if chosen is None:
        have = ", ".join(e.name for e in executors) or "none"
        raise InvalidRequestError(
            f"executor '{wanted}' is not in this build of llama.cpp (have: {have})"
        )
    if not chosen.is_gpu:
        if index is not None:
            raise InvalidRequestError(f"executor '{base}' takes no device index")
        return _check_host(Placement(chosen, (), None), executors, plan)
    gpus = [i for i, d in enumerate(chosen.devices) if d.is_gpu]
    if index is not None:
        if index >= len(gpus):
            raise InvalidRequestError(
                f"executor '{wanted}': {base} has devices 0 to {len(gpus) - 1}")
        gpus = [gpus[index]]
    placement = _fit_on(chosen, gpus, plan, max_layers)
    placement = Placement(chosen, placement.device_indices, placement.offload,
                          pinned=index is not None)
    assert placement.offload is not None
    if not placement.offload.gpu_layers:
        free = sum(chosen.devices[i].memory_free for i in gpus)
        first = (plan.layer_weights[-1] + plan.layer_kv[-1]) if plan.n_layer else plan.total
        raise RejectedError(
            f"executor '{wanted}' has {_mib(free)} free; the model needs "
            f"{_mib(plan.total)} ({_mib(first)} for one layer, {_mib(DEVICE_RESERVE)} "
            "kept for compute)")
    return _check_host(placement, executors, plan)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"
