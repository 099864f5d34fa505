"""Three daemons behind a real router from PyPI (vllm-router, pinned; .ci/vllm-router),
on one machine, each with its own state directory: every dialect answers through it;
the cache-aware policy keeps a conversation on the daemon that holds its prefix (our
``/v1/chat/completions/render`` is what it keys on); a drained daemon loses no
request; a SIGKILLed one's streams end at once, its new requests are answered by the
others, and it is sent work again once it is back."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from httphelp import anthropic_client, ollama_client, openai_client
from modelshelp import Entry, models_toml
from routerhelp import EC, Member, Router, free_port, routed, router_binary, wait_for
from tlshelp import make_pki

NO_EOS = {"2": -100}


@pytest.fixture(scope="module")
def binary() -> str:
    found = router_binary()
    if found is None:
        if os.environ.get("EVERYCYCLE_REQUIRE_ROUTER"):
            pytest.fail("vllm-router is required here: eval \"$(.ci/vllm-router)\"")
        pytest.skip("vllm-router is not installed (eval \"$(.ci/vllm-router)\")")
    return found


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path) -> Path:
    return models_toml(tmp_path_factory.mktemp("router") / "models.toml",
                       Entry("tiny", tiny_gguf, context=4096, parallel=2), default="tiny")


@pytest.fixture(scope="module")
def router(binary: str, models: Path) -> Iterator[Router]:
    with routed(binary, models, "tiny", "cache_aware") as r:
        yield r


def test_every_dialect_answers_through_the_router(router: Router) -> None:
    url = router.url
    with openai_client(url) as client:
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage
        streamed = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True))
        assert streamed[-1].choices[0].finish_reason in ("length", "stop")
        text = client.completions.create(model="tiny", prompt="once", max_tokens=4)
        assert text.choices[0].finish_reason in ("length", "stop")
        answer = client.responses.create(model="tiny", input="hi", max_output_tokens=4)
        assert answer.status in ("completed", "incomplete")
    with anthropic_client(url) as claude:
        message = claude.messages.create(model="tiny", max_tokens=4,
                                         messages=[{"role": "user", "content": "hi"}])
        assert message.stop_reason in ("max_tokens", "end_turn")
    with ollama_client(url) as ollama_api:
        reply = ollama_api.chat(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                options={"num_predict": 4})
    assert reply.done
    native = httpx.post(f"{url}/completion", json={"prompt": "once", "n_predict": 4},
                        timeout=60)
    assert native.status_code == 200 and native.json()["stop"] is True, native.text


def _conversation(url: str, n: int, turns: list[dict[str, int]]) -> None:
    """Five turns of one conversation, each the last one's messages and answer plus a
    new question; each turn's prompt and cached tokens."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": f"You are assistant number {n} of four. " * 8}]
    with openai_client(url, timeout=120) as client:
        for turn in range(5):
            messages.append({"role": "user", "content": f"Question {turn} of "
                             f"conversation {n}: " + "tell me more. " * 6})
            answer = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                                    max_tokens=12, temperature=0.0)
            usage = answer.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            turns.append({"prompt": usage.prompt_tokens,
                          "cached": usage.prompt_tokens_details.cached_tokens or 0})
            messages.append({"role": "assistant",
                             "content": answer.choices[0].message.content or ""})


