"""Context that fits the work: an entry without ``context`` gets what its model was
trained for as memory allows (reported as loaded in fleet, /v1/models, /api/ps,
/api/show and show); a client that asks for more (Ollama's ``num_ctx``, ``load
--context``) has the model loaded again once, never again for less; past what the model
was trained for it is refused. Through the real daemon and the real `ollama` client."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from pathlib import Path

import httpx
import ollama
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC
from httphelp import fleet_http, ollama_client
from templatehelp import SMOLLM2
from tinymodel import write_tiny_gguf

from everycycle.client import SyncClient
from everycycle.hardware.executors import MEMORY_OVERRIDE_ENV
from everycycle.hardware.memory import AGENT_CONTEXT, fit_context, plan


def loaded_context(name: str) -> int | None:
    with SyncClient() as c:
        return next((m.context for m in c.describe_fleet().loaded_models
                     if m.name == name), None)


def test_the_default_is_the_largest_power_of_two_that_fits(tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "t.gguf", n_ctx=40960)  # (Qwen3's: not a power of two)
    roomy = {"parallel": 4, "kv_cache_type": "f16", "free": 1 << 40, "total": 1 << 40}
    assert fit_context(model, **roomy) == 32768
    small = plan(model, context=4096, parallel=4).total + 1000
    assert fit_context(model, parallel=4, kv_cache_type="f16", free=small,
                       total=small) == 4096
    # past an agent's context only into the free memory's share
    big = write_tiny_gguf(tmp_path / "big.gguf", n_ctx=1 << 17)
    assert fit_context(big, **roomy) == 1 << 17
    half = plan(big, context=65536, parallel=4).total
    assert fit_context(big, parallel=4, kv_cache_type="f16", free=half, total=1 << 40) \
        == AGENT_CONTEXT


def test_an_entry_without_context_gets_what_the_model_was_trained_for(
        spawn_daemon: SpawnDaemon, tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "t8k.gguf", n_ctx=8192)
    models = tmp_path / "models.toml"
    models.write_text(f'[models.t]\npath = "{model}"\nparallel = 2\n')
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    url = fleet_http()
    done = subprocess.run([*EC, "load", "t"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0 and "8,192 tokens a slot" in done.stderr, done.stderr
    assert loaded_context("t") == 8192
    fleet = subprocess.run([*EC, "fleet"], capture_output=True, text=True, timeout=60,
                           check=True)
    assert "8,192" in fleet.stdout + fleet.stderr, fleet.stderr
    [listed] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert listed["context_length"] == listed["max_model_len"] == 8192
    [ps] = httpx.get(f"{url}/api/ps", timeout=30).json()["models"]
    assert ps["context_length"] == 8192
    show = httpx.post(f"{url}/api/show", json={"model": "t"}, timeout=30).json()
    assert "PARAMETER num_ctx 8192" in show["modelfile"]
    out = subprocess.run([*EC, "show", "t", "--models", str(models)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0 and "8192" in out.stdout, out.stdout


def test_the_default_gives_way_to_memory(spawn_daemon: SpawnDaemon, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = write_tiny_gguf(tmp_path / "t.gguf", n_ctx=16384)
    # the CPU holds the model with 2 slots of 4,096 tokens, not of 8,192
    room = plan(model, context=4096, parallel=2).total + 200_000
    assert plan(model, context=8192, parallel=2).total > room
    monkeypatch.setenv(MEMORY_OVERRIDE_ENV, f"cpu={room}B")
    models = tmp_path / "models.toml"
    models.write_text(f'[models.t]\npath = "{model}"\nparallel = 2\n')
    spawn_daemon(models=models)
    subprocess.run([*EC, "load", "t"], check=True, capture_output=True, timeout=120)
    assert loaded_context("t") == 4096


@pytest.mark.shipped
def test_the_shipped_entry_loads_what_smollm2_was_trained_for(
        spawn_daemon: SpawnDaemon) -> None:
    if not SMOLLM2.exists():
        pytest.skip("the default model is not installed")
    spawn_daemon(models=Path(__file__).parent.parent / "everycycle" / "models.toml")
    subprocess.run([*EC, "load", "smollm2-135m"], check=True, capture_output=True,
                   timeout=300)
    assert loaded_context("smollm2-135m") == 8192


def test_num_ctx_loads_the_model_again_once_and_never_for_less(
        spawn_daemon: SpawnDaemon, tmp_path: Path) -> None:
    model = write_tiny_gguf(tmp_path / "t.gguf", n_ctx=16384)
    models = tmp_path / "models.toml"
    models.write_text(f'[models.t]\npath = "{model}"\ncontext = 4096\nparallel = 1\n')
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    url = fleet_http()
    subprocess.run([*EC, "load", "t"], check=True, capture_output=True, timeout=120)
    assert loaded_context("t") == 4096
    seen: list[dict[str, object]] = []
    ready = threading.Event()

    def watch() -> None:
        with contextlib.suppress(httpx.HTTPError), httpx.stream(  # (ends with the daemon)
                "GET", f"{url}/v1/events?types=model_loaded,model_unloaded",
                timeout=None) as r:
            ready.set()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(json.loads(line[6:]))

    threading.Thread(target=watch, daemon=True).start()
    assert ready.wait(30)
    with ollama_client(url, timeout=120) as client:
        hi = [{"role": "user", "content": "hi"}]
        answer = client.chat(model="t", messages=hi, options={"num_ctx": 8192, "num_predict": 4})
        assert answer.done and answer.eval_count
        assert loaded_context("t") == 8192
        for i in range(10):
            answer = client.chat(model="t", messages=hi, options={
                "num_ctx": 2048 if i % 2 else 8192, "num_predict": 4})
            assert answer.done
        assert loaded_context("t") == 8192
        with pytest.raises(ollama.ResponseError, match="more than model 't' was trained for "
                           r"\(16,384\)"):
            client.chat(model="t", messages=hi, options={"num_ctx": 20000, "num_predict": 4})
        ps = client.ps().models
        assert [m.model for m in ps] == ["t:latest"]
    loads = [e for e in seen if e["type"] == "model_loaded"]
    unloads = [e for e in seen if e["type"] == "model_unloaded"]
    assert len(loads) == 1 and len(unloads) == 1, seen  # the raise, and nothing after
    assert unloads[0]["why"] == "reload" and "8,192-token context" in str(
        unloads[0]["message"])


def test_launch_says_in_one_line_why_a_context_is_short() -> None:
    from everycycle.cli.launch import AGENTS, Endpoint, context_warning

    claude = AGENTS["claude"]
    at = ("http://127.0.0.1:1", "k", "m")
    assert context_warning(claude, Endpoint(*at, 32768, trained=32768, chosen=True)) is None
    trained = context_warning(claude, Endpoint(*at, 8192, trained=8192, chosen=True))
    assert trained is not None and "trained for a 8,192-token context" in trained
    assert "refused as too long" in trained and "\n" not in trained
    memory = context_warning(claude, Endpoint(*at, 16384, trained=32768, chosen=True))
    assert memory is not None and "the most its executor's memory holds" in memory
    assert "16,384-token context" in memory
    told = context_warning(claude, Endpoint(*at, 4096, trained=32768, chosen=False))
    assert told is not None and "`context = 32768`" in told
