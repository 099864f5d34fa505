"""LoRA adapters (llama-server's ``--lora`` and per-request ``lora``): a tiny random
adapter the test writes in llama.cpp's adapter format changes the tiny model's logits by
what llama.cpp's own computation gives (the raw bindings, side by side), per request,
with two requests of different scales in flight at once; a scale of 0 is the base model;
an adapter for another model is one sentence at load; and through the daemon: models.toml
``lora``, the OpenAI body's ``lora``, ``GET``/``POST /lora-adapters``, ``fleet``."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import SpawnDaemon
from enginehelp import Collector
from httphelp import fleet_http, openai_client
from modelshelp import Entry, models_toml
from tinymodel import write_tiny_gguf, write_tiny_lora

from everycycle.client import SyncClient
from everycycle.engine.core.jobs import Job, JobSpec, Output, Sampling
from everycycle.engine.worker.lora import Adapters
from everycycle.engine.worker.runner import Runner
from everycycle.errors import InvalidRequestError

PROMPT = "hello world"
TOP = 5


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("lora")
    return write_tiny_gguf(folder / "tiny.gguf"), write_tiny_lora(folder / "adapter.gguf")


def raw_first_logprobs(model_path: Path, adapter_path: Path, tokens: list[int],
                       scale: float) -> np.ndarray:
    """The log-probabilities of the first token after ``tokens``, computed by llama.cpp
    through the raw bindings with the adapter at ``scale``."""
    import llama_cpp as L

    model = L.llama_model_load_from_file(str(model_path).encode(),
                                         L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch = 512, 512
    ctx = L.llama_init_from_model(model, params)
    try:
        if scale:
            adapter = L.llama_adapter_lora_init(model, str(adapter_path).encode())
            handles = (L.llama_adapter_lora_p_ctypes * 1)(adapter)
            assert L.llama_set_adapters_lora(ctx, handles, 1, (ctypes.c_float * 1)(scale)) == 0
        ids = (L.llama_token * len(tokens))(*tokens)
        assert L.llama_decode(ctx, L.llama_batch_get_one(ids, len(tokens))) == 0
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1),
                                       shape=(n_vocab,)).astype(np.float64)
        return logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)


def first(outs: list[Output]) -> tuple[float, ...]:
    """The first token's top log-probabilities, as the engine reported them."""
    lp = next(o.logprobs for o in outs if o.logprobs)
    return tuple(value for _, value, _ in lp[0][2])


def test_scales_change_the_logits_as_llama_cpp_computes_them(
        files: tuple[Path, Path]) -> None:
    model, adapter = files
    c = Collector()
    runner = Runner(model, context=1024, parallel=2, notify=c, lora=[adapter])
    try:
        tokens = runner.tokenize(PROMPT)
        jobs = {scale: Job(JobSpec(tokens=tokens, max_tokens=3, logprobs=TOP, lora=(scale,),
                                   sampling=Sampling.of(temperature=0.0)), tag=scale)
                for scale in (1.0, 0.5)}
        with runner._cond:  # (both in flight at once: they take turns, never share a step)
            for job in jobs.values():
                runner.submit(job)
        got = {scale: first(c.wait(scale, 60)) for scale in jobs}
        base = Job(JobSpec(tokens=tokens, max_tokens=3, logprobs=TOP, lora=(0.0,),
                           sampling=Sampling.of(temperature=0.0)), tag="base")
        runner.submit(base)
        got[0.0] = first(c.wait("base", 60))
        assert runner.adapters is not None and runner.adapters.switches >= 2
    finally:
        runner.close()
    for scale, values in got.items():
        raw = raw_first_logprobs(model, adapter, list(tokens), scale)
        expected = np.sort(raw)[::-1][:TOP]
        assert np.allclose(values, expected, atol=1e-3), (scale, values, expected)
    assert not np.allclose(got[1.0], got[0.0], atol=0.1)  # (it changes the model)
    assert not np.allclose(got[1.0], got[0.5], atol=0.1)


def test_an_adapter_for_another_model_is_one_sentence(files: tuple[Path, Path],
                                                      tmp_path: Path) -> None:
    model, _ = files
    other = write_tiny_lora(tmp_path / "other.gguf", n_embd=32)
    with pytest.raises(InvalidRequestError) as caught:
        Runner(model, context=256, parallel=1, notify=Collector(), lora=[other])
    message = caught.value.message
    assert message.startswith("LoRA adapter other.gguf cannot be applied to model 'tiny.gguf'")
    assert "\n" not in message


def test_scales_past_the_adapters_are_refused(files: tuple[Path, Path]) -> None:
    model, adapter = files
    runner = Runner(model, context=256, parallel=1, notify=Collector(), lora=[adapter])
    try:
        with pytest.raises(InvalidRequestError, match="has 1 LoRA adapter"):
            runner.submit(Job(JobSpec(tokens=runner.tokenize("x"), max_tokens=1,
                                      lora=(1.0, 0.5))))
    finally:
        runner.close()


