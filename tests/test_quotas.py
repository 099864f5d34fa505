"""Principals, quotas and usage: token-bucket arithmetic under hypothesis, the key file,
and each limit enforced on a real daemon over the Unix socket, TCP and HTTP (the real
`openai` client) while another principal is served."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import openai
import pytest
from daemonhelp import EC, running_daemon
from httphelp import fleet_http
from hypothesis import given, settings
from hypothesis import strategies as st

from everycycle import paths
from everycycle.client import connect
from everycycle.client.aio import Client
from everycycle.daemon.keys import KeyLimits, KeyStore, Principal, hash_secret
from everycycle.daemon.quota import Quotas, TokenBucket
from everycycle.daemon.server import Daemon
from everycycle.daemon.usage import audit_records, summarize
from everycycle.errors import ConfigError, ErrorKind, RejectedError, RequestFailedError
from everycycle.protocol import Error, Tokens

# ---------------------------------------------------------------------- arithmetic

steps = st.lists(st.tuples(st.floats(0, 30), st.integers(1, 40)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(rate=st.floats(1, 600), steps=steps)
def test_a_bucket_never_grants_more_than_its_rate_over_any_window(
        rate: float, steps: list[tuple[float, int]]) -> None:
    """All-or-nothing takes: over any window of T s, at most capacity + rate/60 * T."""
    bucket = TokenBucket.per_minute(rate, 0.0)
    now, granted = 0.0, []
    for dt, amount in steps:
        now += dt
        if bucket.wait(amount, now) == 0:
            bucket.take(amount, now)
            granted.append((now, amount))
        assert bucket.level >= -1e-9
    for i, (start, _) in enumerate(granted):
        total = 0
        for when, amount in granted[i:]:
            total += amount
            assert total <= rate + rate / 60 * (when - start) + 1e-6


@settings(max_examples=300, deadline=None)
@given(rate=st.floats(1, 600), steps=steps)
def test_charged_after_the_fact_a_burst_is_bounded_by_one_request(
        rate: float, steps: list[tuple[float, int]]) -> None:
    """Generated tokens are charged as they stream: a request is admitted only while the
    bucket holds a token, so any window's charges exceed the rate by at most one charge."""
    bucket = TokenBucket.per_minute(rate, 0.0)
    now, charged = 0.0, []
    largest = max(amount for _, amount in steps)
    for dt, amount in steps:
        now += dt
        if bucket.wait(1, now) == 0:
            bucket.take(amount, now)
            charged.append((now, amount))
    for i, (start, _) in enumerate(charged):
        total = 0
        for when, amount in charged[i:]:
            total += amount
            assert total <= rate + rate / 60 * (when - start) + largest + 1e-6


def test_wait_says_when_there_is_room_and_never_for_more_than_the_capacity() -> None:
    bucket = TokenBucket.per_minute(60, 0.0)  # one per second, sixty at most
    bucket.take(60, 0.0)
    assert bucket.wait(1, 0.0) == pytest.approx(1.0)
    assert bucket.wait(1, 0.5) == pytest.approx(0.5)
    assert bucket.wait(1, 1.0) == 0
    assert bucket.wait(61, 1000.0) == float("inf")
    assert bucket.wait(60, 1000.0) == 0  # refilled to the capacity, no further


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_quota_messages_name_the_limit_and_when_to_retry() -> None:
    clock = Clock()
    quotas = Quotas(clock)
    p = Principal("ci", KeyLimits(requests_per_minute=2, tokens_per_minute=30,
                                  prompt_bytes_per_minute=100, concurrent=3))
    quotas.admit(p, prompt_bytes=10, inflight=0)
    quotas.admit(p, prompt_bytes=10, inflight=0)
    with pytest.raises(RejectedError) as exc:
        quotas.admit(p, prompt_bytes=10, inflight=0)
    assert exc.value.limit == "requests_per_minute"
    assert "key 'ci' is over its limit of 2 requests per minute; retry in 30 s" in str(exc.value)
    assert exc.value.retry_after == pytest.approx(30)
    clock.now += 30
    quotas.admit(p, prompt_bytes=10, inflight=0)
    with pytest.raises(RejectedError, match="3 requests in flight") as exc:
        quotas.admit(p, prompt_bytes=10, inflight=3)
    assert exc.value.limit == "concurrent"
    with pytest.raises(RejectedError, match="this prompt is 500 bytes"):
        quotas.admit(p, prompt_bytes=500, inflight=0)
    quotas.generated(p, 45)  # one request may overshoot: it is never cut
    clock.now += 60  # 30 - 45 + 30: room again
    quotas.admit(p, prompt_bytes=1, inflight=0)
    quotas.generated(p, 45)  # 15 - 45 = -30: a token is back in (1 + 30) / 0.5 s
    with pytest.raises(RejectedError, match="30 generated tokens per minute; retry in 62 s"
                       ) as exc:
        quotas.admit(p, prompt_bytes=1, inflight=0)
    assert exc.value.limit == "tokens_per_minute"
    # Changed limits take effect at once.
    quotas.admit(Principal("ci", KeyLimits(requests_per_minute=5)), prompt_bytes=1, inflight=0)


