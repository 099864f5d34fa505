"""The Ollama API: the official `ollama` client and raw HTTP, against a real daemon on a
real port with real llama.cpp (and the fake hub for pulls)."""

from __future__ import annotations

import datetime as dt
import http.client
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest
from daemonhelp import daemon_process, readme_block, wait_until
from fakehub import FakeHub
from httphelp import (
    EventReader,
    audit,
    blocker,
    drop_mid_stream,
    fleet_http,
    fuzzed_daemon,
    hostport,
    ollama_client,
    raw,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everycycle import __version__, paths
from everycycle.client import SyncClient
from everycycle.daemon.http import ollama_request
from everycycle.daemon.http.ollama import _Shape
from everycycle.daemon.keys import load_or_create_token
from everycycle.protocol import Role, ToolCall

COMMIT = "0123456789abcdef0123456789abcdef01234567"
HI = [{"role": "user", "content": "hello"}]
GREEDY = {"temperature": 0, "seed": 7, "num_predict": 8}


@pytest.fixture
def client(url: str) -> Iterator[ollama.Client]:
    with ollama_client(url, timeout=60) as c:
        yield c


def lines(data: bytes) -> list[dict[str, object]]:
    return [json.loads(x) for x in data.splitlines()]


# ----------------------------------------------------------------- the ollama client


def test_chat_streamed_reassembles_to_the_whole_answer(client: ollama.Client) -> None:
    whole = client.chat(model="tiny", messages=HI, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.model == "tiny"
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count == 8 and whole.prompt_eval_count
    assert whole.total_duration and whole.total_duration >= (whole.eval_duration or 0) > 0
    assert whole.created_at and dt.datetime.fromisoformat(whole.created_at)
    record = audit()[-1]
    assert record["output_tokens"] == 8 and record["prompt_tokens"] == whole.prompt_eval_count
    parts = list(client.chat(model="tiny:latest", messages=HI, options=GREEDY, stream=True))
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].model == "tiny:latest" and parts[-1].eval_count == 8
    assert "".join(p.message.content or "" for p in parts) == whole.message.content


def test_generate_raw_system_stop_and_streaming(client: ollama.Client) -> None:
    whole = client.generate(model="tiny", prompt="abc", raw=True, options=GREEDY)
    text = whole.response or ""
    assert len(text) > 2 and whole.done_reason == "length"
    streamed = "".join(p.response or "" for p in client.generate(
        model="tiny", prompt="abc", raw=True, options=GREEDY, stream=True))
    assert streamed == text
    cut = client.generate(model="tiny", prompt="abc", raw=True,
                          options={**GREEDY, "stop": [text[2:4]]})
    assert cut.response == text[:text.index(text[2:4])] and cut.done_reason == "stop"
    templated = client.generate(model="tiny", prompt="abc", system="be brief", options=GREEDY)
    assert templated.done and templated.prompt_eval_count != whole.prompt_eval_count
    shaped = client.generate(model="tiny", prompt="x", format="json",
                             options={"temperature": 0, "num_predict": 40})
    assert shaped.response is not None and shaped.response.lstrip().startswith("{")


def test_embed_and_the_legacy_embeddings(client: ollama.Client) -> None:
    with SyncClient() as c:
        direct = c.embed("tiny", ["hello world", "the world"])
    got = client.embed(model="tiny", input=["hello world", "the world"])
    assert got.model == "tiny" and len(got.embeddings) == 2
    assert max(abs(a - b) for a, b in zip(got.embeddings[0], direct[0], strict=True)) < 1e-6
    assert got.prompt_eval_count and got.total_duration
    one = client.embeddings(model="tiny:latest", prompt="hello world")
    assert max(abs(a - b) for a, b in zip(one.embedding, direct[0], strict=True)) < 1e-6


def test_list_ps_show_and_version(url: str, client: ollama.Client, tiny_gguf: Path) -> None:
    listed = client.list().models
    assert [m.model for m in listed] == ["tiny:latest", "tiny4:latest", "missing:latest"]
    tiny = listed[0]
    assert tiny.size == tiny_gguf.stat().st_size and tiny.details is not None
    assert tiny.details.format == "gguf" and tiny.details.family == "llama"
    assert listed[2].size == 0  # not on disk
    assert client.ps().models == []
    client.generate(model="tiny4", prompt="x", options={"num_predict": 1}, keep_alive="10m")
    (loaded,) = client.ps().models
    assert loaded.model == "tiny4:latest" and loaded.size and loaded.size_vram == 0
    assert loaded.context_length == 512 and loaded.expires_at is not None
    left = loaded.expires_at - dt.datetime.now(dt.UTC)
    assert dt.timedelta(minutes=9) < left <= dt.timedelta(minutes=10)
    shown = client.show("tiny")
    assert shown.modelinfo and shown.modelinfo["general.architecture"] == "llama"
    assert shown.details is not None and shown.details.format == "gguf"
    assert shown.parameters and "num_ctx 8192" in shown.parameters
    assert shown.capabilities and "completion" in shown.capabilities
    assert json.loads(raw(url, "GET", "/api/version")[2]) == {"version": __version__}
    assert raw(url, "GET", "/")[2] == b"Ollama is running"
    assert raw(url, "HEAD", "/")[0] == 200


def test_load_and_unload_without_a_prompt(client: ollama.Client) -> None:
    loaded = client.generate(model="tiny4", keep_alive=-1)
    assert loaded.done and loaded.done_reason == "load"
    (model,) = client.ps().models
    assert model.expires_at is not None and model.expires_at.year == 2318
    gone = client.chat(model="tiny4", messages=[], keep_alive=0)
    assert gone.done_reason == "unload" and client.ps().models == []


def test_errors_are_ollama_shaped(url: str, client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError, match="model 'nope' not found") as info:
        client.chat(model="nope", messages=HI)
    assert info.value.status_code == 404
    with pytest.raises(ollama.ResponseError, match="more than model 'tiny4' was trained "
                       r"for \(16,384\)") as info:
        client.generate(model="tiny4", prompt="x", options={"num_ctx": 32768})
    assert info.value.status_code == 400
    client.generate(model="tiny4", prompt="x", options={"num_ctx": 512, "num_predict": 1,
                                                        "num_thread": 3})
    with pytest.raises(ollama.ResponseError, match="keep_alive"):
        client.generate(model="tiny", prompt="x", keep_alive="soon")
    with pytest.raises(ollama.ResponseError, match="template"):
        client.generate(model="tiny", prompt="x", template="{{ .Prompt }}")
    for path, method in (("/api/nowhere", "GET"), ("/api/chat", "GET"),
                         ("/api/chat", "POST")):
        status, _, data = raw(url, method, path, b"{bad")
        assert status in (400, 404, 405) and set(json.loads(data)) == {"error"}
    status, headers, data = raw(url, "POST", "/api/generate", json.dumps(
        {"model": "tiny", "prompt": "x", "options": {"num_predict": 8000, "temperature": 1}}
    ).encode(), {"x-deadline-ms": "300", "x-request-id": "olla-1"})
    assert headers["x-request-id"] == "olla-1"
    assert json.loads(data.splitlines()[-1]) == {"error": "deadline of 300 ms passed"}


def test_a_queued_request_shows_its_position(url: str, models_file: Path) -> None:
    proc = blocker(models_file)
    try:
        body = json.dumps({"model": "tiny", "messages": HI, "options": {"num_predict": 2}})
        conn = http.client.HTTPConnection(*hostport(url), timeout=60)
        conn.request("POST", "/api/chat", body=body)
        resp = conn.getresponse()
        assert resp.getheader("content-type") == "application/x-ndjson"
        first = json.loads(resp.readline())
        assert first["queue_position"] == 1 and first["done"] is False
        assert first["message"] == {"role": "assistant", "content": ""}
        with SyncClient() as c:
            c.cancel(resp.getheader("x-request-id") or "")
        rest = resp.read()
        conn.close()
        assert json.loads(rest.splitlines()[-1])["error"].startswith("cancelled")
    finally:
        proc.kill()
        proc.communicate()


def test_a_client_disconnect_frees_the_slot(url: str) -> None:
    drop_mid_stream(url, "/api/generate", {"model": "tiny", "prompt": "x",
                                           "options": {"num_predict": 8000, "temperature": 1}},
                    content_type=None)  # as curl -d sends it, without one


# ----------------------------------------------------------------- pull and delete


@pytest.fixture
def hub_url(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
            ) -> Iterator[str]:
    """A daemon whose hub is the fake one, with a registry entry for its tiny.gguf."""
    import hashlib

    fake = FakeHub()
    fake.add("acme/tiny", COMMIT, "tiny.gguf", tiny_gguf.read_bytes())
    fake.add("acme/big", COMMIT, "big.gguf", os.urandom(3 << 20))
    fake.add("acme/huge", COMMIT, "huge.gguf", os.urandom(24 << 20))
    fake.start()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    models = tmp_path / "hub.toml"
    models.write_text(
        '[models.hubtiny]\nhf_repo = "acme/tiny"\nhf_file = "tiny.gguf"\n'
        f'revision = "{COMMIT}"\nsha256 = "{hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()}"'
        "\ncontext = 256\nparallel = 1\n")
    with daemon_process("--models", str(models), "--http", "127.0.0.1:0"):
        yield fleet_http()
    fake.stop()


def test_pull_from_the_hub_with_progress(hub_url: str) -> None:
    seen = EventReader(f"{hub_url}/v1/events?types=pull")
    try:
        with ollama_client(hub_url, timeout=60) as client:
            pulls(client, hub_url)
        # The daemon's event stream told each pull as it went: its progress, its end.
        huge = f"hf://acme/huge/huge.gguf@{COMMIT}"
        wait_until(lambda: seen.of("pull", model=huge, status="done"), "the last pull")
        tiny = seen.of("pull", model="hubtiny")
        assert tiny[0]["status"] == "pulling" and tiny[-1]["status"] == "done"
        assert tiny[-1]["completed"] == tiny[-1]["total"] > 0
        assert {e["status"] for e in seen.of("pull")} <= {"pulling", "done", "failed"}
    finally:
        seen.close()


def pulls(client: ollama.Client, url: str) -> None:
    assert client.list().models[0].size == 0
    parts = list(client.pull("hubtiny", stream=True))
    assert parts[0].status == "pulling manifest" and parts[-1].status == "success"
    progress = [p for p in parts if p.completed is not None]
    assert progress and progress[-1].completed == progress[-1].total
    assert all(p.digest and p.digest.startswith("sha256:") for p in progress)
    assert client.list().models[0].size == progress[-1].total
    assert client.generate(model="hubtiny", prompt="x", options={"num_predict": 2}).done
    big = list(client.pull(f"hf://acme/big/big.gguf@{COMMIT}", stream=True))
    sizes = [p.completed for p in big if p.completed is not None]
    assert sizes[-1] == 3 << 20 and big[-1].status == "success"
    assert client.pull(f"hf://acme/big/big.gguf@{COMMIT}").status == "success"  # cached
    assert client.pull("hf://acme/tiny").status == "success"  # by quantization: its one GGUF
    with pytest.raises(ollama.ResponseError, match="has no Q8_0 GGUF") as info:
        client.pull("hf://acme/tiny:Q8_0")
    assert info.value.status_code == 400
    gone = socket.create_connection(hostport(url))
    body = json.dumps({"model": f"hf://acme/huge/huge.gguf@{COMMIT}"}).encode()
    gone.sendall(b"POST /api/pull HTTP/1.1\r\nHost: localhost\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert gone.recv(4096).startswith(b"HTTP/1.1 200")
    gone.close()  # a client gone mid-pull: the next pull resumes or finds it
    assert client.pull(f"hf://acme/huge/huge.gguf@{COMMIT}").status == "success"
    with pytest.raises(ollama.ResponseError, match="no such file") as info:
        client.pull("hf://acme/tiny/other.gguf")
    assert info.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="not found") as info:
        client.pull("nothing-by-this-name")
    assert info.value.status_code == 404


def test_delete_needs_the_daemon_token(tiny_gguf: Path) -> None:
    paths.user_models_file().parent.mkdir(parents=True, exist_ok=True)
    paths.user_models_file().write_text(f'[models.mine]\npath = "{tiny_gguf}"\n'
                                        f'[models.keep]\npath = "{tiny_gguf}"\n')
    token = {"authorization": f"Bearer {load_or_create_token()}"}
    with (daemon_process("--http", "127.0.0.1:0"),  # the shipped registry and the user's
          ollama_client(fleet_http()) as anyone,
          ollama.Client(host=fleet_http(), headers={"authorization": "Bearer no"}) as wrong,
          ollama.Client(host=fleet_http(), headers=token) as owner):
        with pytest.raises(ollama.ResponseError, match="--show-token") as info:
            anyone.delete("mine")
        assert info.value.status_code == 401
        with pytest.raises(ollama.ResponseError) as info:
            wrong.delete("mine")
        assert info.value.status_code == 403
        owner.generate(model="mine", prompt="x", options={"num_predict": 1})
        assert owner.delete("mine:latest").status == "success"
        names = [m.model for m in owner.list().models]
        assert "mine:latest" not in names and "keep:latest" in names
        assert "mine" not in paths.user_models_file().read_text()
        assert owner.ps().models == []  # unloaded first
        with pytest.raises(ollama.ResponseError, match="not in your models.toml") as info:
            owner.delete(names[0] if names[0] != "keep:latest" else names[1])
        assert info.value.status_code == 400


# ----------------------------------------------------------------- shapes, parsing, fuzz


def test_tool_calls_are_shaped_as_ollama_does() -> None:
    calls = (ToolCall("call_1", "add", '{"a": 1}'),)
    line = _Shape(chat=True, model="m").line("", calls=calls)
    assert line["message"]["tool_calls"] == [
        {"id": "call_1", "function": {"name": "add", "arguments": {"a": 1}}}]
    history = ollama_request.messages([
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "other", "arguments": {}}},
            {"function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "2", "tool_name": "add"},
        {"role": "tool", "content": "x"}])
    assert [m.role for m in history] == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.TOOL]
    assert history[1].tool_calls is not None
    assert history[1].tool_calls[1].arguments == '{"a": 1}'
    assert history[2].tool_call_id == "call_1_1" and history[3].tool_call_id == "call_1_0"
    assert ollama_request.keep_alive({"keep_alive": "5m"}) == {"keep_alive_ms": 300_000}
    assert ollama_request.keep_alive({"keep_alive": -1}) == {"keep_alive_ms": -1}
    assert ollama_request.keep_alive({"keep_alive": 0}) == {"keep_alive_ms": 0}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.sampled_from(["tiny", "tiny:latest", "json", "hf://a/b/c.gguf", "5m"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["model", "messages", "prompt", "role", "content", "options",
                         "num_predict", "stream", "stop", "format", "keep_alive", "raw",
                         "system", "think", "tools", "tool_calls", "function", "input",
                         "num_ctx", "seed", "images", "name", "temperature"])
        | st.text(max_size=8), inner, max_size=6),
    max_leaves=14,
)
ROUTES = [("POST", p) for p in ("/api/chat", "/api/generate", "/api/embed",
                                "/api/embeddings", "/api/show", "/api/pull")] + [
    ("DELETE", "/api/delete"), ("GET", "/api/tags"), ("GET", "/api/ps")]


