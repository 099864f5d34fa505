"""Streams never go quiet while we work (daemon/http/exchange.py): a request that waits
in the queue gets its dialect's heartbeat every ``--http-heartbeat`` seconds — raw bytes
checked here — and each dialect's official client, reading the same kind of stream,
skips them and gets its answer. Real daemon, real port, real llama.cpp (the tiny model;
the only slot held by a long ``run``)."""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SpawnDaemon
from httphelp import blocker, fleet_http, hostport

HI = [{"role": "user", "content": "hello"}]
BEAT = 0.3
"""The daemon's --http-heartbeat here (seconds)."""
from httphelp import anthropic_client, ollama_client, openai_client


def _chat(url: str) -> str:
    with openai_client(url, "x", timeout=60) as c:
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny", messages=HI, max_tokens=4, stream=True,  # type: ignore[arg-type]
            temperature=0) if ch.choices)


def _responses(url: str) -> str:
    with openai_client(url, "x", timeout=60) as c:
        return "".join(e.delta for e in c.responses.create(
            model="tiny", input="hello", max_output_tokens=4, temperature=0, stream=True)
            if e.type == "response.output_text.delta")


def _messages(url: str) -> str:
    c = anthropic_client(url, "x", timeout=60)
    with c, c.messages.stream(model="tiny", messages=HI,  # type: ignore[arg-type]
                              max_tokens=4, extra_body={"temperature": 0}) as stream:
        return "".join(stream.text_stream)


def _ollama(url: str) -> str:
    with ollama_client(url, timeout=60) as c:
        return "".join(part.message.content or "" for part in c.chat(
            model="tiny", messages=HI, stream=True,
            options={"num_predict": 4, "temperature": 0}))


DIALECTS: dict[str, tuple[str, dict[str, Any], Callable[[bytes], bool], Callable[[str], str]]] = {
    # path, streamed body, "is this line a heartbeat", the official client's call
    "chat": ("/v1/chat/completions",
             {"model": "tiny", "messages": HI, "max_tokens": 4, "stream": True},
             lambda line: line == b": keep-alive", _chat),
    "responses": ("/v1/responses",
                  {"model": "tiny", "input": "hello", "max_output_tokens": 4, "stream": True},
                  lambda line: line == b"event: response.in_progress", _responses),
    "messages": ("/v1/messages",
                 {"model": "tiny", "messages": HI, "max_tokens": 4, "stream": True},
                 lambda line: line == b'data: {"type":"ping"}', _messages),
    "ollama": ("/api/chat",
               {"model": "tiny", "messages": HI, "options": {"num_predict": 4}},
               lambda line: (line.startswith(b"{") and json.loads(line).get("message")
                             == {"role": "assistant", "content": ""}
                             and "queue_position" not in json.loads(line)), _ollama),
}


@pytest.fixture
def slow_url(spawn_daemon: SpawnDaemon, models_file: Path
             ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    spawn_daemon("--http", "127.0.0.1:0", "--http-heartbeat", str(BEAT))
    proc = blocker(models_file)  # holds the only slot until killed
    yield fleet_http(), proc
    proc.kill()
    proc.communicate()


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_waiting_stream_gets_heartbeats_its_client_skips(
        slow_url: tuple[str, subprocess.Popen[bytes]], dialect: str) -> None:
    url, busy = slow_url
    path, body, is_beat, official = DIALECTS[dialect]
    answers: list[str] = []
    client = threading.Thread(target=lambda: answers.append(official(url)))
    client.start()  # queued behind the long run, as the raw request below
    conn = http.client.HTTPConnection(*hostport(url), timeout=60)
    conn.request("POST", path, body=json.dumps(body).encode())
    resp = conn.getresponse()
    assert resp.status == 200
    lines: list[bytes] = []
    until = time.monotonic() + 8 * BEAT
    while time.monotonic() < until:
        lines.append(resp.readline().rstrip(b"\n"))
    beats = sum(map(is_beat, lines))
    assert beats >= 4, lines  # (one per BEAT of silence; the first waits a whole one)
    busy.kill()  # the slot frees: both requests run
    rest = resp.read().split(b"\n")
    conn.close()
    client.join(60)
    assert answers and answers[0], answers  # the client skipped every heartbeat
    if dialect == "ollama":
        assert json.loads(rest[-2])["done"] is True
    elif dialect == "chat":
        assert b"data: [DONE]" in rest
    else:
        assert any(b"completed" in line or b"message_stop" in line for line in rest)
