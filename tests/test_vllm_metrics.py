"""The gauges routers and endpoint pickers read, under vLLM's names (the Gateway API
Inference Extension's defaults), move with load: read from ``/metrics`` with
prometheus-client's own parser while requests run and wait, and after they end."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import SpawnDaemon
from daemonhelp import wait_until
from httphelp import fleet_http, openai_client
from modelshelp import Entry, models_toml
from prometheus_client.parser import text_string_to_metric_families
from tinymodel import write_tiny_gguf, write_tiny_lora

LONG = 6000
"""Tokens each request asks for (end token banned): they run long enough to be seen
running and waiting."""


@pytest.fixture
def url(spawn_daemon: SpawnDaemon, tmp_path: Path) -> str:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    adapter = write_tiny_lora(tmp_path / "adapter.gguf")
    models = models_toml(tmp_path / "models.toml", Entry(
        "tuned", model, context=8192, parallel=2,
        more={"lora": [{"path": str(adapter), "scale": 0.0}]}), default="tuned")
    spawn_daemon("--http", "127.0.0.1:0", models=models)
    return fleet_http()


def gauges(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The ``vllm:`` samples of /metrics, by name: (labels, value)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def value(found: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    (labels, v), = found[name]
    assert labels["model_name"] == "tuned", labels
    return v


def in_flight(url: str) -> float:
    found = gauges(url)
    return sum(value(found, g) for g in ("vllm:num_requests_running",
                                         "vllm:num_requests_waiting"))


def _long(url: str, lora: float, done: list[Any]) -> None:
    client = openai_client(url, timeout=120)
    answer = client.chat.completions.create(
        model="tuned", messages=[{"role": "user", "content": "x"}], max_tokens=LONG,
        temperature=1.0, logit_bias={"2": -100},
        extra_body={"lora": [{"id": 0, "scale": lora}]})
    done.append(answer.usage.completion_tokens if answer.usage else None)


def test_the_vllm_gauges_move_with_load(url: str) -> None:
    httpx.post(f"{url}/v1/models/tuned/load", timeout=60).raise_for_status()
    idle = gauges(url)
    assert set(idle) == {"vllm:num_requests_waiting", "vllm:num_requests_running",
                         "vllm:kv_cache_usage_perc", "vllm:lora_requests_info"}
    assert value(idle, "vllm:num_requests_running") == 0
    assert value(idle, "vllm:num_requests_waiting") == 0
    assert value(idle, "vllm:kv_cache_usage_perc") == 0
    (labels, _), = idle["vllm:lora_requests_info"]
    assert labels == {"model_name": "tuned", "max_lora": "1", "running_lora_adapters": "",
                      "waiting_lora_adapters": ""}
    done: list[Any] = []
    # Two slots: the adapter's request and a base one run; a third (adapter) waits.
    threads = [threading.Thread(target=_long, args=(url, scale, done))
               for scale in (1.0, 0.0, 1.0)]
    for n, t in enumerate(threads, 1):
        t.start()
        wait_until(lambda n=n: in_flight(url) == n, "the request to arrive")
    busy = gauges(url)
    assert value(busy, "vllm:num_requests_running") == 2
    assert value(busy, "vllm:num_requests_waiting") == 1
    (labels, stamp), = busy["vllm:lora_requests_info"]
    assert labels["running_lora_adapters"] == "adapter.gguf"
    assert labels["waiting_lora_adapters"] == "adapter.gguf" and stamp > 1.7e9
    used = value(busy, "vllm:kv_cache_usage_perc")
    assert 0 < used < 1
    wait_until(lambda: value(gauges(url), "vllm:kv_cache_usage_perc") > used,
               "the KV use to grow as they decode")
    for t in threads:
        t.join(120)
    assert done == [LONG] * 3
    after = gauges(url)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