# ---------------------------------------------------------------- through the daemon


@pytest.fixture
def url(spawn_daemon: SpawnDaemon, files: tuple[Path, Path], tmp_path: Path) -> Iterator[str]:
    model, adapter = files
    models = models_toml(tmp_path / "models.toml", Entry(
        "tuned", model, context=1024, parallel=2,
        more={"lora": [{"path": str(adapter), "scale": 0.0}]}), default="tuned")
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    yield fleet_http()


def _answer(url: str, **extra: object) -> tuple[str, list[float]]:
    with openai_client(url) as client:
        answer = client.chat.completions.create(
            model="tuned", messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
            temperature=0, logprobs=True, top_logprobs=TOP, extra_body=extra or None)
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    return choice.message.content or "", [t.logprob for t in
                                          choice.logprobs.content[0].top_logprobs]


def test_a_request_sets_its_scales_and_the_adapters_endpoint_the_models(url: str) -> None:
    listed = httpx.get(f"{url}/lora-adapters", timeout=30).json()
    assert [(a["id"], Path(a["path"]).name, a["scale"]) for a in listed] == [
        (0, "adapter.gguf", 0.0)]
    _, base = _answer(url)
    _, tuned = _answer(url, lora=[{"id": 0, "scale": 1.0}])
    assert not np.allclose(base, tuned, atol=0.1)
    # The model's own scale, set for every request that names none:
    posted = httpx.post(f"{url}/lora-adapters", json=[{"id": 0, "scale": 1.0}], timeout=30)
    assert posted.status_code == 200, posted.text
    assert httpx.get(f"{url}/lora-adapters", timeout=30).json()[0]["scale"] == 1.0
    _, now = _answer(url)
    assert np.allclose(now, tuned, atol=1e-3)
    bad = httpx.post(f"{url}/lora-adapters", json=[{"id": 3, "scale": 1.0}], timeout=30)
    assert bad.status_code == 400 and "adapter 3" in bad.json()["error"]["message"]
    with openai_client(url) as client, pytest.raises(Exception, match="adapter 7"):
        client.chat.completions.create(model="tuned", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, extra_body={"lora": [{"id": 7, "scale": 1}]})
    with SyncClient() as c:
        (model,) = c.describe_fleet().loaded_models
    assert model.lora == ("adapter.gguf@1",)


def test_an_ollama_model_with_an_adapter_layer_runs_with_its_adapter(
        files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        spawn_daemon: SpawnDaemon) -> None:
    """Ollama's Modelfile ``ADAPTER``: the manifest's adapter layer is read from its store
    (pinned by its blob's digest) and applied at scale 1, as Ollama applies it."""
    import hashlib
    import json

    model, adapter = files
    root = tmp_path / "ollama"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))

    def blob(data: bytes, kind: str) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "blobs" / f"sha256-{digest}").write_bytes(data)
        return {"mediaType": f"application/vnd.ollama.image.{kind}",
                "digest": f"sha256:{digest}", "size": len(data)}

    for tag, layers in (("base", [blob(model.read_bytes(), "model")]),
                        ("tuned", [blob(model.read_bytes(), "model"),
                                   blob(adapter.read_bytes(), "adapter")])):
        manifest = root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / tag
        manifest.parent.mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    spawn_daemon("--http", "127.0.0.1:0")
    url = fleet_http()

    def first_top(name: str) -> list[float]:
        with openai_client(url) as client:
            answer = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                temperature=0, logprobs=True, top_logprobs=TOP)
        content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content
        return [t.logprob for t in content[0].top_logprobs]

    base, tuned = first_top("ollama:tiny:base"), first_top("ollama:tiny:tuned")
    assert not np.allclose(base, tuned, atol=0.1)
    with SyncClient() as c:
        rows = {m.name: m.lora for m in c.describe_fleet().loaded_models}
    assert rows["ollama:tiny:tuned"] is not None and rows["ollama:tiny:base"] is None


