"""Nothing wedged: a chat template from a stranger runs under a render budget, and an
engine that stops moving is killed and restarted (real daemon, real engine processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from daemonhelp import EC, Raw, daemon_process, wait_until
from modelshelp import Entry, models_toml
from test_engine_process import engine_pid, generate, loaded, serving_again, streams
from tinymodel import CHAT_TEMPLATE, write_tiny_gguf

from everycycle import paths
from everycycle.chatfmt.template import ChatTemplate
from everycycle.chatfmt.templatebudget import RenderBudgetError
from everycycle.client import SyncClient
from everycycle.errors import ErrorKind
from everycycle.protocol import Error, Format, Message, Role, Tokens, encode, is_terminal

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
STRING = "{{ ('x' * 100000) * 5000 }}"
BOMBS = {
    "loops": LOOPS,
    "string": STRING,
    "macro": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
              "{% endmacro %}{{ f(40) }}"),
    "join": "{{ range(100000) | join('x' * 100000) }}",
    "tilde": ("{% set ns = namespace(s='0123456789') %}{% for i in range(60) %}"
              "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_each_bomb_ends_within_its_budget(name: str) -> None:
    template = ChatTemplate.compile(BOMBS[name] + CHAT_TEMPLATE, bos_token="", eos_token="",
                                    n_ctx=8192)
    with pytest.raises(RenderBudgetError):  # (the budget counts; the test's timeout guards)
        template.render([{"role": "user", "content": "hello"}])
    # and an ordinary render of the same environment is untouched by it
    ok = ChatTemplate.compile(CHAT_TEMPLATE, bos_token="", eos_token="", n_ctx=8192)
    assert ok.render([{"role": "user", "content": "hi"}]).endswith("<start_of_turn>model\n")


def _when(word: str, bomb: str) -> str:
    """A template that renders normally, but runs ``bomb`` for a message ``word``."""
    return f"{{% if messages[-1]['content'] == '{word}' %}}{bomb}{{% endif %}}" + CHAT_TEMPLATE


@pytest.fixture
def bombs(tmp_path: Path) -> Path:
    conditional = write_tiny_gguf(tmp_path / "conditional.gguf", chat_template=(
        _when("loops", LOOPS).replace(CHAT_TEMPLATE, "") + _when("string", STRING)))
    always = write_tiny_gguf(tmp_path / "always.gguf",
                             chat_template=LOOPS + "<|im_start|>" + CHAT_TEMPLATE)
    return models_toml(tmp_path / "bombs.toml",
                       Entry("bomb", conditional, context=2048, parallel=2),
                       Entry("always", always, context=2048, parallel=1))


def _chat(c: SyncClient, model: str, text: str) -> list[object]:
    return list(c.generate(model, messages=(Message(Role.USER, text),), max_tokens=4,
                           temperature=0.0))


def test_a_bomb_in_a_request_ends_invalid_and_the_model_serves_on(bombs: Path) -> None:
    with daemon_process("--models", str(bombs)), SyncClient() as c:
        assert isinstance(_chat(c, "bomb", "hello")[-1], Tokens)
        before = loaded("bomb")
        assert before is not None and before.engine_rss
        for word in ("loops", "string"):
            last = _chat(c, "bomb", word)[-1]
            assert isinstance(last, Error) and last.kind is ErrorKind.INVALID, last
            assert "chat template of model 'bomb' exceeded its render budget" in last.message
            # the same model answers next: a raw prompt, and a chat
            raw = list(c.generate("bomb", "hello", format=Format.RAW, max_tokens=4,
                                  temperature=0.0))
            assert isinstance(raw[-1], Tokens) and raw[-1].finished
            assert isinstance(_chat(c, "bomb", "hello")[-1], Tokens)
        after = loaded("bomb")
        assert after is not None and after.engine_pid == before.engine_pid  # not restarted
        assert after.engine_rss is not None
        assert after.engine_rss - before.engine_rss < 64 << 20


def test_a_template_over_budget_when_tried_falls_back_and_says_why(bombs: Path) -> None:
    listed = subprocess.run([*EC, "models", "--json", "--models", str(bombs)],
                            capture_output=True, text=True, timeout=60, check=True)
    row = next(r for r in json.loads(listed.stdout) if r["name"] == "always")
    assert row["chat_template"] == "llama.cpp"
    assert "exceeded its render budget (over 3 s)" in row["chat_template_note"]
    shown = subprocess.run([*EC, "show", "always", "--models", str(bombs)],
                           capture_output=True, text=True, timeout=60, check=True)
    assert "chat renderer" in shown.stdout and "render budget" in shown.stdout
    with daemon_process("--models", str(bombs)), SyncClient() as c:
        events = _chat(c, "always", "hello")  # llama.cpp's renderer (ChatML) answers
        assert isinstance(events[-1], Tokens) and events[-1].finished, events[-1]


@pytest.fixture
def daemon(tmp_path: Path, tiny_gguf: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    f = models_toml(tmp_path / "two.toml",
                    *(Entry(name, tiny_gguf, context=4096, parallel=4) for name in "ab"),
                    default="a")
    log = tmp_path / "daemon.stderr"
    with daemon_process("--models", str(f), "--http", "127.0.0.1:0", "--hang-timeout", "2",
                        stderr=log) as proc:
        yield proc, log


def test_an_engine_that_stops_moving_is_replaced(
        daemon: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, log = daemon
    with SyncClient() as c:
        c.load("a")
    pid = engine_pid("a")
    victims = [generate("a", f"a{i}", 4000) for i in range(4)]
    others = [generate("b", f"b{i}", 200) for i in range(2)]
    events = anyio.run(streams, victims + others, (pid, signal.SIGSTOP))  # (60 s: a hang)
    for r in victims:
        evs = events[r.request_id]
        last = evs[-1]
        assert isinstance(last, Error) and last.kind is ErrorKind.INTERNAL, last
        assert last.message.startswith("engine for a hung: no progress in a step for 2 s")
    for r in others:
        assert isinstance(events[r.request_id][-1], Tokens)
    wait_until(lambda: serving_again("a", pid), "model a's engine to restart")
    again = anyio.run(streams, [generate("a", "after", 20)])["after"]
    assert isinstance(again[-1], Tokens) and again[-1].finished
    m = loaded("a")
    assert m is not None and m.engine_restarts == 1 and m.engine_exit == "hung"
    with SyncClient() as c:
        http = c.describe_fleet().http
    assert http is not None
    with urllib.request.urlopen(f"{http}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'everycycle_engine_deaths_total{cause="hung",model="a"} 1.0' in metrics
    records = map(json.loads, paths.audit_file().read_text().splitlines())
    deaths = [r for r in records if r.get("event") == "engine_death"]
    assert [(d["model"], d["cause"]) for d in deaths] == [("a", "hung")]
    assert proc.poll() is None and "Traceback" not in log.read_text()


async def busy(model: str, seconds: float) -> tuple[float, list[list[object]]]:
    """Keep ``model``'s 4 slots and its queue full (6 requests of 400 tokens in flight,
    a new one sent as each ends) until ``seconds`` have passed since the first token,
    however fast the machine: (seconds from the first token to the last end, every
    request's events)."""
    events: dict[str, list[object]] = {}
    first: float | None = None
    async with Raw.open() as c:
        async def send() -> None:
            rid = f"l{len(events)}"
            events[rid] = []
            await c.send(encode(generate(model, rid, 400)))

        for _ in range(6):
            await send()
        ended = 0
        with anyio.fail_after(120):
            while ended < len(events):
                ev = await c.next()
                events[getattr(ev, "request_id", "")].append(ev)
                if first is None and isinstance(ev, Tokens):
                    first = time.monotonic()
                if is_terminal(ev):
                    ended += 1
                    if first is not None and time.monotonic() - first < seconds:
                        await send()
    assert first is not None
    return time.monotonic() - first, list(events.values())


def test_a_long_busy_engine_is_not_taken_for_hung(
        daemon: tuple[subprocess.Popen[bytes], Path]) -> None:
    # The engine never idles for longer than the 2 s timeout (every step is progress).
    took, events = anyio.run(busy, "a", 5.0)
    assert took > 5
    for evs in events:
        assert isinstance(evs[-1], Tokens) and evs[-1].finished, evs[-1]
    m = loaded("a")
    assert m is not None and not m.engine_restarts and m.engine_exit is None