# ---------------------------------------------------------------------- the key file

def test_each_lane_of_a_key_has_its_own_quota() -> None:
    """A key's background batch never spends what its interactive requests may use: each
    lane has its own buckets and its own count in flight."""
    clock = Clock()
    quotas = Quotas(clock)
    p = Principal("ci", KeyLimits(requests_per_minute=1, tokens_per_minute=10, concurrent=1))
    quotas.admit(p, "background", prompt_bytes=1, inflight=0)
    quotas.generated(p, 10, "background")
    with pytest.raises(RejectedError, match=r"key 'ci' \(background lane\) is over") as exc:
        quotas.admit(p, "background", prompt_bytes=1, inflight=0)
    assert exc.value.limit in ("requests_per_minute", "tokens_per_minute")
    with pytest.raises(RejectedError, match=r"key 'ci' \(background lane\) has 1 requests"):
        quotas.admit(p, "background", prompt_bytes=1, inflight=1)
    quotas.admit(p, "interactive", prompt_bytes=1, inflight=0)  # untouched by the batch
    with pytest.raises(RejectedError, match="key 'ci' is over its limit of 1 requests"):
        quotas.admit(p, prompt_bytes=1, inflight=0)


def test_a_daemon_counts_a_keys_lanes_apart(spawn_daemon: object) -> None:
    made = subprocess.run([*EC, "keys", "add", "ci", "--rpm", "1"], capture_output=True,
                          text=True, timeout=60, check=True)
    spawn_daemon("--http", "127.0.0.1:0")  # type: ignore[operator]
    client = openai.OpenAI(base_url=f"{fleet_http()}/v1", api_key=made.stdout.strip(),
                           max_retries=0)
    try:
        def ask(lane: str) -> None:
            client.completions.create(model="tiny", prompt="a", max_tokens=1,
                                      extra_headers={"x-priority": lane})

        ask("background")
        ask("interactive")  # its own minute's request
        with pytest.raises(openai.RateLimitError, match="key 'ci' is over its limit"):
            ask("interactive")
        with pytest.raises(openai.RateLimitError, match=r"\(background lane\)"):
            ask("background")
    finally:
        client.close()


def test_the_key_file_keeps_hashes_only_and_is_private() -> None:
    store = KeyStore()
    secret = store.add("alice", KeyLimits(requests_per_minute=5, models=("tiny",)))
    text = store.path.read_text()
    assert secret not in text and hash_secret(secret) in text
    assert (store.path.stat().st_mode & 0o777) == 0o600
    found = store.authenticate(secret)
    assert found == Principal("alice", KeyLimits(requests_per_minute=5, models=("tiny",)))
    assert store.authenticate(secret + "x") is None
    assert store.authenticate("") is None
    store.set_limits("alice", KeyLimits(concurrent=1))
    assert store.authenticate(secret) == Principal("alice", KeyLimits(concurrent=1))
    store.remove("alice")
    assert store.authenticate(secret) is None


