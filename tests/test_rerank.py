"""Reranking end to end on a tiny random-weight reranker GGUF (qwen3 with rank pooling and
a classifier head, as Qwen3-Reranker): the CLI, the socket, HTTP through Cohere's own
client and raw JSON in llama-server's shape; scores checked against llama.cpp's own
computation of the same pairs, one at a time."""

from __future__ import annotations

import ctypes
import json
import subprocess
from pathlib import Path

import cohere
import httpx
import pytest
from daemonhelp import EC
from httphelp import fleet_http
from tinymodel import RERANK_TEMPLATE, write_tiny_reranker

from everycycle import paths
from everycycle.client import SyncClient
from everycycle.errors import RequestFailedError

QUERY = "hello world"
DOCS = ["hello", "world the", "é✓ a", "the hello world", "a"]


@pytest.fixture(scope="module")
def rerankers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("rerankers")
    return (write_tiny_reranker(d / "rr.gguf"),
            write_tiny_reranker(d / "rrt.gguf", template=RERANK_TEMPLATE))


@pytest.fixture
def models(tmp_path: Path, tiny_gguf: Path, rerankers: tuple[Path, Path]) -> Path:
    f = tmp_path / "rerank-models.toml"
    f.write_text(f'default = "tiny"\n[models.tiny]\npath = "{tiny_gguf}"\ncontext = 512\n'
                 f'[models.rr]\npath = "{rerankers[0]}"\ncontext = 512\nparallel = 1\n'
                 f'[models.rrt]\npath = "{rerankers[1]}"\ncontext = 512\nparallel = 1\n')
    return f


def llama_scores(path: Path, pairs: list[list[int]]) -> list[float]:
    """llama.cpp's own: each pair decoded alone in a fresh rank-pooling context, its
    first classifier output."""
    import llama_cpp as L

    params = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(path).encode(), params)
    cparams = L.llama_context_default_params()
    cparams.embeddings = True
    cparams.pooling_type = L.LLAMA_POOLING_TYPE_RANK
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = 512
    ctx = L.llama_init_from_model(model, cparams)
    scores = []
    try:
        for tokens in pairs:
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
            ids = (L.llama_token * len(tokens))(*tokens)  # (kept alive through the decode)
            batch = L.llama_batch_get_one(ids, len(tokens))
            assert L.llama_decode(ctx, batch) == 0
            ptr = L.llama_get_embeddings_seq(ctx, 0)
            scores.append(float(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))[0]))
    finally:
        L.llama_free(ctx)
        L.llama_model_free(model)
    return scores


def pair_tokens(path: Path, documents: list[str]) -> list[list[int]]:
    from everycycle.engine.host.contract import LoadOptions
    from everycycle.engine.worker.runner import Runner

    runner = Runner.load(path, LoadOptions(context=512, parallel=1), lambda _: None)
    try:
        return runner.rerank_tokens(QUERY, documents)
    finally:
        runner.close()


