"""`fleet`, `models` and `usage` read whole at 80 columns, with realistic data: no header
or cell cut to "…", nothing wrapped onto a second line."""

from __future__ import annotations

import os
import time
from typing import Any

from rich.console import Console

from everycycle.cli.render import fleet_view, models_view, usage_view
from everycycle.daemon.residency.room import Eviction
from everycycle.daemon.usage import UsageRow
from everycycle.protocol import (
    ActiveRequest,
    ExecutorSummary,
    FleetSnapshot,
    LoadedModel,
)

GIB = 2**30
MIB = 2**20


def render(view: Any) -> str:
    with open(os.devnull, "w") as sink:
        console = Console(width=80, record=True, file=sink)
        console.print(view)
    return console.export_text()


def whole(text: str, cells: list[str]) -> None:
    assert "…" not in text, text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    for cell in cells:
        assert any(cell in line for line in text.splitlines()), (cell, text)


def test_fleet_at_80_columns() -> None:
    snap = FleetSnapshot(
        hostname="laptop",
        executors=(ExecutorSummary("cuda", "NVIDIA", 1, 24 * GIB, 20 * GIB),
                   ExecutorSummary("cpu", "AMD", 1, 64 * GIB, 40 * GIB)),
        loaded_models=(
            LoadedModel("smollm2-135m", "pypi-0.1.2", "cpu", slots=4, busy=4, queued=2,
                        weights_bytes=92 * MIB, kv_bytes=360 * MIB, keep_alive_ms=300_000,
                        engine_pid=4242, engine_rss=528 * MIB, context=8192),
            LoadedModel("qwen2.5-0.5b", "a" * 40, "cuda", slots=4, busy=0, queued=0,
                        weights_bytes=380 * MIB, kv_bytes=1536 * MIB, device_layers=24,
                        total_layers=24, unload_in_ms=299_000, keep_alive_ms=300_000,
                        engine_pid=4243, engine_rss=900 * MIB, engine_restarts=1,
                        engine_exit="SIGSEGV (segmentation fault)"),
        ),
        active_requests=6,
        requests=(ActiveRequest("0e027cbc1e344af7ba61dcc091e0f280", "smollm2-135m", "local",
                                "running", 12_000, 310, "interactive"),
                  ActiveRequest("5d41402abc4b2a76b9719d911017c592", "smollm2-135m", "ci-bot",
                                "queued", 3_000, 0, "background", 65_000)),
        daemon_rss=37 * MIB,
        last_eviction=Eviction("gemma-3-270m", "qwen2.5-0.5b", "max_loaded_models", 312.4,
                               time.time()).describe(),
    )
    text = render(fleet_view(snap))
    assert "idle" not in text.split("qwen2.5-0.5b")[0].splitlines()[-1]  # busy is not idle
    whole(text, ["smollm2-135m", "pypi-0.1.2", "aaaaaaaaaaaa", "cuda 24/24", "4/4 +2",
                 "busy", "in 4m59s", "92+360 MiB", "0e027cbc1e344af7ba61dcc091e0f280",
                 "context 8,192 a slot",
                 "running", "queued bg  ~1m05s", "bg: background lane; ~: starts in",
                 "last died: SIGSEGV (segmentation fault)",
                 "last eviction: 'gemma-3-270m' for 'qwen2.5-0.5b' at ",
                 "(max_loaded_models)"])


def test_models_at_80_columns() -> None:
    rows = [{"name": "smollm2-135m", "default": True, "kind": "chat", "source": "pip:x",
             "revision": "pypi-0.1.2", "available": True, "context": 4096, "parallel": 4,
             "weights_bytes": 94 * MIB, "kv_bytes": 360 * MIB},
            {"name": "gemma-3-270m", "default": False, "kind": "completion",
             "source": "pip:gemma3", "revision": "pypi-1.0.0", "available": True,
             "context": 32768, "parallel": 16, "weights_bytes": 241 * MIB,
             "kv_bytes": 18432 * MIB}]
    whole(render(models_view(rows)), ["smollm2-135m *", "completion", "32768×16",
                                      "241+18,432 MiB", "--wide"])


def test_usage_at_80_columns() -> None:
    rows = [UsageRow("smollm2-135m", 12_345, 12_000, 300, 40, 5, 1_234_567, 9_876_543),
            UsageRow("gemma-3-270m", 99, 90, 9, 0, 0, 40_000, 12_000)]
    whole(render(usage_view(rows, "model")),
          ["reqs", "cancel", "reject", "12.3k", "1.23M", "9.88M", "total"])