def test_cache_aware_routing_keeps_each_conversation_on_its_cache(router: Router) -> None:
    """Four conversations at once, five turns each: every later turn finds at least
    the whole previous prompt cached on the daemon it was sent to."""
    turns: list[list[dict[str, int]]] = [[] for _ in range(4)]
    threads = [threading.Thread(target=_conversation, args=(router.url, n, turns[n]))
               for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    reused = [later["cached"] >= earlier["prompt"] for conv in turns
              for earlier, later in itertools.pairwise(conv)]
    assert len(reused) == 16 and all(reused), turns
    # (the router asked each daemon for the tokens; the render it keys on is ours)
    probe = httpx.post(f"{router.members[0].url}/v1/chat/completions/render", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    counted = httpx.post(f"{router.members[0].url}/v1/chat/completions/input_tokens", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert len(probe.json()["token_ids"]) == counted.json()["input_tokens"] > 0


def _long_stream(url: str, n: int, out: dict[str, Any], tokens: int = 1500) -> None:
    """A long streamed answer through ``url``; how it ended and when."""
    try:
        with openai_client(url, timeout=120) as client:
            got = 0
            for chunk in client.chat.completions.create(
                    # (no prefix in common: the cache-aware policy sends each to the
                    # least loaded daemon)
                    model="tiny", messages=[{"role": "user", "content": chr(97 + n) * 300}],
                    max_tokens=tokens, temperature=1.0, logit_bias=NO_EOS, stream=True):
                if chunk.choices and chunk.choices[0].delta.content:
                    got += 1
                    out["started"], out["chunks"] = True, got
                if chunk.choices and chunk.choices[0].finish_reason:
                    out["finish"] = chunk.choices[0].finish_reason
    except (openai.APIError, httpx.HTTPError) as exc:  # (a dead daemon's stream, cut)
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["ended"] = time.monotonic()


def _short(url: str, n: int, content: str = "") -> str:
    with openai_client(url, timeout=120) as client:
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content or f"new request {n}"}],
            max_tokens=4)
    return answer.choices[0].finish_reason or ""


def _spread_streams(router: Router, tokens: int, n: int = 3
                    ) -> tuple[list[dict[str, Any]], list[threading.Thread]]:
    """``n`` long streams through the router, started a moment apart (each goes to the
    least loaded daemon); once all have begun."""
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    threads = [threading.Thread(target=_long_stream, args=(router.url, i, results[i], tokens))
               for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.3)  # (least loaded first: one on each daemon)
    wait_for(lambda: all(r.get("started") for r in results), "the streams to start")
    return results, threads


def _claude(url: str, n: int) -> str:
    with anthropic_client(url, timeout=120) as claude:
        message = claude.messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": f"new message {n}"}])
    return message.stop_reason or ""


@pytest.mark.timeout(300)  # (two daemons' streams and a dozen requests on a busy machine)
def test_a_drained_daemon_loses_no_request(binary: str, models: Path) -> None:
    """Two daemons drained, one with a stream on it and one idle (the one the router
    would pick next), while requests keep coming in the dialect the router retries
    (chat completions) and in one it passes through once (Anthropic's): none is lost,
    with the daemons and router set as docs/many-machines.md says (``--drain-notice``),
    and the stream finishes whole."""
    with routed(binary, models, "tiny", "cache_aware", extra=("--drain-notice", "5")
                ) as router:
        # (1,200 tokens: still streaming when its daemon drains, two seconds in; done in
        # about 20 s here, where 3,000 took a minute and a busy CI machine over two)
        results, threads = _spread_streams(router, 1200, n=2)
        running = [m.requests_running() for m in router.members]
        busy, idle = running.index(1), running.index(0)
        drains = [subprocess.Popen([*EC, "drain", "--socket", str(m.sock), "--grace", "240"],
                                   env=m.env(), stderr=subprocess.PIPE)
                  for m in (router.members[busy], router.members[idle])]
        try:
            for m in (router.members[busy], router.members[idle]):
                wait_for(lambda m=m: httpx.get(f"{m.url}/health", timeout=5).status_code == 503,
                         "the daemons to drain")  # (each admits work for 5 s more)
            answered = []
            for n in range(6):
                answered += [_claude(router.url, n), _short(router.url, n)]
                time.sleep(1)  # (through the notice and past it)
            assert all(reason in ("length", "stop", "max_tokens", "end_turn")
                       for reason in answered), answered
            for t in threads:
                t.join(240)
            assert all(r.get("finish") == "length" and "error" not in r
                       for r in results), results
            for drain, m in zip(drains, (router.members[busy], router.members[idle]),
                                strict=True):
                _, err = drain.communicate(timeout=120)
                assert drain.returncode == 0 and b"drained and stopped" in err, err
                assert m.proc is not None and m.proc.wait(30) == 0
        finally:
            for drain in drains:  # (a failed check leaves no drain behind)
                if drain.poll() is None:
                    drain.kill()
                drain.communicate()