def test_show_lists_a_models_adapters_and_a_bad_entry_is_one_sentence(
        files: tuple[Path, Path], tmp_path: Path) -> None:
    import subprocess

    from daemonhelp import EC

    model, adapter = files
    good = models_toml(tmp_path / "good.toml", Entry(
        "tuned", model, more={"lora": [{"path": adapter.name, "scale": 0.5}]}))
    (tmp_path / adapter.name).write_bytes(adapter.read_bytes())  # (relative to the file)
    shown = subprocess.run([*EC, "show", "tuned", "--models", str(good)], capture_output=True,
                           text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    assert f"{tmp_path / adapter.name} (scale 0.5)" in shown.stdout
    bad = models_toml(tmp_path / "bad.toml", Entry(
        "tuned", model, more={"lora": [{"path": "a.gguf", "scale": "high"}]}))
    refused = subprocess.run([*EC, "show", "tuned", "--models", str(bad)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode != 0 and "lora[0].scale must be a number" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_an_adapter_pinned_by_sha256_is_checked_at_load(
        files: tuple[Path, Path], tmp_path: Path, spawn_daemon: SpawnDaemon) -> None:
    import hashlib

    from everycycle.errors import RequestFailedError

    model, adapter = files
    right = hashlib.sha256(adapter.read_bytes()).hexdigest()
    models = models_toml(tmp_path / "pinned.toml", *(Entry(
        name, model, context=256, parallel=1,
        more={"lora": [{"path": str(adapter), "sha256": sha}]})
        for name, sha in (("right", right), ("wrong", "0" * 64))))
    spawn_daemon(models=models)
    with SyncClient() as c:
        c.load("right")
        with pytest.raises(RequestFailedError, match=f"sha256 is {right}"):
            c.load("wrong")


def test_an_adapter_from_the_hub_is_pulled_pinned_at_load(
        files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        spawn_daemon: SpawnDaemon) -> None:
    """``lora = [{ path = "hf://owner/repo/file.gguf@commit", sha256 = … }]``: the load
    downloads it into the HF cache (a local stand-in for the hub), checked against its
    pin, and the model serves with it."""
    import hashlib

    from fakehub import FakeHub, serving

    model, adapter = files
    commit = "0123456789abcdef0123456789abcdef01234567"
    data = adapter.read_bytes()
    hub = FakeHub()
    hub.add("acme/tiny-lora", commit, "adapter.gguf", data)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with serving(hub, monkeypatch):
        models = models_toml(tmp_path / "hub.toml", Entry(
            "hubtuned", model, context=256, parallel=1, more={"lora": [{
                "path": f"hf://acme/tiny-lora/adapter.gguf@{commit}", "scale": 1.0,
                "sha256": hashlib.sha256(data).hexdigest()}]}))
        spawn_daemon(models=models)
        with SyncClient() as c:
            c.load("hubtuned")
            (loaded,) = c.describe_fleet().loaded_models
    assert loaded.lora == ("adapter.gguf@1",)
    assert any(p == "GET" and "adapter.gguf" in path for p, path, _ in hub.requests)


def test_scales_set_for_a_model_give_way_to_an_edit_of_its_adapters(
        files: tuple[Path, Path], tmp_path: Path) -> None:
    from everycycle.daemon.lorascales import LoraScales
    from everycycle.models.registry import load_registry

    model, adapter = files
    one = load_registry(models_toml(tmp_path / "one.toml", Entry(
        "m", model, more={"lora": [{"path": str(adapter), "scale": 0.5}]}))).get("m")
    two = load_registry(models_toml(tmp_path / "two.toml", Entry(
        "m", model, more={"lora": [{"path": str(adapter)}, {"path": str(adapter),
                                                           "scale": 0.25}]}))).get("m")
    scales = LoraScales()
    assert scales.update(one, [(0, 2.0)]) == [2.0]
    assert scales.of(one) == [2.0]
    assert scales.of(two) == [1.0, 0.25]  # (two adapters now: models.toml's scales)
    assert scales.for_request(two, [(1, 0.0)]) == (1.0, 0.0)


class _Refusing(Adapters):
    """Adapters whose scale 0.5 llama.cpp refuses (``llama_set_adapters_lora`` != 0)."""

    def apply(self, ctx: object, scales: tuple[float, ...]) -> None:
        if 0.5 in scales:
            raise InvalidRequestError(f"llama.cpp could not apply LoRA scales {scales} (-1)")
        super().apply(ctx, scales)


def test_scales_llama_cpp_refuses_end_that_request_only(files: tuple[Path, Path]) -> None:
    """A step whose adapter scales cannot be set ends its own jobs with why; the engine
    thread goes on serving the others (it used to fail every job it held)."""
    model, adapter = files
    c = Collector()
    runner = Runner(model, context=1024, parallel=2, notify=c, lora=[adapter])
    try:
        assert runner.adapters is not None
        runner.adapters.__class__ = _Refusing  # (the one the engine holds)
        tokens = runner.tokenize(PROMPT)
        for tag, scale in (("ok", 1.0), ("refused", 0.5)):
            runner.submit(Job(JobSpec(tokens=tokens, max_tokens=40, lora=(scale,),
                                      sampling=Sampling.of(temperature=0.0)), tag=tag))
        refused = c.wait("refused", 60)
        assert refused[-1].finished and refused[-1].reason == "error"
        assert refused[-1].error is not None and "could not apply" in refused[-1].error.message
        assert c.wait("ok", 60)[-1].reason in ("length", "eos", "stop")
        runner.submit(Job(JobSpec(tokens=tokens, max_tokens=3, lora=(0.0,),
                                  sampling=Sampling.of(temperature=0.0)), tag="after"))
        assert c.wait("after", 60)[-1].reason in ("length", "eos", "stop")
    finally:
        runner.close()