@settings(max_examples=int(os.environ.get("EVERYCYCLE_FUZZ_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES),
       body=json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=200))
def test_random_bodies_never_cost_a_500(fuzz_url: str, route: tuple[str, str],
                                        body: bytes) -> None:
    status, _, data = raw(fuzz_url, route[0], route[1], body, {"x-deadline-ms": "2000"})
    assert status in (200, 400, 401, 404, 413, 499), (status, data)
    if status != 200:
        assert isinstance(json.loads(data)["error"], str)


@pytest.fixture(scope="module")
def fuzz_url(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[str]:
    with fuzzed_daemon(tmp_path_factory.mktemp("oz"), tiny_gguf) as url:
        yield url


def _readme_block(lang: str) -> str:
    return readme_block('## The Ollama API', lang, 'docs/http.md')


def test_the_readme_examples_run(url: str) -> None:
    import shlex
    import shutil
    import subprocess
    import sys

    code = (_readme_block("python").replace("http://127.0.0.1:11777", url)
            .replace('"smollm2-135m"', '"tiny"').replace('{"temperature": 0}',
                                                         '{"temperature": 0, "num_predict": 5}'))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    if shutil.which("curl") is None:
        return
    line = next(x for x in _readme_block("").splitlines() if x.startswith("$ curl"))
    cmd = (line[2:].replace("http://127.0.0.1:11777", url)
           .replace('"temperature": 0', '"temperature": 0, "num_predict": 3')
           .replace('"smollm2-135m"', '"tiny"'))
    out = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0 and json.loads(out.stdout)["done"] is True


def test_options_take_ollamas_sampling_parameters(client: ollama.Client) -> None:
    plain = client.generate(model="tiny", prompt="the", raw=True, options={**GREEDY,
                                                                          "num_predict": 32})
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"repeat_penalty": 5.0, "repeat_last_n": 64}):
        other = client.generate(model="tiny", prompt="the", raw=True,
                                options={**GREEDY, "num_predict": 32, **extra})
        assert other.response != plain.response, extra
    same = client.generate(model="tiny", prompt="the", raw=True,
                           options={**GREEDY, "num_predict": 32, "repeat_penalty": 5.0,
                                    "repeat_last_n": 0})
    assert same.response == plain.response
    with pytest.raises(ollama.ResponseError, match="options.mirostat must be an integer"):
        client.generate(model="tiny", prompt="the", options={"mirostat": "two"})


