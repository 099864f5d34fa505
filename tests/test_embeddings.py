"""Embeddings through the real daemon, embedded mode, HTTP, and against llama.cpp's own
``Llama(embedding=True).embed``."""

from __future__ import annotations

import base64
import gc
import json
import struct
import subprocess
import warnings
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import SpawnDaemon
from daemonhelp import EC, Raw, accepted, running_daemon
from httphelp import openai_client

from everycycle.client import SyncClient, connect, embedded
from everycycle.errors import ErrorKind
from everycycle.models.registry import load_registry, local_file
from everycycle.protocol import Embed, Embeddings, Error, Generate, encode

pytestmark = pytest.mark.anyio

TEXTS = ["hello world", "the world", "a hello", "é ✓ hello"]


def llama_cpp_vectors(path: Path, texts: list[str]) -> np.ndarray:
    """llama.cpp's own embeddings, mean-pooled where the model declares no pooling."""
    from llama_cpp import LLAMA_POOLING_TYPE_MEAN, Llama

    # as the daemon's embeddings context: 2,048-token batches, flash attention as
    # llama.cpp chooses by default (on for these CPU models)
    opts = {"embedding": True, "verbose": False, "n_ctx": 2048, "n_batch": 2048,
            "n_ubatch": 2048, "n_threads": 2, "flash_attn": True}
    llm = Llama(model_path=str(path), **opts)
    if llm.pooling_type() == 0:
        llm.close()
        llm = Llama(model_path=str(path), pooling_type=LLAMA_POOLING_TYPE_MEAN, **opts)
    out = np.array(llm.embed(texts, normalize=True), dtype=np.float64)
    llm.close()
    del llm
    with warnings.catch_warnings():  # llama-cpp-python leaves /dev/null handles to the GC
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    return out


def assert_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    cos = np.sum(ours * theirs, axis=1) / (np.linalg.norm(ours, axis=1)
                                            * np.linalg.norm(theirs, axis=1))
    assert cos.min() >= 0.9999, cos
    assert np.abs(ours - theirs).max() <= 1e-4


async def test_daemon_embedded_and_llama_cpp_agree(models_file: Path, tiny_gguf: Path) -> None:
    async with running_daemon(models_file), connect() as client:
        via_daemon = np.array(await client.embed("tiny", TEXTS))
    async with embedded(models_file) as local:
        in_process = np.array(await local.embed("tiny", TEXTS))
    assert_close(via_daemon, in_process)
    assert_close(via_daemon, llama_cpp_vectors(tiny_gguf, TEXTS))
    assert np.allclose(np.linalg.norm(via_daemon, axis=1), 1.0)


@pytest.mark.shipped
async def test_the_default_model_agrees_with_llama_cpp() -> None:
    reg = load_registry()
    path = local_file(reg.get(reg.default_name()))
    texts = ["The cat sat on the mat.", "Stock markets fell today.", "A kitten rests on a rug."]
    async with embedded() as local:
        ours = np.array(await local.embed(reg.default_name(), texts))
    assert_close(ours, llama_cpp_vectors(path, texts))
    # and the vectors mean something: the two cat sentences are closest
    assert ours[0] @ ours[2] > ours[0] @ ours[1]


async def test_a_hundred_inputs_come_back_in_order(models_file: Path) -> None:
    texts = [f"text number {i} " + "hello " * (i % 7) for i in range(100)]
    async with running_daemon(models_file), connect() as client:
        together = np.array(await client.embed("tiny4", texts))
        alone = np.array([(await client.embed("tiny4", [t]))[0] for t in texts[::10]])
    assert together.shape[0] == 100
    # batch composition moves float32 sums a little (3e-4 here), never the direction
    sims = together[::10] @ alone.T
    assert np.diag(sims).min() >= 0.9999
    assert (sims.argmax(axis=1) == np.arange(10)).all()  # each in its own place


async def test_empty_and_overlong_inputs_are_invalid(models_file: Path) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(b'{"Embed":{"request_id":"e0","model":"tiny","input":[]}}')
        ev = await c.next()
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID
        assert "at least one string" in ev.message
        await c.send(encode(Embed("e1", "tiny", ("ok", "hello " * 3000))))
        ev = (await c.until_terminal("e1"))[-1]
        assert isinstance(ev, Error) and ev.kind is ErrorKind.INVALID
        assert "input[1] is" in ev.message and "at most 2048" in ev.message
        await c.send(encode(Embed("e2", "nope", ("x",))))
        ev = await c.next()
        assert isinstance(ev, Error) and "unknown model" in ev.message


async def test_embeddings_queue_behind_a_busy_model_with_deadlines_and_cancel(
    models_file: Path,
) -> None:
    async with running_daemon(models_file), Raw.open() as c:
        await c.send(encode(Generate("long", "tiny", "x", max_tokens=8000, temperature=1.0)))
        assert await c.next() == accepted("long", 0)
        await c.send(encode(Embed("late", "tiny", ("hello",), deadline_ms=50)))
        events = await c.until_terminal("late")
        assert events[0] == accepted("late", 1)  # the model's one slot is busy
        assert isinstance(events[-1], Error) and events[-1].kind is ErrorKind.CANCELLED
        assert events[-1].message == "deadline of 50 ms passed"
        await c.send(encode(Embed("e", "tiny", ("hello",))))
        assert await c.next_for("e") == accepted("e", 1)
        await c.send(b'{"Cancel":{"request_id":"c","target":"e"}}')
        events = await c.until_terminal("e")
        assert isinstance(events[-1], Error) and events[-1].kind is ErrorKind.CANCELLED
        await c.send(encode(Embed("e2", "tiny", ("hello",))))
        assert await c.next_for("e2") == accepted("e2", 1)
        await c.send(b'{"Cancel":{"request_id":"c2","target":"long"}}')
        events = await c.until_terminal("e2")
        assert events[0] == accepted("e2", 0) and isinstance(events[-1], Embeddings)


def test_cli_embed_prints_json_lines(models_file: Path) -> None:
    out = subprocess.run([*EC, "embed", "--no-daemon", "--models", str(models_file)],
                         input="hello world\n\nthe world\n", capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1]
    assert abs(np.linalg.norm(rows[0]["embedding"]) - 1) < 1e-6


def test_http_embeddings_float_and_base64(
    request: pytest.FixtureRequest, spawn_daemon: SpawnDaemon,
) -> None:
    spawn_daemon("--http", "127.0.0.1:0")
    with SyncClient() as c:
        url = c.describe_fleet().http
        direct = np.array(c.embed("tiny", TEXTS))
    client = openai_client(url, "x")
    request.addfinalizer(client.close)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2, 3]
    assert np.abs(np.array([d.embedding for d in floats.data]) - direct).max() <= 1e-6
    assert floats.usage.prompt_tokens > 0
    packed = client.embeddings.create(model="tiny", input="hello world")  # base64 by default
    assert np.abs(np.array(packed.data[0].embedding) - direct[0]).max() <= 1e-6
    import http.client

    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/embeddings", body=json.dumps(
        {"model": "tiny", "input": "hello world", "encoding_format": "base64"}))
    raw = json.loads(conn.getresponse().read())
    conn.close()
    data = base64.b64decode(raw["data"][0]["embedding"])
    vec = np.array(struct.unpack(f"<{len(data) // 4}f", data))
    assert np.abs(vec - direct[0]).max() <= 1e-6
    with pytest.raises(openai.BadRequestError, match="token arrays"):
        client.embeddings.create(model="tiny", input=[[1, 2, 3]])
