"""llama-server's native API and fill-in-the-middle in every dialect: a real daemon on a
real port, real llama.cpp on tiny GGUFs with FIM tokens (found by their text, and named
by the GGUF's keys), and the requests real editor clients send (``data/clients``,
recorded from their sources)."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SpawnDaemon
from httphelp import anthropic_client, fleet_http, ollama_client, openai_client, raw
from modelshelp import Entry, models_toml
from tinymodel import write_tiny_gguf

from everycycle.chatfmt.infill import Chunk, FimTokens, layout
from everycycle.daemon.keys import KeyLimits, KeyStore
from everycycle.errors import ConfigError
from everycycle.models.registry import load_registry

CLIENTS = Path(__file__).parent / "data" / "clients"


@pytest.fixture(scope="module")
def fim_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fim")
    return {"fim": write_tiny_gguf(d / "fim.gguf", fim="text"),
            "fimkeys": write_tiny_gguf(d / "fimkeys.gguf", fim="keys"),
            "ends": write_tiny_gguf(d / "ends.gguf", ends=True)}


@pytest.fixture
def url(spawn_daemon: SpawnDaemon, tmp_path: Path, tiny_gguf: Path,
        fim_models: dict[str, Path]) -> str:
    models = models_toml(
        tmp_path / "fim.toml",
        Entry("fim", fim_models["fim"], context=4096, parallel=3,
              more={"aliases": ["gpt-4.1", "qwen2.5-coder:1.5b"]}),
        Entry("fimkeys", fim_models["fimkeys"], context=1024, parallel=1),
        Entry("ends", fim_models["ends"], context=512, parallel=1),
        Entry("tiny", tiny_gguf, context=1024, parallel=1), default="fim")
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    return fleet_http()


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def post(http: httpx.Client, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def sse(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream's ``data:`` objects (and nothing else may come: no ``[DONE]``)."""
    r = http.post(path, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e and not e.startswith(":")]
    assert all(e.startswith("data: {") for e in events), events
    return [json.loads(e.removeprefix("data: ")) for e in events]


def plain(http: httpx.Client, text: str) -> list[int]:
    """``text``'s tokens as a FIM prompt tokenizes its parts: no BOS, no control tokens."""
    body = post(http, "/tokenize", {"content": text, "parse_special": False})
    return list(body["tokens"])


# ------------------------------------------------------------------ the layout, alone


def _chars(texts: Any) -> list[list[int]]:
    return [[ord(c) for c in t] for t in texts]


def test_the_layout_is_llama_servers_repo_level_pattern() -> None:
    fim = FimTokens(pre=1, suf=2, mid=3, pad=4, rep=5, sep=6)
    got = layout(fim, _chars, prefix="ab", suffix="cd", middle="x",
                 extra=[Chunk("f.py", "z")], bos=9, n_ctx=4096, n_predict=16)
    repo = _chars(["myproject\n", "f.py\n", "filename\n"])
    assert got == [5, *repo[0], 6, *repo[1], ord("z"), 6, *repo[2],
                   9, 1, ord("a"), ord("b"), ord("x"), 2, ord("c"), ord("d"), 3]
    # Without a file separator each chunk follows the snippet line; without a repo token
    # nothing names the project.
    bare = layout(FimTokens(pre=1, suf=2, mid=3), _chars, prefix="a", suffix="b",
                  extra=[Chunk("f", "z")], n_ctx=4096, n_predict=16)
    assert bare == [*_chars(["\n\n--- snippet ---\n\n"])[0], ord("z"), 1, ord("a"), 2, ord("b"), 3]


def test_the_layout_keeps_the_prefix_end_and_the_suffix_start() -> None:
    fim = FimTokens(pre=1, suf=2, mid=3)
    got = layout(fim, _chars, prefix="p" * 100 + "END", suffix="START" + "s" * 100,
                 middle="mm", n_ctx=64, n_predict=8, n_batch=40)
    # 3/4 of the batch for the prefix (its end), 1/4 less the middle and two for the suffix
    assert got[:2] == [1, ord("p")] and got[1:31] == _chars(["p" * 27 + "END"])[0]
    assert got[31:33] == [ord("m")] * 2 and got[33] == 2
    assert got[34:40] == _chars(["START" + "s"])[0] and got[40:] == [3]
    # extra chunks fill what the context leaves: their end, none here (64 - 40 - 16 = 8)
    kept = layout(fim, _chars, prefix="a", suffix="b", extra=[Chunk("f", "0123456789")],
                  n_ctx=64, n_predict=8, n_batch=40)
    assert kept[:9] == _chars(["23456789"])[0] + [1]


# ------------------------------------------------------------------ /infill and suffix