def test_the_cli_ranks_stdin_lines_and_the_scores_are_llama_cpps(
        models: Path, rerankers: tuple[Path, Path]) -> None:
    for name, path in zip(("rr", "rrt"), rerankers, strict=True):
        out = subprocess.run([*EC, "rerank", "--models", str(models), "-m", name, QUERY],
                             input="\n".join(DOCS) + "\n\n", capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert sorted(r["index"] for r in rows) == list(range(len(DOCS)))
        assert [r["document"] for r in rows] == [DOCS[r["index"]] for r in rows]
        scores = [r["relevance_score"] for r in rows]
        assert scores == sorted(scores, reverse=True)
        own = llama_scores(path, pair_tokens(path, DOCS))
        by_index = {r["index"]: r["relevance_score"] for r in rows}
        # (Batched with the others, not alone: close, not bit-exact, on most CPUs.)
        assert [by_index[i] for i in range(len(DOCS))] == pytest.approx(own, abs=5e-3)
        assert [r["index"] for r in rows] == sorted(range(len(DOCS)), key=lambda i: -own[i])
    top = subprocess.run([*EC, "rerank", "--models", str(models), "-m", "rr", "--top-n", "2",
                          QUERY, *DOCS], capture_output=True, text=True, timeout=120,
                         check=False)
    assert top.returncode == 0 and len(top.stdout.splitlines()) == 2


def test_pairs_are_laid_out_as_llama_server_lays_them_out(rerankers: tuple[Path, Path]
                                                          ) -> None:
    plain, templated = rerankers
    (no_template,) = pair_tokens(plain, ["world"])
    # BOS, the query, EOS (this vocabulary adds BOS and EOS, no SEP), the document, EOS.
    assert no_template[0] == 1 and no_template[-1] == 2 and no_template.count(2) == 2
    (with_template,) = pair_tokens(templated, ["world"])
    assert with_template[0] == 1 and with_template.count(2) == 1  # <s>{query}</s>{document}


def test_a_daemon_ranks_over_the_socket_http_and_cohere(models: Path, spawn_daemon: object
                                                        ) -> None:
    spawn_daemon("--http", "127.0.0.1:0", models=models)  # type: ignore[operator]
    with SyncClient() as c:
        order = c.rerank("rr", QUERY, DOCS)
        assert sorted(i for i, _ in order) == list(range(len(DOCS)))
        assert c.rerank("rr", QUERY, DOCS, top_n=2) == order[:2]
        with pytest.raises(RequestFailedError, match="not a reranker"):
            c.rerank("tiny", QUERY, DOCS)
        with pytest.raises(RequestFailedError, match="is a reranker"):
            c.embed("rr", DOCS)
    url = fleet_http()
    for route in ("/v1/rerank", "/rerank", "/v1/reranking"):
        r = httpx.post(url + route, json={"model": "rr", "query": QUERY, "documents": DOCS,
                                          "top_n": 3, "return_documents": True}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [(x["index"], x["relevance_score"]) for x in body["results"]] == [
            (i, pytest.approx(s, abs=1e-6)) for i, s in order[:3]]
        assert all(x["document"]["text"] == DOCS[x["index"]] for x in body["results"])
        assert body["usage"]["prompt_tokens"] > len(DOCS)
        assert r.headers["x-request-id"] == body["id"]
    bad = httpx.post(url + "/v1/rerank", json={"model": "tiny", "query": QUERY,
                                               "documents": DOCS}, timeout=60)
    assert bad.status_code == 400 and "not a reranker" in bad.json()["error"]["message"]
    for body, says in (({"model": "rr", "documents": DOCS}, "`query`"),
                       ({"model": "rr", "query": QUERY, "documents": []}, "`documents`"),
                       ({"model": "rr", "query": QUERY, "documents": [1]}, "documents[0]"),
                       ({"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 0},
                        "`top_n`")):
        r = httpx.post(url + "/v1/rerank", json=body, timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    with httpx.Client(timeout=60) as http:  # (Cohere's clients never close their own)
        v2 = cohere.ClientV2(api_key="unused", base_url=url, httpx_client=http).rerank(
            model="rr", query=QUERY, documents=DOCS, top_n=2)
        assert [(x.index, x.relevance_score) for x in v2.results] == [
            (i, pytest.approx(s, abs=1e-6)) for i, s in order[:2]]
        v1 = cohere.Client(api_key="unused", base_url=url, httpx_client=http).rerank(
            model="rr", query=QUERY, documents=[{"text": d} for d in DOCS],
            return_documents=True)
        assert [x.index for x in v1.results] == [i for i, _ in order]
        assert v1.results[0].document is not None
        assert v1.results[0].document.text == DOCS[order[0][0]]
    audit = [json.loads(line) for line in paths.audit_file().read_text().splitlines()]
    assert any(rec["model"] == "rr" and rec.get("kind") == "rerank" for rec in audit)
