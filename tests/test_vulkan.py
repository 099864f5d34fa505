"""A real non-CPU executor: Vulkan on Mesa's lavapipe (the CI's Vulkan job, .ci/run).

Skipped where this llama.cpp build has no Vulkan device; with
EVERYCYCLE_REQUIRE_VULKAN=1 (set by that job) a missing device fails instead.
lavapipe's float arithmetic differs from ggml-cpu's, so these compare behaviour (it
loads there, generates, cancels, unloads, reports its layers), not exact text.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, cancel_mid_stream, greedy_ids, require_executor
from tinymodel import write_tiny_gguf

from everycycle.client import SyncClient
from everycycle.errors import RequestFailedError
from everycycle.hardware import executors as ex
from everycycle.hardware.memory import fit, plan
from everycycle.protocol import Error, LoadedModel, Unload

pytestmark = pytest.mark.vulkan


@pytest.fixture(scope="module")
def vulkan() -> ex.Executor:
    executor: ex.Executor = require_executor(
        "vulkan", "EVERYCYCLE_REQUIRE_VULKAN",
        "the Vulkan job needs a Vulkan executor, and discovery found none; "
        "is GGML_VK_VISIBLE_DEVICES=0 set?",
        "no Vulkan executor in this llama.cpp build: the Vulkan job (.ci/run, "
        ".ci/vulkan-venv) runs these")
    return executor


@pytest.fixture(scope="module")
def deep_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with 6 layers, to split between Vulkan0 and the CPU."""
    return write_tiny_gguf(tmp_path_factory.mktemp("vk") / "deep.gguf", n_layer=6)


@pytest.fixture
def vk_models(tmp_path: Path, tiny_gguf: Path, deep_gguf: Path) -> Path:
    f = tmp_path / "vk.toml"
    f.write_text('default = "tiny"\n'
                 f'[models.tiny]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 2\n'
                 f'[models.split]\npath = "{deep_gguf}"\ncontext = 512\nparallel = 2\n'
                 'executor = "vulkan"\ngpu_layers = 3\n'
                 f'[models.oncpu]\npath = "{tiny_gguf}"\ncontext = 512\nparallel = 2\n'
                 'executor = "cpu"\n')
    return f


@pytest.fixture
def client(vulkan: ex.Executor, spawn_daemon: SpawnDaemon, vk_models: Path
           ) -> Iterator[SyncClient]:
    spawn_daemon(models=vk_models)
    with SyncClient() as c:
        yield c


def loaded(c: SyncClient, name: str) -> LoadedModel:
    return next(m for m in c.describe_fleet().loaded_models if m.name == name)




def test_discovery_names_the_vulkan_device_its_vendor_and_memory(vulkan: ex.Executor) -> None:
    assert vulkan.is_gpu and vulkan.vendor == "Mesa"
    dev = vulkan.devices[0]
    assert dev.name == "Vulkan0" and "llvmpipe" in dev.description
    assert dev.memory_total > 0 and 0 < dev.memory_free <= dev.memory_total
    assert [e.name for e in ex.discover()][-1] == "cpu"  # GPU executors first


def test_auto_places_a_model_on_vulkan_and_generates(client: SyncClient) -> None:
    ids = greedy_ids(client, "tiny", 16)
    assert len(ids) == 16
    m = loaded(client, "tiny")
    assert m.assigned_executor == "vulkan"
    assert m.device_layers == m.total_layers == 2  # llama.cpp's own report: all of it
    snap = client.describe_fleet()
    vk = next(e for e in snap.executors if e.name == "vulkan")
    assert vk.vendor == "Mesa" and vk.device_count == 1 and vk.memory_total


def test_executor_cpu_keeps_it_off_the_gpu(client: SyncClient) -> None:
    assert len(greedy_ids(client, "oncpu", 4)) == 4
    m = loaded(client, "oncpu")
    assert m.assigned_executor == "cpu" and m.device_layers is None
    client.load("tiny", executor="cpu")  # not loaded yet: it goes where it is told
    assert loaded(client, "tiny").assigned_executor == "cpu"