def test_infill_lays_the_prompt_out_with_the_models_fim_tokens(http: httpx.Client) -> None:
    body = {"input_prefix": "hello world", "input_suffix": " the end", "prompt": " a",
            "input_extra": [{"filename": "x.py", "text": "helloing"}],
            "n_predict": 4, "temperature": 0}
    got = post(http, "/infill", body)
    assert isinstance(got["content"], str) and got["stop"] is True
    assert got["tokens_predicted"] == 4 and got["stop_type"] == "limit"
    # [REP]myproject\n [SEP]x.py\n helloing [SEP]filename\n <s>[PRE]hello world a[SUF] the end[MID]
    rep, sep, pre, suf, mid = (post(http, "/tokenize", {"content": t})["tokens"][0]
                               for t in ("<|fim_repo|>", "<|file_sep|>", "<|fim_prefix|>",
                                         "<|fim_suffix|>", "<|fim_middle|>"))
    expected = [rep, *plain(http, "myproject\n"), sep, *plain(http, "x.py\n"),
                *plain(http, "helloing"), sep, *plain(http, "filename\n"), 1, pre,
                *plain(http, "hello world"), *plain(http, " a"), suf, *plain(http, " the end"),
                mid]
    assert got["tokens_evaluated"] == len(expected)
    timings = got["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == len(expected)
    assert timings["predicted_n"] == 4 and got["tokens_cached"] == len(expected) + 4


def test_fim_tokens_named_by_the_gguf_keys(http: httpx.Client) -> None:
    got = post(http, "/infill", {"model": "fimkeys", "input_prefix": "hello",
                                 "input_suffix": "world", "n_predict": 2})
    assert got["tokens_predicted"] == 2
    pre, suf, mid = (plain(http, t) for t in ("hello", "world", ""))
    assert got["tokens_evaluated"] == 1 + 1 + len(pre) + 1 + len(suf) + 1 + len(mid)


def test_a_model_without_fim_tokens_says_so_in_one_sentence(url: str, http: httpx.Client
                                                            ) -> None:
    r = http.post("/infill", json={"model": "tiny", "input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"
    assert r.json()["error"]["message"] == (
        "Infill is not supported by this model: prefix token is missing. suffix token is "
        "missing. middle token is missing.")
    with ollama_client(url) as ollama_api, pytest.raises(Exception) as refused:
        ollama_api.generate(model="tiny", prompt="def f(", suffix="    return 1\n")
    assert "model 'tiny' cannot fill in the middle: its vocabulary has no FIM prefix, " \
           "suffix, middle tokens" in str(refused.value)
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "a", "suffix": "b"})
    assert r.status_code == 400 and "cannot fill in the middle" in r.json()["error"]["message"]


def test_ollama_and_openai_suffix_fill_in_the_middle(url: str, http: httpx.Client) -> None:
    native = post(http, "/infill", {"input_prefix": "hello world", "input_suffix": " the",
                                    "n_predict": 3, "temperature": 0})
    with ollama_client(url) as ollama_api:
        r = ollama_api.generate(model="fim", prompt="hello world", suffix=" the",
                                options={"num_predict": 3, "temperature": 0})
    assert r.prompt_eval_count == native["tokens_evaluated"] and r.eval_count == 3
    with openai_client(url) as client:
        c = client.completions.create(model="fim", prompt="hello world", suffix=" the",
                                      max_tokens=3, temperature=0)
    assert c.usage is not None and c.usage.prompt_tokens == native["tokens_evaluated"]
    # (no suffix: a plain completion, which reads fewer tokens)
    with openai_client(url) as client:
        c = client.completions.create(model="fim", prompt="hello world", max_tokens=3)
    assert c.usage is not None and c.usage.prompt_tokens < native["tokens_evaluated"]


def test_ollama_show_says_a_fim_model_reads_suffix(url: str) -> None:
    """Continue's Ollama provider sends `suffix` only to a model whose /api/show template
    reads `.Suffix` (as Ollama's FIM models' templates do), and Ollama lists `insert`."""
    with ollama_client(url) as ollama_api:
        fim, keys, plain_model = (ollama_api.show(m) for m in ("fim", "fimkeys", "tiny"))
    assert fim.template is not None and fim.template.startswith(
        "{{- if .Suffix }}<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix }}"
        "<|fim_middle|>{{- else }}")
    assert fim.template.endswith("{{- end }}") and ".Suffix" in (fim.modelfile or "")
    assert keys.template is not None and ".Suffix" in keys.template
    assert "insert" in (fim.capabilities or []) and "insert" in (keys.capabilities or [])
    assert ".Suffix" not in (plain_model.template or "")
    assert "insert" not in (plain_model.capabilities or [])


def test_a_clients_own_fim_template_reads_as_control_tokens(url: str, http: httpx.Client
                                                            ) -> None:
    """Continue, Tabby and Twinny with an OpenAI provider send their own FIM template as a
    text prompt to /v1/completions; llama-server and vLLM read its control tokens' text
    as those tokens, and so do we."""
    text = "<|fim_prefix|>hello world<|fim_suffix|> the<|fim_middle|>"
    tokens = post(http, "/tokenize", {"content": text, "add_special": True,
                                      "parse_special": True})["tokens"]
    assert len(tokens) == 1 + 1 + len(plain(http, "hello world")) + 1 + len(
        plain(http, " the")) + 1
    with openai_client(url) as client:
        c = client.completions.create(model="fim", prompt=text, max_tokens=2)
    assert c.usage is not None and c.usage.prompt_tokens == len(tokens)


def test_keystrokes_reuse_the_last_requests_cells(http: httpx.Client) -> None:
    """An editor's pattern: each request repeats the last one's prefix, a few characters
    longer; its cells are kept, so only what is new is read."""
    prefix = "hello world the a hello"
    seen = []
    for i in range(5):
        got = post(http, "/infill", {"input_prefix": prefix + " world" * i,
                                     "input_suffix": " the end", "n_predict": 2,
                                     "input_extra": [{"filename": "a.py", "text": "hello"}]})
        seen.append(got["timings"])
    assert seen[0]["cache_n"] == 0
    for t in seen[1:]:
        assert t["cache_n"] > 10 and t["prompt_n"] < t["cache_n"]


# ------------------------------------------------------------------ /completion


def test_completion_prompts_of_text_token_ids_and_both(http: httpx.Client) -> None:
    ids = post(http, "/tokenize", {"content": "hello world", "add_special": True})["tokens"]
    assert ids[0] == 1  # BOS
    by_text = post(http, "/completion", {"prompt": "hello world", "n_predict": 3,
                                         "temperature": 0, "return_tokens": True})
    assert by_text["tokens_evaluated"] == len(ids) and len(by_text["tokens"]) == 3
    assert by_text["generation_settings"]["n_predict"] == 3 and by_text["model"] == "fim"
    by_ids = post(http, "/completion", {"prompt": ids, "n_predict": 3, "temperature": 0})
    assert by_ids["tokens_evaluated"] == len(ids)
    several = post(http, "/completion", {"prompt": [ids, "hello world"], "n_predict": 3,
                                         "temperature": 0})
    assert [s["index"] for s in several] == [0, 1]
    assert [s["tokens_evaluated"] for s in several] == [len(ids)] * 2
    mixed = post(http, "/completion", {"prompt": [1, "hello", 264, "world"], "n_predict": 2})
    assert mixed["tokens_evaluated"] == 2 + len(plain(http, "hello")) + len(plain(http, "world"))
    r = http.post("/completion", json={"prompt": [10**9], "n_predict": 2})
    assert r.status_code == 400 and "not in the model's vocabulary" in r.json()["error"]["message"]
    r = http.post("/completion", json={"prompt": {"x": 1}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_completion_streams_llama_servers_objects(http: httpx.Client) -> None:
    events = sse(http, "/completion", {"prompt": "hello", "n_predict": 4, "stream": True,
                                       "n_probs": 3, "temperature": 0})
    *parts, last = events
    assert all(p["stop"] is False and len(p["completion_probabilities"]) == 1 for p in parts)
    top = parts[0]["completion_probabilities"][0]
    assert top["id"] >= 0 and top["logprob"] <= 0 and len(top["top_logprobs"]) == 3
    assert all("id" in t and "bytes" in t for t in top["top_logprobs"])
    assert last["stop"] is True and last["stop_type"] == "limit"
    assert last["tokens_predicted"] == 4 == last["timings"]["predicted_n"]
    whole = post(http, "/completion", {"prompt": "hello", "n_predict": 4, "temperature": 0})
    assert "".join(p["content"] for p in parts) == whole["content"]  # greedy either way


def test_response_fields_warm_up_and_n_cmpl(http: httpx.Client) -> None:
    got = post(http, "/completion", {"prompt": "hello", "n_predict": 2, "response_fields": [
        "content", "generation_settings/n_predict", "timings/prompt_n", "nothere"]})
    assert set(got) == {"content", "generation_settings/n_predict", "timings/prompt_n"}
    assert got["generation_settings/n_predict"] == 2
    warm = post(http, "/completion", {"prompt": "hello world", "n_predict": 0})
    assert warm["content"] == "" and warm["tokens_predicted"] == 0
    three = post(http, "/completion", {"prompt": "hello", "n_predict": 2, "n_cmpl": 3})
    assert [c["index"] for c in three] == [0, 1, 2]
    r = http.post("/completion", json={"prompt": "hello", "n_cmpl": 4})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("Field 'n_cmpl': Value must be between")


def test_ignore_eos_in_every_dialect(url: str, http: httpx.Client) -> None:
    """The ``ends`` model ends every answer at once, unless told to ignore its end."""
    ended = post(http, "/completion", {"model": "ends", "prompt": "hello", "n_predict": 5})
    assert ended["tokens_predicted"] == 0 and ended["stop_type"] == "eos"
    kept = post(http, "/completion", {"model": "ends", "prompt": "hello", "n_predict": 5,
                                      "ignore_eos": True, "temperature": 0})
    assert kept["tokens_predicted"] == 5 and kept["stop_type"] == "limit"
    with openai_client(url) as client:
        c = client.chat.completions.create(
            model="ends", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            extra_body={"ignore_eos": True})
        assert c.usage is not None and c.usage.completion_tokens == 6
        assert c.choices[0].finish_reason == "length"
        plain_end = client.completions.create(model="ends", prompt="hi", max_tokens=6)
        assert plain_end.usage is not None and plain_end.usage.completion_tokens == 0


def test_errors_are_llama_servers_shape(http: httpx.Client) -> None:
    for extra in ({}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "a"}):
        r = http.post("/infill", json={"input_extra": [extra], "input_prefix": "a",
                                       "input_suffix": "b"})
        assert r.status_code == 400 and set(r.json()["error"]) == {"code", "message", "type"}
    r = http.post("/infill", json={"input_prefix": "a"})
    assert r.status_code == 400 and r.json()["error"]["message"] == '"input_suffix" is required'
    r = http.post("/completion", json={"model": "ends", "prompt": "hello " * 600})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == 512 and error["n_prompt_tokens"] > 512


# ------------------------------------------------------------------ the tokenizer, the server


def test_tokenize_and_detokenize(http: httpx.Client) -> None:
    content = "hello <start_of_turn> 媽"
    special = post(http, "/tokenize", {"content": content})["tokens"]
    literal = post(http, "/tokenize", {"content": content, "parse_special": False})["tokens"]
    assert len(literal) > len(special)  # the marker's text, read as text
    pieces = post(http, "/tokenize", {"content": content, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == special
    assert any(isinstance(p["piece"], list) for p in pieces)  # 媽's bytes, one at a time
    # (as llama-server: each token's piece, a control token's as its text; the
    # SentencePiece-style vocabulary's word-start spaces are the tokens')
    text = post(http, "/detokenize", {"tokens": special})["content"]
    assert "<start_of_turn>" in text and text.split() == content.split()
    round_trip = post(http, "/tokenize", {"content": "hello world 媽"})["tokens"]
    assert post(http, "/detokenize", {"tokens": round_trip})["content"].strip() == "hello world 媽"
    r = http.post("/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400


def test_apply_template_props_and_slots(url: str, http: httpx.Client) -> None:
    prompt = post(http, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]})
    assert "<start_of_turn>user\nhi<end_of_turn>" in prompt["prompt"]
    props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 4096
    assert props["total_slots"] == 3 and props["modalities"]["vision"] is False
    assert props["model_path"].endswith("fim.gguf") and "bos_token" in props["chat_template"]
    store = KeyStore()
    alice, bob = store.add("alice", KeyLimits()), store.add("bob", KeyLimits())
    as_alice, as_bob = ({"authorization": f"Bearer {k}"} for k in (alice, bob))
    with httpx.Client(base_url=url, timeout=120) as c:
        for _ in range(10):  # (the tiny model may finish before bob looks: again)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                done = pool.submit(c.post, "/completion", headers=as_alice, json={
                    "prompt": "a secret", "n_predict": 4000, "ignore_eos": True})
                mine = c.get("/slots", headers=as_alice).json()
                while not any(s["is_processing"] for s in mine) and not done.done():
                    mine = c.get("/slots", headers=as_alice).json()
                theirs = c.get("/slots", headers=as_bob).json()
                again = c.get("/slots", headers=as_alice).json()
            busy_then = [s["is_processing"] for s in mine]
            if any(busy_then) and busy_then == [s["is_processing"] for s in again]:
                break  # (still running after bob looked)
    assert [s["id"] for s in mine] == [0, 1, 2]
    busy = [s for s in mine if s["is_processing"]]
    assert len(busy) == 1 and busy[0]["prompt"].endswith("a secret") and busy[0]["n_prompt_tokens"] > 0
    assert [s["is_processing"] for s in theirs] == [s["is_processing"] for s in mine]
    assert all("prompt" not in s for s in theirs)


# ------------------------------------------------------------------ the other dialects


def test_openai_routes_without_v1_and_aliases(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="gpt-4.1", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.model == "gpt-4.1" and r.system_fingerprint is not None
    assert r.system_fingerprint.startswith("b")
    assert [m.id for m in client.models.list()][:1] == ["fim"]
    stream = client.chat.completions.create(model="fim", max_tokens=2, stream=True,
                                            messages=[{"role": "user", "content": "hi"}])
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content is None


def test_anthropic_message_start_counts_the_prompt(url: str) -> None:
    with anthropic_client(url) as client, client.messages.stream(
            model="fim", max_tokens=3, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens > 0
    assert start.message.usage.input_tokens == (final.usage.input_tokens
                                                + (final.usage.cache_read_input_tokens or 0))


def test_aliases_in_models_toml(tmp_path: Path, tiny_gguf: Path) -> None:
    ok = models_toml(tmp_path / "a.toml", Entry("a", tiny_gguf, more={"aliases": ["gpt-4o"]}),
                     Entry("b", tiny_gguf))
    registry = load_registry(ok)
    assert registry.get("gpt-4o").name == "a" and registry.has("gpt-4o")
    clash = models_toml(tmp_path / "b.toml",
                        Entry("a", tiny_gguf, more={"aliases": ["b"]}), Entry("b", tiny_gguf))
    with pytest.raises(ConfigError, match="aliases: 'b' already names model 'b'"):
        load_registry(clash)


# ------------------------------------------------------------------ real clients' requests

READS: dict[str, list[str]] = {
    "llama_vim_infill.json": ["content", "tokens_cached", "timings/prompt_n",
                              "timings/predicted_n", "timings/predicted_per_second"],
    "llama_vim_infill_speculative.json": ["content", "timings/prompt_n"],
    "llama_vim_warmup.json": [],
    "llama_vim_inst.json": [],
    "llama_vim_inst_warmup.json": [],
    "llama_vscode_infill.json": [],  # (n_cmpl 3: a list, each with content)
    "llama_vscode_warmup.json": [],
    "llama_vscode_tokenize.json": ["tokens"],
    "llama_vscode_props.json": ["default_generation_settings"],
    "llama_vscode_chat_edit.json": ["choices"],
    "continue_llamacpp_completion.json": [],
    "continue_ollama_fim.json": [],
    "continue_ollama_generate_raw.json": [],
    "mikupad_tokenize.json": ["tokens"],
    "mikupad_detokenize.json": ["content"],
    "mikupad_completion.json": [],
    "sillytavern_completion.json": ["content"],
    "sillytavern_tokenize.json": ["tokens"],
    "sillytavern_status_models.json": ["data"],
}


def _as_sent(case: dict[str, Any]) -> dict[str, Any] | None:
    """The recorded body, its model our FIM model's alias and its lengths cut short."""
    body = case.get("body")
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if body.get("model"):
        body["model"] = "qwen2.5-coder:1.5b"
    if "tokens" in body:  # (ids of the client's model: ours has fewer)
        body["tokens"] = [t % 270 for t in body["tokens"]]
    for key in ("n_predict", "max_tokens", "max_new_tokens"):
        if isinstance(body.get(key), int) and body[key] > 8:
            body[key] = 8
    if isinstance(body.get("options"), dict):
        body["options"] = {**body["options"], "num_predict": 8}
    return body


@pytest.mark.parametrize("name", sorted(READS))
def test_editor_clients_requests_are_answered_as_they_read_them(url: str, name: str) -> None:
    case = json.loads((CLIENTS / name).read_text())
    body = _as_sent(case)
    # (http.client, which sends llama.vim's "Authorization: Bearer " as it is)
    status, headers, raw_body = raw(url, case["method"], case["path"],
                                    json.dumps(body).encode() if body is not None else None,
                                    {"content-type": "application/json",
                                     **case.get("headers", {})})
    text = raw_body.decode()
    assert status == 200, text
    kind = headers["content-type"]
    if kind.startswith("text/event-stream"):  # Continue's, Mikupad's: data: objects
        data = [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n")
                if e.startswith("data: {")]
        assert data and all("error" not in d for d in data)
        if case["path"] == "/completion":
            assert data[-1]["stop"] is True and isinstance(data[0]["content"], str)
            if case["body"].get("post_sampling_probs"):  # Mikupad's top_probs
                probs = data[0]["completion_probabilities"][0]["top_probs"]
                assert all(0 < p["prob"] <= 1 and "token" in p for p in probs)
        return
    if kind.startswith("application/x-ndjson"):  # Ollama's
        lines = [json.loads(line) for line in text.splitlines() if line]
        assert lines[-1]["done"] is True and all("error" not in x for x in lines)
        return
    body = json.loads(text)
    if name == "llama_vscode_infill.json":  # n_cmpl: 3 answers
        assert isinstance(body, list) and len(body) == 3
        assert all(isinstance(x["content"], str) and "n_ctx" in x["generation_settings"]
                   and "prompt_per_second" in x["timings"] for x in body)
    if name == "llama_vim_infill.json":  # response_fields: flattened, compact JSON
        assert '"content":"' in text
    for key in READS[name]:
        assert key in body, (key, body)


# ------------------------------------------------------------------ code completion's limits


def test_a_completion_ends_with_its_block() -> None:
    from everycycle.engine.core.jobs import Job, JobSpec
    from everycycle.engine.core.slots import Run

    run = Run(Job(JobSpec(tokens=[1], max_tokens=10)))
    assert not run.ends_block("    x = 1", 4)  # (the first line is the cursor's)
    assert not run.ends_block("\n    y", 4) and not run.ends_block("\n\t\t\t\t", 4)
    assert not run.ends_block("z", 4)
    assert run.ends_block("\n  return", 4)  # a line less indented: the block is over
    fresh = Run(Job(JobSpec(tokens=[1], max_tokens=10)))
    assert not fresh.ends_block("a\n ", 2) and fresh.ends_block("b", 2) and fresh.new_line


def test_n_indent_and_t_max_predict_ms(http: httpx.Client) -> None:
    # (line breaks and spaces made likely: byte tokens 0x0A and 0x20)
    body = {"input_prefix": "hello", "input_suffix": "world", "n_predict": 300,
            "temperature": 1.0, "seed": 1, "logit_bias": [[13, 6.0], [35, 6.0]]}
    free = post(http, "/infill", body)
    assert "\n" in free["content"]
    fast = post(http, "/infill", {**body, "t_max_predict_ms": 1})
    # (a line break, then the time is up: it ends there, not at n_predict)
    assert "\n" in fast["content"] and fast["tokens_predicted"] < free["tokens_predicted"]
    assert fast["stop_type"] == "limit"
    blocked = post(http, "/infill", {**body, "n_indent": 3})
    lines = blocked["content"].split("\n")
    assert blocked["tokens_predicted"] < free["tokens_predicted"] and len(lines) > 1
    assert all(not line.strip() or len(line) - len(line.lstrip(" \t")) >= 3
               for line in lines[1:])


def test_post_sampling_probs_are_the_chains(http: httpx.Client, tiny_batches_exact: bool
                                           ) -> None:
    got = post(http, "/completion", {"prompt": "hello", "n_predict": 5, "n_probs": 10,
                                     "temperature": 1.0, "top_k": 4, "seed": 3,
                                     "post_sampling_probs": True})
    probs = got["completion_probabilities"]
    assert len(probs) == 5
    for tok in probs:
        top = tok["top_probs"]
        assert 1 <= len(top) <= 4  # (top_k 4: no other token could be chosen)
        assert sum(p["prob"] for p in top) == pytest.approx(1.0, abs=1e-4)
        assert tok["id"] in [p["id"] for p in top] and 0 < tok["prob"] <= 1
    # The same draws as without the report (the chain runs once a token either way),
    # where a reused prefix gives the same logits here (llama.cpp does not promise it).
    same = post(http, "/completion", {"prompt": "hello", "n_predict": 5, "temperature": 1.0,
                                      "top_k": 4, "seed": 3, "return_tokens": True})
    if tiny_batches_exact:
        assert [t["id"] for t in probs] == same["tokens"]


def test_samplers_choose_the_chain_and_its_order(http: httpx.Client) -> None:
    """llama-server's `samplers`: the chain is the samplers named, in that order (llama.vim
    and llama.vscode send ["top_k", "top_p", "infill"])."""
    def chain(samplers: object, **more: object) -> Any:
        return post(http, "/completion", {
            "prompt": "hello", "n_predict": 4, "n_probs": 40, "temperature": 1.0,
            "top_k": 3, "top_p": 1.0, "min_p": 0.0, "seed": 3, "post_sampling_probs": True,
            "samplers": samplers, **more})

    def widest(got: Any) -> int:
        return max(len(t["top_probs"]) for t in got["completion_probabilities"])

    only_k = chain(["top_k"])
    assert widest(only_k) <= 3
    assert only_k["generation_settings"]["samplers"] == ["top_k"]
    assert widest(chain(["top_p", "temperature"])) > 3  # (top_k is not in the chain)
    assert widest(chain("k")) <= 3  # (llama-server's letters)
    editor = post(http, "/infill", {"input_prefix": "def f(", "input_suffix": ")\n",
                                    "n_predict": 4, "samplers": ["top_k", "top_p", "infill"],
                                    "top_k": 40, "top_p": 0.99})
    assert editor["generation_settings"]["samplers"] == ["top_k", "top_p", "infill"]
    greedy = post(http, "/infill", {"input_prefix": "def f(", "input_suffix": ")\n",
                                    "n_predict": 4, "temperature": 0, "samplers": "i"})
    assert greedy["tokens_predicted"] >= 1
    # (a name llama-server does not know is left out, as it leaves it)
    got = post(http, "/completion", {"prompt": "a", "n_predict": 1,
                                     "samplers": ["top_k", "tfs_z", "temperature"]})
    assert got["generation_settings"]["samplers"] == ["top_k", "temperature"]


def test_ignore_eos_lists_the_end_tokens_it_bars(http: httpx.Client) -> None:
    got = post(http, "/completion", {"model": "ends", "prompt": "hi", "n_predict": 2,
                                     "ignore_eos": True})
    barred = got["generation_settings"]["logit_bias"]
    assert {"bias": None, "token": 2} in barred  # </s>, at -inf (null in JSON)
    free = post(http, "/completion", {"model": "ends", "prompt": "hi", "n_predict": 2})
    assert free["generation_settings"]["logit_bias"] == []


def test_the_readme_example_runs(url: str) -> None:
    import shlex
    import shutil
    import subprocess

    from daemonhelp import readme_block

    if shutil.which("curl") is None:
        pytest.skip("no curl here")
    block = readme_block("## llama-server's API, and editor completion", "", "docs/http.md")
    line = next(x for x in block.splitlines() if x.startswith("$ curl"))
    out = subprocess.run(shlex.split(line[2:].replace("http://127.0.0.1:11777", url)),
                         capture_output=True, text=True, timeout=60, check=False)
    tokens = json.loads(out.stdout)["tokens"]  # (the tiny model's vocabulary: other ids)
    assert out.returncode == 0 and tokens and all({"id", "piece"} <= set(t) for t in tokens)


def test_a_logit_bias_keyed_by_text(url: str, http: httpx.Client) -> None:
    """llama-server's rule: each token of the text gets the bias (``false``: banned)."""
    got = post(http, "/completion", {"prompt": "x", "n_predict": 6, "temperature": 0,
                                     "logit_bias": {"hello": 100}})
    ids = {b["token"] for b in got["generation_settings"]["logit_bias"]}
    assert ids == set(plain(http, "hello")) and set(got["content"]) <= set(" hello")
    with openai_client(url) as client:
        c = client.chat.completions.create(
            model="fim", messages=[{"role": "user", "content": "x"}], max_tokens=6,
            temperature=0, logit_bias={"hello": 100})  # type: ignore[dict-item]
    assert set(c.choices[0].message.content or "") <= set(" hello")
    r = http.post("/completion", json={"prompt": "x", "logit_bias": {"x": "much"}})
    assert r.status_code == 400


def test_chat_requests_llama_server_refuses(http: httpx.Client) -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    r = http.post("/chat/completions", json={"messages": turns, "max_tokens": 2,
                                             "add_generation_prompt": True,
                                             "continue_final_message": True})
    assert r.status_code == 400 and "mutually exclusive" in r.json()["error"]["message"]
    r = http.post("/chat/completions", json={"messages": [*turns, turns[1]], "max_tokens": 2})
    assert r.status_code == 400 and "2 or more assistant" in r.json()["error"]["message"]
    count = post(http, "/chat/completions/input_tokens", {"messages": turns[:1]})
    prompt = post(http, "/apply-template", {"messages": turns[:1]})["prompt"]
    assert count["input_tokens"] == len(post(http, "/tokenize", {
        "content": prompt, "add_special": True})["tokens"])


def test_verbose_shows_the_rendered_prompt(http: httpx.Client) -> None:
    turns = [{"role": "system", "content": "Book"}, {"role": "user", "content": "Hi"}]
    got = post(http, "/chat/completions", {"messages": turns, "max_tokens": 2,
                                           "verbose": True})
    assert "Book" in got["__verbose"]["prompt"] and "<start_of_turn>" in got["__verbose"]["prompt"]
    assert "__verbose" not in post(http, "/chat/completions", {"messages": turns,
                                                               "max_tokens": 2})


def test_responses_stream_with_llama_telemetry(http: httpx.Client) -> None:
    r = http.post("/responses", json={"input": "hello world the " * 40, "max_output_tokens": 4,
                                      "stream": True, "timings_per_token": True,
                                      "return_progress": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ")]
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress and progress[-1]["processed"] == progress[-1]["total"] > 0
    assert all(e["type"] == "response.in_progress" for e in events if "prompt_progress" in e)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e["timings"] for e in deltas)
    # (cut by max_output_tokens: OpenAI's response.incomplete, where llama-server says
    # response.completed)
    ended = events[-1]
    assert ended["type"] == "response.incomplete" and "usage" in ended["response"]
    assert ended["timings"]["predicted_n"] == 4


# ------------------------------------------------------------------ resumable streams


def test_a_stream_with_a_conversation_id_survives_its_client(url: str) -> None:
    """llama-server's web UI pattern: the page reloads mid-answer; the answer goes on and
    the page reads it again from the start (``GET /v1/stream``), or stops it."""
    conv = {"x-conversation-id": "conv-1::org/model:Q8_0"}
    body = {"model": "fim", "messages": [{"role": "user", "content": "hi"}],
            "stream": True, "max_tokens": 300, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, timeout=120) as c:
        with c.stream("POST", "/v1/chat/completions", json=body, headers=conv) as r:
            first = next(r.iter_lines())  # (then the client goes away)
        assert first.startswith("data: {")
        qs = {"conv_id": conv["x-conversation-id"]}
        replay = c.get("/v1/stream", params={**qs, "from": "0"})
        assert replay.status_code == 200
        assert replay.headers["content-type"].startswith("text/event-stream")
        events = [e for e in replay.text.split("\n\n") if e.startswith("data: ")]
        assert events[0] == first and events[-1] == "data: [DONE]"
        usage = json.loads(events[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 300  # (it went on to the end)
        later = c.get("/v1/stream", params={**qs, "from": str(len(first) + 2)}).text
        assert replay.text.endswith(later) and later.startswith("data: ")
        found = c.post("/v1/streams/lookup", json={"conversation_ids": ["conv-1"]}).json()
        assert [(s["conversation_id"], s["is_done"]) for s in found] == [
            (conv["x-conversation-id"], True)]
        assert found[0]["total_bytes"] == len(replay.content)
        assert c.get("/v1/stream", params={**qs, "from": "x"}).status_code == 400
        assert c.delete("/v1/stream", params=qs).status_code == 204
        assert c.get("/v1/stream", params={**qs, "from": "0"}).status_code == 404
        assert c.get("/v1/stream").status_code == 400
        # (any dialect's stream: Ollama's NDJSON comes back as NDJSON)
        c.post("/api/generate", json={"model": "fim", "prompt": "hi", "stream": True,
                                      "options": {"num_predict": 3}},
               headers={"x-conversation-id": "o"})
        again = c.get("/v1/stream", params={"conv_id": "o"})
        assert again.headers["content-type"].startswith("application/x-ndjson")
        assert json.loads(again.text.splitlines()[-1])["done"] is True


def test_stopping_a_resumable_stream_cancels_it_and_keys_keep_their_own(url: str) -> None:
    store = KeyStore()
    alice, bob = store.add("alice", KeyLimits()), store.add("bob", KeyLimits())
    conv, qs = {"x-conversation-id": "c2"}, {"conv_id": "c2", "from": "0"}
    body = {"model": "fim", "prompt": "a", "stream": True, "n_predict": 4000,
            "ignore_eos": True}
    as_alice = {"authorization": f"Bearer {alice}"}
    as_bob = {"authorization": f"Bearer {bob}"}
    with httpx.Client(base_url=url, timeout=120) as c:
        with c.stream("POST", "/completion", json=body, headers={**conv, **as_alice}) as r:
            first = next(r.iter_lines())
        assert first.startswith("data: {"), first
        assert c.get("/v1/stream", params=qs, headers=as_bob).status_code == 404
        assert c.post("/v1/streams/lookup", json={"conversation_ids": ["c2"]},
                      headers=as_bob).json() == []
        assert c.delete("/v1/stream", params=qs, headers=as_bob).status_code == 204
        with c.stream("GET", "/v1/stream", params=qs, headers=as_alice) as live:
            assert live.status_code == 200
            lines = live.iter_lines()
            assert next(lines).startswith("data: {")  # (still running: bob stopped nothing)
            assert c.delete("/v1/stream", params=qs, headers=as_alice).status_code == 204
            rest = list(lines)  # (it ends: the request was cancelled)
        ends = [json.loads(line.removeprefix("data: ")) for line in rest
                if line.startswith("data: {")]
        assert ends and ends[-1]["tokens_predicted"] < 4000
        assert not any(e.get("stop") for e in ends)
        assert c.get("/v1/stream", params=qs, headers=as_alice).status_code == 404
        jobs = c.get("/slots", headers=as_alice).json()
        assert not any(s["is_processing"] for s in jobs)
