"""An NVIDIA GPU for real: run by bench/gpu_check.sh on a GPU machine.

Skipped where this llama.cpp build has no CUDA device; with EVERYCYCLE_REQUIRE_GPU=1
(set by the GPU check) a missing device fails instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SpawnDaemon
from daemonhelp import cancel_mid_stream, greedy_ids, require_executor

from everycycle.client import SyncClient
from everycycle.hardware import executors as ex
from everycycle.protocol import Error

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda() -> ex.Executor:
    executor: ex.Executor = require_executor(
        "cuda", "EVERYCYCLE_REQUIRE_GPU", "no CUDA executor",
        "no CUDA executor in this llama.cpp build: bench/gpu_check.sh runs these")
    return executor


@pytest.fixture
def client(cuda: ex.Executor, spawn_daemon: SpawnDaemon, tmp_path: Path,
           tiny_gguf: Path) -> Iterator[SyncClient]:
    f = tmp_path / "gpu.toml"
    f.write_text('default = "tiny"\n'
                 f'[models.tiny]\npath = "{tiny_gguf}"\ncontext = 2048\nparallel = 8\n'
                 f'[models.half]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 2\n'
                 'gpu_layers = 1\n'
                 f'[models.pinned]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 2\n'
                 'executor = "cuda:0"\n')
    spawn_daemon(models=f)
    with SyncClient() as c:
        yield c




def test_the_gpu_is_named_with_its_vendor_and_memory(cuda: ex.Executor) -> None:
    assert cuda.vendor == "NVIDIA" and cuda.is_gpu
    assert all(d.memory_total > d.memory_free > 0 for d in cuda.devices)


def test_auto_offloads_everything_and_generates(client: SyncClient) -> None:
    assert len(greedy_ids(client, "tiny", 64)) == 64
    m = next(m for m in client.describe_fleet().loaded_models if m.name == "tiny")
    assert m.assigned_executor == "cuda" and m.device_layers == m.total_layers == 2


def test_partial_offload_and_pinning(client: SyncClient) -> None:
    assert len(greedy_ids(client, "half", 16)) == 16
    assert len(greedy_ids(client, "pinned", 16)) == 16
    fleet = {m.name: m for m in client.describe_fleet().loaded_models}
    assert (fleet["half"].device_layers, fleet["half"].total_layers) == (1, 2)
    assert fleet["pinned"].assigned_executor == "cuda:0"


def test_cancel_and_unload_on_the_gpu(client: SyncClient) -> None:
    last = cancel_mid_stream(client, "tiny", "gpu-cancel")
    assert isinstance(last, Error) and last.kind.value == "Cancelled"
    client.unload("tiny")
    assert all(m.name != "tiny" for m in client.describe_fleet().loaded_models)
