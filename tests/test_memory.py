"""Memory: sliding-window KV caches sized as llama-server sizes them, prefix reuse that
stays correct with them, KV cache types, and the figures users see."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from daemonhelp import EC, running_daemon
from enginehelp import Collector
from tinymodel import write_tiny_gguf

from everycycle.client import connect
from everycycle.engine.core.jobs import Job, JobSpec, Sampling
from everycycle.engine.worker.runner import Runner
from everycycle.errors import ConfigError
from everycycle.hardware.memory import KV_CACHE_TYPES, plan
from everycycle.models import registry
from everycycle.models.registry import load_registry

GREEDY = Sampling.of(temperature=0.0)


@pytest.fixture(scope="module")
def swa_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny gemma3 model whose layers see 32 positions (head size 32: q8_0/q4_0 fit)."""
    return write_tiny_gguf(tmp_path_factory.mktemp("swa") / "swa.gguf", sliding_window=32,
                           n_head=2)


def generate(runner: Runner, collector: Collector, tokens: list[int], tag: str,
             n: int = 24) -> list[int]:
    runner.submit(Job(JobSpec(tokens=tokens, max_tokens=n, sampling=GREEDY), tag=tag))
    return [i for out in collector.wait(tag) for i in out.ids]


def fresh(path: Path, tokens: list[int]) -> list[int]:
    collector = Collector()
    runner = Runner(path, context=1024, parallel=1, notify=collector, n_batch=64)
    try:
        return generate(runner, collector, tokens, "fresh")
    finally:
        runner.close()


def test_sliding_window_prefix_reuse_equals_a_fresh_start(swa_gguf: Path) -> None:
    collector = Collector()
    # n_batch 64: the window layers keep pad(32 + 64) = 256 cells, so long prompts evict
    runner = Runner(swa_gguf, context=1024, parallel=1, notify=collector, n_batch=64)
    try:
        first = runner.tokenize("hello world the a " * 40, None)
        answer = generate(runner, collector, first, "first")
        # a follow-up that extends everything cached: the window is all there, reuse it
        follow = first + answer + runner.tokenize(" again", None)[1:]
        job = Job(JobSpec(tokens=follow, max_tokens=24, sampling=GREEDY), tag="follow")
        runner.submit(job)
        reused = [i for out in collector.wait("follow") for i in out.ids]
        assert job.n_reused >= len(first)  # the window was all there: reused
        # The reused cells hold the answer decoded one token at a time, a fresh start
        # prefills it in a batch: equal only where the engine's probe says batches are
        # bit-exact on this CPU.
        if runner.lookup_exact:
            assert reused == fresh(swa_gguf, follow)
        # a prompt sharing only an early prefix: its window was evicted, start over
        early = first[:300] + runner.tokenize(" world world", None)[1:]
        assert generate(runner, collector, early, "early") == fresh(swa_gguf, early)
    finally:
        runner.close()


def test_the_sliding_window_test_model_depends_on_its_context(swa_gguf: Path) -> None:
    collector = Collector()
    runner = Runner(swa_gguf, context=1024, parallel=1, notify=collector, n_batch=64)
    try:
        tail = runner.tokenize(" world world", None)[1:]
        a = runner.tokenize("hello world the a " * 5, None) + tail
        b = runner.tokenize("a the world hello " * 5, None) + tail
    finally:
        runner.close()
    assert fresh(swa_gguf, a) != fresh(swa_gguf, b)  # else the reuse test proves nothing


@pytest.mark.parametrize("kv", sorted(KV_CACHE_TYPES))
@pytest.mark.parametrize("model", ["llama", "swa"])
def test_the_kv_estimate_agrees_with_llama_cpps_own_accounting(
    kv: str, model: str, swa_gguf: Path, tmp_path: Path
) -> None:
    path = swa_gguf if model == "swa" else write_tiny_gguf(tmp_path / "t.gguf", n_head=2)
    runner = Runner(path, context=2048, parallel=3, notify=Collector(), kv_cache_type=kv)
    try:
        reported = runner.kv_bytes
    finally:
        runner.close()
    planned = plan(path, context=2048, parallel=3, kv_cache_type=kv).kv
    assert reported > 0 and abs(planned - reported) <= 0.05 * reported, (planned, reported)


def test_sliding_window_layers_keep_only_their_window(swa_gguf: Path, tiny_gguf: Path) -> None:
    window = plan(swa_gguf, context=8192, parallel=4).kv
    full = plan(tiny_gguf, context=8192, parallel=4).kv
    # 2 layers x 4 slots x 768 cells (pad(32 + 512) to 256) vs 8,192 cells, same widths
    assert window * 8192 == full * 768


def test_an_unsupported_kv_cache_type_names_the_file_and_key(tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text('[models.x]\npath = "m.gguf"\nkv_cache_type = "q2_k"\n')
    with pytest.raises(ConfigError, match=rf"{f}: \[models.x\].kv_cache_type must be one of"):
        load_registry(f)
    assert registry.KV_CACHE_TYPES == tuple(KV_CACHE_TYPES)


@pytest.mark.anyio
async def test_fleet_shows_memory_that_agrees_with_the_plan(swa_gguf: Path,
                                                            tmp_path: Path) -> None:
    f = tmp_path / "models.toml"
    f.write_text(f'[models.swa]\npath = "{swa_gguf}"\ncontext = 2048\nparallel = 2\n'
                 'kv_cache_type = "q8_0"\n')
    async with running_daemon(f), connect() as client:
        await client.load("swa")
        snap = await client.describe_fleet()
    (m,) = snap.loaded_models
    needs = plan(swa_gguf, context=2048, parallel=2, kv_cache_type="q8_0")
    assert m.kv_bytes and abs(m.kv_bytes - needs.kv) <= 0.05 * m.kv_bytes
    assert m.weights_bytes and m.weights_bytes <= needs.weights
    assert snap.daemon_rss and snap.daemon_rss > 10 << 20


def test_models_shows_what_a_model_will_need(models_file: Path, tiny_gguf: Path) -> None:
    out = subprocess.run([*EC, "models", "--json", "--models", str(models_file)],
                         capture_output=True, text=True, timeout=60, check=False)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["tiny"]["kv_bytes"] == plan(tiny_gguf, context=8192, parallel=1).kv
    assert rows["missing"]["kv_bytes"] is None