def test_a_model_split_across_vulkan0_and_the_cpu(client: SyncClient, deep_gguf: Path,
                                                  vulkan: ex.Executor) -> None:
    ids = greedy_ids(client, "split", 24)
    assert len(ids) == 24
    m = loaded(client, "split")
    assert m.assigned_executor == "vulkan"
    assert (m.device_layers, m.total_layers) == (3, 6)  # as llama.cpp reported loading it
    # The planner's arithmetic, on this device: what it predicts is what llama.cpp did.
    p = plan(deep_gguf, context=512, parallel=2)
    predicted = fit(p, [vulkan.devices[0].memory_free], max_layers=3)
    assert (predicted.gpu_layers, predicted.n_layer, predicted.output) == (3, 6, False)
    assert 0 < predicted.device_bytes[0] < p.total and predicted.cpu_bytes > 0


def test_cancel_and_unload_on_vulkan(client: SyncClient) -> None:
    greedy_ids(client, "tiny", 2)
    last = cancel_mid_stream(client, "tiny", "vk-cancel")
    assert isinstance(last, Error) and last.kind.value == "Cancelled"
    client.unload("tiny")
    assert all(m.name != "tiny" for m in client.describe_fleet().loaded_models)
    with pytest.raises(RequestFailedError, match="not loaded"):
        client.unload("tiny")


def test_fleet_shows_the_vulkan_executor_and_layers(client: SyncClient) -> None:
    greedy_ids(client, "split", 2)
    out = subprocess.run([*EC, "fleet"], capture_output=True, text=True, timeout=60,
                         check=True, env={**os.environ, "COLUMNS": "160"})
    assert "vulkan" in out.stderr and "Mesa" in out.stderr and "3/6" in out.stderr, out.stderr
    assert "no GPU backend" not in out.stderr


@pytest.mark.anyio
async def test_a_failed_allocation_retries_on_fewer_gpu_layers(
        vulkan: ex.Executor, deep_gguf: Path, tmp_path: Path) -> None:
    # lavapipe never runs out of memory, so the failure is injected where llama.cpp's
    # would surface (the engine's load); everything after it is the real path: the fit
    # again, then half the layers on a real engine process, then a refusal with numbers.
    import anyio
    from test_supervisor_engines import Peer, until

    from everycycle.daemon.supervisor import Supervisor
    from everycycle.engine.host.contract import Engine, LoadOptions, Notify
    from everycycle.engine.host.process import EngineProcess
    from everycycle.errors import AllocationError
    from everycycle.models.registry import load_registry
    from everycycle.protocol import ErrorKind, Generate, Tokens

    models = tmp_path / "vk.toml"
    models.write_text(f'[models.deep]\npath = "{deep_gguf}"\ncontext = 256\nparallel = 1\n'
                      'executor = "vulkan"\n')
    tried: list[int] = []
    room = [3]  # layers the "device" can really take

    def make(name: str, path: Path, options: LoadOptions, notify: Notify,
             on_death: Callable[[Engine], None]) -> Engine:
        tried.append(options.n_gpu_layers)
        if options.n_gpu_layers > room[0]:
            raise AllocationError("llama.cpp could not allocate the weights of "
                                  f"{path}: ggml_vulkan: Device memory allocation failed")
        return EngineProcess(path, options, notify=notify, label=name, on_death=on_death)

    sup = Supervisor(load_registry(models), engine_factory=make)
    peer = Peer()
    async with anyio.create_task_group() as tg:
        await tg.start(sup.run)
        await sup.handle(peer, Generate("g1", "deep", "hello", max_tokens=4))
        await until(lambda: peer.ended("g1"))
        assert isinstance(peer.of("g1")[-1], Tokens) and peer.of("g1")[-1].finished
        assert tried == [7, 3]  # all 6 layers and the head; the fit agrees; then 3
        [loaded] = sup.snapshot().loaded_models
        assert (loaded.device_layers, loaded.total_layers) == (3, 6)
        await sup.handle(peer, Unload("u1", "deep"))
        tried.clear()
        room[0] = 0
        await sup.handle(peer, Generate("g2", "deep", "hello", max_tokens=4))
        await until(lambda: peer.ended("g2"))
        last = peer.of("g2")[-1]
        assert isinstance(last, Error) and last.kind is ErrorKind.REJECTED, last
        assert "could not be allocated on vulkan with 6, then 3 of 6 layers on the GPU" in \
            last.message and "Device memory allocation failed" in last.message
        assert tried == [7, 3]
        await sup.close()
        tg.cancel_scope.cancel()