@pytest.mark.timeout(400)  # (streams, a restart and rounds of work on a busy machine)
def test_a_killed_daemon_costs_only_its_own_streams(binary: str, models: Path) -> None:
    with routed(binary, models, "tiny", "cache_aware") as router:
        results, _ = _spread_streams(router, 3000)
        running = [m.requests_running() for m in router.members]
        victim_index = next(i for i, n in enumerate(running) if n)
        victim = router.members[victim_index]
        assert victim.proc is not None
        victim.proc.kill()
        victim.proc.wait()
        # Requests that had not started anywhere are answered by the others.
        answered = [_short(router.url, n) for n in range(6)]
        assert all(reason in ("length", "stop") for reason in answered), answered
        # The streams that were on it, and only those, were cut by the router before six
        # new requests were answered; the others go on (not waited for to the end: on a
        # busy machine that is minutes).
        cut = [r for r in results if "error" in r]
        assert len(cut) == running[victim_index], (running, results)
        going = [r for r in results if "error" not in r]
        seen = [r.get("chunks", 0) for r in going]
        wait_for(lambda: all(r.get("finish") == "length" or r.get("chunks", 0) > n
                             for r, n in zip(going, seen, strict=True)),
                 "the other streams to go on", timeout=120)
        assert not any("error" in r for r in going), results
        # Back on its port, it is sent work again.
        victim.start()
        before = victim.requests_served()

        fresh = itertools.count()

        def sent_again() -> bool:
            # Short requests whose prompts share nothing with any sent before (so the
            # cache-aware policy sends each to the least loaded daemon, which the revived
            # one is: the others still hold a long stream each); each ends in seconds.
            k = next(fresh)
            assert _short(router.url, k, chr(0x3b1 + k % 24) * 300) in ("length", "stop")
            return victim.requests_served() > before

        wait_for(sent_again, "the router to send to the daemon again", timeout=240)


def test_https_daemons_behind_the_router_with_a_private_ca(binary: str, models: Path,
                                                           tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    with routed(binary, models, "tiny", "round_robin", n=2,
                tls=(pki.ca, pki.cert, pki.key)) as router:
        assert all(m.url.startswith("https://") for m in router.members)
        answered = [_short(router.url, n) for n in range(4)]
        assert all(reason in ("length", "stop") for reason in answered)
        assert all(m.requests_served() == 2 for m in router.members)


def test_health_and_load_probes_answer_without_a_key(router: Router) -> None:
    member = router.members[0]
    assert httpx.get(f"{member.url}/health", timeout=5).json() == {"status": "ok"}
    assert httpx.get(f"{member.url}/get_load", timeout=5).json() == {"load": 0}
    listed = json.loads(httpx.get(f"{router.url}/v1/models", timeout=10).text)
    assert any(m["id"] == "tiny" for m in listed["data"])


def test_one_key_opens_every_daemon_behind_the_router(tmp_path: Path, models: Path) -> None:
    """``keys add NAME --secret-stdin``: the secret one daemon's ``keys add`` printed,
    added on another, so that clients of the router hold one key for all of them."""
    homes = [tmp_path / "a", tmp_path / "b"]
    for home in homes:
        home.mkdir()
    envs = [{**os.environ, "EVERYCYCLE_HOME": str(h)} for h in homes]
    made = subprocess.run([*EC, "keys", "add", "team"], env=envs[0], capture_output=True,
                          text=True, timeout=60, check=True)
    secret = made.stdout.strip()
    copied = subprocess.run([*EC, "keys", "add", "team", "--secret-stdin"], env=envs[1],
                            input=made.stdout, capture_output=True, text=True, timeout=60,
                            check=False)
    assert copied.returncode == 0 and copied.stdout.strip() == secret, copied.stderr
    bad = subprocess.run([*EC, "keys", "add", "other", "--secret-stdin"], env=envs[1],
                         input="hunter2\n", capture_output=True, text=True, timeout=60,
                         check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a key" in bad.stderr
    members = [Member(h, free_port(), models, "tiny", ("--http-auth",)) for h in homes]
    try:
        for m in members:
            m.start()
            with openai_client(m.url, key=secret) as client:
                client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            refused = httpx.post(f"{m.url}/v1/chat/completions", timeout=30, json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": "Bearer ec-" + "x" * 43})
            assert refused.status_code == 401
    finally:
        for m in members:
            m.stop()