def test_a_loose_key_file_is_refused_by_the_cli_and_the_daemon(models_file: Path) -> None:
    KeyStore().add("alice", KeyLimits())
    path = KeyStore().path
    os.chmod(path, 0o640)
    with pytest.raises(ConfigError, match=r"read by others \(mode 0640\); run: chmod 600"):
        KeyStore().keys()
    out = subprocess.run([*EC, "keys", "list"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"everycycle: Invalid: key file {path} can be read by others "
                                  f"(mode 0640); run: chmod 600 {path}")
    out = subprocess.run([*EC, "daemon", "--models", str(models_file)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "chmod 600" in out.stderr


def test_keys_commands_show_a_secret_once_and_never_again() -> None:
    out = subprocess.run([*EC, "keys", "add", "ci", "--rpm", "60", "-m", "tiny"],
                         capture_output=True, text=True, timeout=60, check=True)
    secret = out.stdout.strip()
    assert re.fullmatch(r"ec-[A-Za-z0-9_-]{43}", secret)
    assert "shown only now" in out.stderr
    listed = subprocess.run([*EC, "keys", "list", "--json"], capture_output=True, text=True,
                            timeout=60, check=True)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert rows == [{"name": "ci", "created": rows[0]["created"],
                     "limits": {"requests_per_minute": 60.0, "models": ["tiny"]}}]
    table = subprocess.run([*EC, "keys", "list"], capture_output=True, text=True, timeout=60,
                           check=True, env={**os.environ, "COLUMNS": "100"})
    assert "60 requests/min; models: tiny" in table.stdout and secret not in table.stdout
    bad = subprocess.run([*EC, "keys", "add", "local"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 2
    assert bad.stderr == "everycycle: Invalid: key name 'local' is reserved\n"


# ---------------------------------------------------------------------- a real daemon

async def tokens_streamed(client: Client, model: str, prompt: str,
                          **options: object) -> tuple[int, Error | None]:
    """Generate; the number of ids in the streamed Tokens events, and the Error if any."""
    n = 0
    async for event in client.generate(model, prompt, **options):
        if isinstance(event, Tokens):
            n += len(event.chunk.ids)
        elif isinstance(event, Error):
            return n, event
    return n, None


def tcp(daemon: Daemon, secret: str) -> contextlib.AbstractAsyncContextManager[Client]:
    assert daemon.tcp_port
    return connect(tcp=("127.0.0.1", daemon.tcp_port), token=secret)


@pytest.fixture
async def served(models_file: Path) -> AsyncIterator[Daemon]:
    async with running_daemon(models_file, tcp=("127.0.0.1", 0),
                              http=("127.0.0.1", 0), http_auth=True) as daemon:
        yield daemon


def openai_client(daemon: Daemon, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{daemon.http_port}/v1", api_key=secret,
                         max_retries=0, timeout=60)


@pytest.mark.anyio
async def test_requests_per_minute_on_tcp_http_and_the_unix_socket(served: Daemon) -> None:
    store = KeyStore()
    slow = store.add("slow", KeyLimits(requests_per_minute=2))
    other = store.add("other", KeyLimits())
    async with tcp(served, slow) as c, tcp(served, other) as o:
        for _ in range(2):
            assert (await tokens_streamed(c, "tiny", "a", max_tokens=2))[1] is None
        _, err = await tokens_streamed(c, "tiny", "a", max_tokens=2)
        assert err is not None and err.kind is ErrorKind.REJECTED
        assert re.fullmatch(r"key 'slow' is over its limit of 2 requests per minute; "
                            r"retry in \d+(\.\d)? s", err.message), err.message
        assert (await tokens_streamed(o, "tiny", "a", max_tokens=2))[1] is None

    def over_http() -> None:
        with openai_client(served, slow) as api, openai_client(served, other) as ok:
            with pytest.raises(openai.RateLimitError) as exc:
                api.completions.create(model="tiny", prompt="a", max_tokens=2)
            retry = int(exc.value.response.headers["retry-after"])
            assert 1 <= retry <= 31
            assert "2 requests per minute" in exc.value.message
            assert ok.completions.create(model="tiny", prompt="a", max_tokens=2).choices
            with pytest.raises(openai.AuthenticationError):
                openai_client(served, "ec-not-a-key").models.list()

    await anyio.to_thread.run_sync(over_http)

    store.set_limits("local", KeyLimits(requests_per_minute=1))
    async with connect() as local, tcp(served, other) as o:
        assert (await tokens_streamed(local, "tiny", "a", max_tokens=2))[1] is None
        _, err = await tokens_streamed(local, "tiny", "a", max_tokens=2)
        assert err is not None and err.kind is ErrorKind.REJECTED
        assert "key 'local' is over its limit of 1 requests per minute" in err.message
        assert (await tokens_streamed(o, "tiny", "a", max_tokens=2))[1] is None


@pytest.mark.anyio
async def test_concurrency_and_token_limits_never_cut_a_running_request(served: Daemon) -> None:
    store = KeyStore()
    one = store.add("one", KeyLimits(concurrent=1))
    frugal = store.add("frugal", KeyLimits(tokens_per_minute=5))
    async with tcp(served, one) as c, tcp(served, frugal) as f:
        stream = c.generate("tiny", "x", max_tokens=1000, temperature=1.0, seed=1)
        first = await stream.__anext__()  # Accepted: it holds the key's one place
        assert first.queue_position == 0
        n, err = await tokens_streamed(c, "tiny4", "y", max_tokens=2)
        assert err is not None and err.kind is ErrorKind.REJECTED
        assert "key 'one' has 1 requests in flight, its limit" in err.message

        def one_more_over_http() -> None:
            with openai_client(served, one) as api, pytest.raises(
                    openai.RateLimitError, match="1 requests in flight") as exc:
                api.completions.create(model="tiny4", prompt="a", max_tokens=2)
            assert exc.value.response.headers["retry-after"] == "1"

        await anyio.to_thread.run_sync(one_more_over_http)
        rest = [e async for e in stream]
        assert isinstance(rest[-1], Tokens) and rest[-1].finished  # run to its end
        assert sum(len(e.chunk.ids) for e in rest if isinstance(e, Tokens)) == 1000
        # Five tokens a minute, yet a 20-token answer runs to its end...
        n, err = await tokens_streamed(f, "tiny4", "x", max_tokens=20, temperature=1.0, seed=2)
        assert err is None and n == 20
        # ...and the next request waits for the bucket to refill.
        _, err = await tokens_streamed(f, "tiny4", "x", max_tokens=2)
        assert err is not None and err.kind is ErrorKind.REJECTED
        assert "5 generated tokens per minute; retry in" in err.message

        def frugal_over_http() -> None:
            with openai_client(served, frugal) as api, pytest.raises(
                    openai.RateLimitError, match="generated tokens per minute") as exc:
                api.chat.completions.create(
                    model="tiny4", messages=[{"role": "user", "content": "a"}], max_tokens=2)
            # 15 tokens of debt at 5 a minute: a token is back in about three minutes.
            assert 150 <= int(exc.value.response.headers["retry-after"]) <= 200

        await anyio.to_thread.run_sync(frugal_over_http)


@pytest.mark.anyio
async def test_models_and_prompt_bytes(served: Daemon) -> None:
    store = KeyStore()
    only = store.add("only", KeyLimits(models=("tiny",), prompt_bytes_per_minute=40))
    async with tcp(served, only) as c:
        assert (await tokens_streamed(c, "tiny", "a", max_tokens=1))[1] is None
        for model in ("tiny4", "no-such-model"):  # the same answer, existing or not
            _, err = await tokens_streamed(c, model, "a", max_tokens=1)
            assert err == Error(err.request_id if err else "", ErrorKind.INVALID,
                                f"model '{model}' is not available to key 'only'")
        _, err = await tokens_streamed(c, "tiny", "z" * 50, max_tokens=1)
        assert err is not None and err.kind is ErrorKind.REJECTED
        assert err.message == ("key 'only' may send 40 prompt bytes per minute; "
                               "this prompt is 50 bytes")

    def over_http() -> None:
        with openai_client(served, only) as api:
            assert [m.id for m in api.models.list()] == ["tiny"]
            for model in ("tiny4", "no-such-model"):
                with pytest.raises(openai.BadRequestError, match="not available to key"):
                    api.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "a"}], max_tokens=1)
                with pytest.raises(openai.NotFoundError):
                    api.models.retrieve(model)

    await anyio.to_thread.run_sync(over_http)


@pytest.mark.anyio
async def test_usage_counts_exactly_the_streamed_ids_and_never_a_secret(
        served: Daemon, capfd: pytest.CaptureFixture[str]) -> None:
    store = KeyStore()
    a = store.add("a", KeyLimits(requests_per_minute=4))
    b = store.add("b", KeyLimits())
    streamed = {"a": 0, "b": 0, "local": 0}
    outcomes: dict[str, list[str]] = {"a": [], "b": [], "local": []}
    async with tcp(served, a) as ca, tcp(served, b) as cb, connect() as cl:
        for who, client in (("a", ca), ("b", cb), ("local", cl)):
            for i in range(5):  # a's fifth is Rejected
                n, err = await tokens_streamed(client, "tiny4", f"p{i}", max_tokens=3 + i,
                                               temperature=1.0, seed=i)
                streamed[who] += n
                outcomes[who].append(err.kind.value if err else "Finished")
            # One cancelled mid-stream: the ids it streamed count too.
            stream = client.generate("tiny4", "long", max_tokens=500, temperature=1.0,
                                     request_id=f"cx-{who}")
            async for event in stream:
                if isinstance(event, Tokens):
                    streamed[who] += len(event.chunk.ids)
                    if not event.finished:
                        await client.cancel_if_active(f"cx-{who}")
                elif isinstance(event, Error):
                    outcomes[who].append(event.kind.value)
    assert outcomes["a"].count("Rejected") == 2  # the fifth, and the cancelled sixth
    assert "Cancelled" in outcomes["b"] and "Cancelled" in outcomes["local"]

    def usage() -> dict[str, dict[str, int]]:
        out = subprocess.run([*EC, "usage", "--json"], capture_output=True, text=True,
                             timeout=60, check=True)
        return {row["key"]: row for row in map(json.loads, out.stdout.splitlines())}

    rows = await anyio.to_thread.run_sync(usage)
    for who in ("a", "b", "local"):
        assert rows[who]["generated_tokens"] == streamed[who]
        assert rows[who]["requests"] == len(outcomes[who])
        assert rows[who]["rejected"] == outcomes[who].count("Rejected")
        assert rows[who]["cancelled"] == outcomes[who].count("Cancelled")
    logged = paths.audit_file().read_text()
    captured = capfd.readouterr()
    for secret in (a, b):
        assert secret not in logged and secret not in captured.out + captured.err
    summary = summarize(audit_records(paths.audit_file()), by="model")
    assert sum(r.generated_tokens for r in summary) == sum(streamed.values())


@pytest.mark.anyio
async def test_fleet_and_metrics_show_principals(served: Daemon) -> None:
    store = KeyStore()
    k = store.add("k", KeyLimits(requests_per_minute=1))
    async with tcp(served, k) as ck, connect() as local:
        # "tiny": one slot of 8192 tokens, so "held" runs for seconds and "mine" waits
        # queued behind it (tiny4's 512-token slots can end before `fleet` has started).
        held = ck.generate("tiny", "x", max_tokens=8000, temperature=1.0, request_id="held")
        async for e in held:  # (its Accepted comes at once, while tiny loads)
            if isinstance(e, Tokens):
                break
        snap = await local.describe_fleet()
        assert snap.principals is None  # one principal: nothing to tell apart
        other = local.generate("tiny", "x", max_tokens=8000, temperature=1.0,
                               request_id="mine")
        await other.__anext__()
        snap = await local.describe_fleet()
        assert snap.principals is not None
        assert {(p.name, p.active_requests) for p in snap.principals} == {("k", 1),
                                                                          ("local", 1)}
        _, err = await tokens_streamed(ck, "tiny4", "x", max_tokens=1)
        assert err is not None and err.kind is ErrorKind.REJECTED
        out = await anyio.to_thread.run_sync(lambda: subprocess.run(
            [*EC, "fleet"], capture_output=True, text=True, timeout=60, check=False,
            env={**os.environ, "COLUMNS": "120"}))
        assert "active requests: 2 (k 1, local 1)" in out.stderr, out.stderr
        await local.cancel_if_active("mine")
        await local.cancel_if_active("held")
        [e async for e in other]
        [e async for e in held]

    def scrape() -> str:
        conn = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=30)
        try:
            conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {k}"})
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    text = await anyio.to_thread.run_sync(scrape)
    assert 'everycycle_rejections_total{limit="requests_per_minute",principal="k"} 1.0' in text
    assert re.search(r'everycycle_principal_tokens_total\{kind="generated",principal="k"\} '
                     r'[1-9]', text)


@pytest.mark.anyio
async def test_a_key_cancels_only_its_own_requests(served: Daemon) -> None:
    store = KeyStore()
    a = store.add("a", KeyLimits())
    b = store.add("b", KeyLimits())
    async with tcp(served, a) as ca, tcp(served, b) as cb, connect() as local:
        stream = ca.generate("tiny4", "long", max_tokens=400, temperature=1.0,
                             request_id="of-a")
        async for event in stream:
            if isinstance(event, Tokens) and not event.finished:
                break
        # Another key hears the same words as for no request at all; the owner and the
        # socket's user (an admin) may cancel it.
        with pytest.raises(RequestFailedError, match="no active request 'of-a'"):
            await cb.cancel("of-a")
        await local.cancel("of-a")
        ended = [e async for e in stream]
        assert isinstance(ended[-1], Error) and ended[-1].kind is ErrorKind.CANCELLED