def test_delete_of_a_download_removes_its_files_unless_another_model_uses_them(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As Ollama's delete: the model and its files (the CLI's `rm --purge`, one service)."""
    import hashlib

    from everycycle.models.registry import hub_files, load_registry

    fake = FakeHub()
    fake.add("acme/tiny", COMMIT, "tiny.gguf", tiny_gguf.read_bytes())
    fake.start()
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    entry = ('hf_repo = "acme/tiny"\nhf_file = "tiny.gguf"\n'
             f'revision = "{COMMIT}"\nsha256 = "{hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()}"'
             "\ncontext = 256\nparallel = 1\n")
    paths.user_models_file().parent.mkdir(parents=True, exist_ok=True)
    paths.user_models_file().write_text(f"[models.one]\n{entry}[models.two]\n{entry}")
    token = {"authorization": f"Bearer {load_or_create_token()}"}
    try:
        with (daemon_process("--http", "127.0.0.1:0"),
              ollama.Client(host=fleet_http(), headers=token, timeout=60) as owner):
            assert owner.pull("one").status == "success"
            (cached,) = hub_files(load_registry().get("one"))
            assert owner.delete("one").status == "success"
            assert cached.exists()  # "two" uses it
            assert owner.delete("two:latest").status == "success"
            assert not cached.exists()
            assert {m.model for m in owner.list().models}.isdisjoint({"one:latest",
                                                                      "two:latest"})
    finally:
        fake.stop()
