"""The OpenAI-compatible HTTP API: the official `openai` client (sync and async) and raw
HTTP, against a real daemon on a real port with real llama.cpp."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, readme_block, running_daemon
from httphelp import (
    audit,
    blocker,
    drop_mid_stream,
    fleet_http,
    fuzzed_daemon,
    hostport,
    openai_client,
    raw,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from everycycle.cli.daemon import parse_http_address
from everycycle.client import SyncClient
from everycycle.daemon.keys import load_or_create_token
from everycycle.protocol import Format, Tokens


@pytest.fixture
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai_client(url, "unused", timeout=60) as c:
        yield c


# ----------------------------------------------------------------- the openai client


def test_chat_completion_with_usage(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hello"}],
        max_tokens=5, temperature=0)
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop")
    record = audit()[-1]
    assert r.id == record["request_id"]
    assert r.usage is not None
    assert r.usage.completion_tokens == record["output_tokens"] == 5
    assert r.usage.prompt_tokens == record["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_chat_completion(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
        temperature=0)
    assert text == whole.choices[0].message.content  # greedy: the same either way


def test_completions_stop_strings_and_the_default_model(client: openai.OpenAI) -> None:
    full = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and len(text) > 2
    cut = client.completions.create(model="tiny", prompt="abc", max_tokens=12, temperature=0,
                                    stop=[text[2:4]])
    assert cut.choices[0].text == text[:text.index(text[2:4])]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="abc", max_tokens=12, temperature=0, stream=True))
    assert streamed == text
    default = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert default.model == "tiny"


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny", "tiny4", "missing"]
    client.chat.completions.create(model="tiny4", messages=[{"role": "user", "content": "x"}],
                                   max_tokens=1)
    model = client.models.retrieve("tiny4")
    assert model.id == "tiny4" and model.model_extra == {
        "revision": None, "loaded": True, "executor": "cpu", "default": False,
        "context_length": 512, "max_model_len": 512, "max_context_length": 512}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="model 'nope' not found"):
        client.chat.completions.create(model="nope",
                                       messages=[{"role": "user", "content": "x"}])


def test_bad_requests_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="more than model 'tiny' has slots"):
        client.chat.completions.create(model="tiny", n=2,
                                       messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="role must be"):
        client.chat.completions.create(model="tiny",
                                       messages=[{"role": "robot", "content": "x"}])  # type: ignore[misc,list-item]
    with pytest.raises(openai.BadRequestError, match="non-empty"):
        client.chat.completions.create(model="tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="max_tokens must be between"):
        client.chat.completions.create(model="tiny", max_tokens=0,
                                       messages=[{"role": "user", "content": "x"}])


def test_a_full_queue_is_a_rate_limit(
    request: pytest.FixtureRequest, spawn_daemon: SpawnDaemon, models_file: Path,
) -> None:
    spawn_daemon("--http", "127.0.0.1:0", "--max-queue", "0")
    client = openai_client(fleet_http(), "x")
    request.addfinalizer(client.close)
    proc = blocker(models_file)
    try:
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="tiny", max_tokens=2,
                                           messages=[{"role": "user", "content": "x"}])
        assert info.value.response.headers["retry-after"] == "1"
    finally:
        proc.kill()
        proc.communicate()


def test_the_token_is_required_when_configured(
    request: pytest.FixtureRequest, spawn_daemon: SpawnDaemon,
) -> None:
    spawn_daemon("--http", "127.0.0.1:0", "--http-auth")
    url = fleet_http()
    wrong = openai_client(url, "wrong")
    request.addfinalizer(wrong.close)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    right = openai_client(url, load_or_create_token())
    request.addfinalizer(right.close)
    assert next(m.id for m in right.models.list()) == "tiny"
    assert raw(url, "GET", "/health")[0] == 200  # health stays open for probes


def test_a_non_loopback_address_needs_allow_remote(models_file: Path) -> None:
    out = subprocess.run([*EC, "daemon", "--models", str(models_file), "--http", "0.0.0.0:0"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "--allow-remote" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.anyio
async def test_the_async_client_in_process(models_file: Path) -> None:
    async with running_daemon(models_file, http=("127.0.0.1", 0)) as daemon:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{daemon.http_port}/v1",
                                    api_key="x", max_retries=0)
        whole = await client.chat.completions.create(
            model="tiny4", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0)
        stream = await client.chat.completions.create(
            model="tiny4", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        assert text == whole.choices[0].message.content
        await client.close()


# ----------------------------------------------------------------- raw HTTP


def test_sse_framing_byte_for_byte(url: str) -> None:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 3, "temperature": 0, "stream": True}).encode()
    status, headers, data = raw(url, "POST", "/v1/chat/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    rid = headers["x-request-id"]
    assert data.endswith(b"data: [DONE]\n\n")
    events = data.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") and b"\n" not in e for e in events[:-2])
    assert all(c["id"] == rid and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "length"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_a_queued_stream_gets_its_position_as_comments(url: str, busy: object) -> None:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 2, "stream": True}).encode()
    conn = http.client.HTTPConnection(*hostport(url), timeout=60)
    with contextlib.closing(conn):  # (closed on a failed assertion too)
        conn.request("POST", "/v1/chat/completions", body=body)
        resp = conn.getresponse()
        first = resp.readline() + resp.readline()
        assert re.fullmatch(rb": queue_position 1 eta_ms [1-9][0-9]*\n\n", first), first
        rid = resp.getheader("x-request-id")
        with SyncClient() as c:
            c.cancel(rid)  # cancel by the id from the header, as `everycycle cancel` does
        rest = resp.read()
    error = json.loads(rest.strip().removeprefix(b"data: "))
    assert error["error"]["code"] == "Cancelled" and b"[DONE]" not in rest


def test_a_client_disconnect_frees_the_slot(url: str) -> None:
    drop_mid_stream(url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 8000,
                                             "temperature": 1, "stream": True})


def test_a_deadline_header_and_a_chosen_request_id(url: str) -> None:
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 8000,
                       "temperature": 1}).encode()
    status, headers, data = raw(url, "POST", "/v1/completions", body,
                                {"x-deadline-ms": "300", "x-request-id": "mine-1"})
    assert status == 499 and headers["x-request-id"] == "mine-1"
    assert json.loads(data)["error"]["message"] == "deadline of 300 ms passed"


def test_malformed_and_oversized_bodies(url: str) -> None:
    assert raw(url, "POST", "/v1/chat/completions", b"{not json")[0] == 400
    assert raw(url, "POST", "/v1/chat/completions", b"[1, 2]")[0] == 400
    status, _, data = raw(url, "POST", "/v1/completions", b"x" * (9 << 20))
    assert status == 413 and json.loads(data)["error"]["code"] == "too_large"
    assert raw(url, "GET", "/v1/nowhere")[0] == 404
    assert raw(url, "GET", "/v1/chat/completions")[0] == 405


def test_metrics_agree_with_the_fleet(url: str, busy: object) -> None:
    status, headers, data = raw(url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = data.decode()
    with SyncClient() as c:
        snap = c.describe_fleet()
    (tiny,) = [m for m in snap.loaded_models if m.name == "tiny"]
    assert f'everycycle_busy_slots{{model="tiny"}} {float(tiny.busy or 0)}' in text
    assert f'everycycle_slots{{model="tiny"}} {float(tiny.slots or 0)}' in text
    assert f"everycycle_active_requests {float(snap.active_requests)}" in text
    assert 'everycycle_loaded_models{executor="cpu"} 1.0' in text


def test_metrics_count_requests_and_tokens(url: str, client: openai.OpenAI) -> None:
    client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="abc")
    with SyncClient() as c:
        events = list(c.generate("nope-too", "x"))  # the socket counts too: one daemon
    assert events
    text = raw(url, "GET", "/metrics")[2].decode()
    assert 'everycycle_requests_total{model="tiny",outcome="finished"} 1.0' in text
    assert 'everycycle_requests_total{model="_unknown",outcome="invalid"} 1.0' in text
    assert 'everycycle_generated_tokens_total{model="tiny"} 4.0' in text
    assert 'everycycle_time_to_first_token_seconds_count{model="tiny"} 1.0' in text


def test_fleet_shows_the_http_address(url: str) -> None:
    out = subprocess.run([*EC, "fleet"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert f"HTTP API: {url}/v1" in out.stderr + out.stdout


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["model", "messages", "prompt", "role", "content", "max_tokens",
                         "stream", "stop", "n", "temperature", "seed", "top_p", "type",
                         "text", "stream_options", "include_usage", "tools", "tool_choice",
                         "function", "name", "parameters", "tool_calls", "tool_call_id",
                         "logprobs", "top_logprobs", "system", "input", "instructions",
                         "max_output_tokens", "stop_sequences", "input_schema", "thinking",
                         "reasoning_effort", "grammar"]) | st.text(max_size=8),
        inner, max_size=6),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                             "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"]),
       body=json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=200))
def test_random_bodies_never_cost_a_500(fuzz_url: str, path: str, body: bytes) -> None:
    status, _, data = raw(fuzz_url, "POST", path, body,
                          {"x-deadline-ms": "2000", "content-type": "application/json"})
    assert status in (200, 400, 404, 413, 499), (status, data)
    if status != 200:
        assert "message" in json.loads(data)["error"]


@pytest.fixture(scope="module")
def fuzz_url(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Iterator[str]:
    with fuzzed_daemon(tmp_path_factory.mktemp("hz"), tiny_gguf) as url:
        yield url


def test_http_addresses_parse() -> None:
    assert parse_http_address("8081") == ("127.0.0.1", 8081)
    assert parse_http_address("localhost") == ("localhost", 11777)
    assert parse_http_address("0.0.0.0:9") == ("0.0.0.0", 9)
    assert parse_http_address("[::1]:7") == ("::1", 7)
    for bad in ("a:b", "1:2:3", "99999"):
        with pytest.raises(ValueError):
            parse_http_address(bad)


def _readme_block(lang: str) -> str:
    return readme_block('## Use it from any OpenAI client', lang, 'docs/http.md')


def test_the_readme_python_snippet_runs(url: str) -> None:
    code = (_readme_block("python").replace("http://127.0.0.1:11777", url)
            .replace('"smollm2-135m"', '"tiny"').replace("stream=True,",
                                                         "stream=True, max_tokens=5,"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


def test_the_readme_curl_command_runs(url: str) -> None:
    import shlex
    import shutil

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    line = next(x for x in _readme_block("").splitlines() if x.startswith("$ curl"))
    cmd = (line[2:].replace("http://127.0.0.1:11777", url)
           .replace('"smollm2-135m"', '"tiny", "max_tokens": 3'))
    out = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0 and json.loads(out.stdout)["object"] == "chat.completion"


def test_logprobs_sum_to_at_most_one_and_greedy_takes_the_top_one(
        client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny4", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
    assert content is not None and len(content) == r.usage.completion_tokens  # type: ignore[union-attr]
    for entry in content:
        top = entry.top_logprobs
        assert len(top) == 5
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert sum(math.exp(t.logprob) for t in top) <= 1.0 + 1e-6
        assert entry.token == top[0].token and entry.logprob == pytest.approx(top[0].logprob)
        assert entry.bytes == list(entry.token.encode())
    # Streamed, the same entries; a completion's legacy lists, the same numbers.
    streamed = [e for chunk in client.chat.completions.create(
        model="tiny4", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=5, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content or []]
    # (The second request reuses the first one's cached prompt: a prefix decoded in
    # another batch, so its logits may differ in the last bits.)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=1e-4)
    text = client.completions.create(model="tiny4", prompt="hi", max_tokens=4, temperature=0,
                                     logprobs=3)
    legacy = text.choices[0].logprobs
    assert legacy is not None and len(legacy.tokens or []) == 4
    assert all(len(t) <= 3 for t in legacy.top_logprobs or [])


def test_n_choices_are_distinct_sampled_and_identical_greedy(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "tell me"}]
    sampled = client.chat.completions.create(model="tiny4", messages=ask, n=3, max_tokens=12,
                                             temperature=1.0, seed=7)
    texts = [c.message.content for c in sampled.choices]
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert len(set(texts)) == 3, texts
    assert sampled.usage is not None and sampled.usage.completion_tokens == 36
    greedy = client.chat.completions.create(model="tiny4", messages=ask, n=3, max_tokens=12,
                                            temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="tiny4", messages=ask, n=3,
                                                max_tokens=12, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (
                choice.delta.content or "")
    assert streamed == dict.fromkeys(range(3), greedy.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="slots"):
        client.chat.completions.create(model="tiny4", messages=ask, n=5, max_tokens=2)


def test_penalties_logit_bias_and_llama_servers_samplers_reach_the_engine(
        client: openai.OpenAI) -> None:
    """OpenAI's sampling parameters (and llama-server's extensions, as extra fields)
    go through the table to llama.cpp's samplers: each changes a greedy answer."""
    def text(**kw: object) -> str:
        r = client.completions.create(model="tiny", prompt="the", max_tokens=32,
                                      temperature=0, **kw)  # type: ignore[call-overload]
        return str(r.choices[0].text)

    plain = text()
    with SyncClient() as c:  # (a completion's prompt is raw text)
        first = next(e.chunk.ids[0] for e in c.generate(
            "tiny", "the", max_tokens=1, temperature=0.0, format=Format.RAW)
            if isinstance(e, Tokens) and e.chunk.ids)
    assert text(logit_bias={str(first): -100}) != plain
    assert text(frequency_penalty=2.0) != plain
    assert text(presence_penalty=2.0) != plain
    assert text(extra_body={"dry_multiplier": 5.0, "dry_allowed_length": 1}) != plain
    assert text(extra_body={"xtc_probability": 1.0, "xtc_threshold": 0.01}) != plain
    for bad, says in (({"presence_penalty": 3}, "presence_penalty must be between -2 and 2"),
                      ({"logit_bias": {"7": "x"}}, r"logit_bias\[7\] must be a number"),
                      ({"logit_bias": {"999999": 1}}, "token 999999 is not in this model's")):
        with pytest.raises(openai.BadRequestError, match=says):
            client.completions.create(model="tiny", prompt="the", max_tokens=2,
                                      extra_body=bad)
