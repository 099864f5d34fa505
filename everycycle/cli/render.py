"""Rich views: the fleet, the executors seen without a daemon, the model registry.

Every table the CLI prints is built here; callers print it on stderr or a terminal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..protocol import FleetSnapshot

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / (1 << 30):.1f} GiB"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):,.0f} MiB"


def _weights_kv(weights: int | None, kv: int | None) -> str:
    """``92+360 MiB``: weights plus KV cache, compact enough for an 80-column table."""
    if weights is None or kv is None:
        return "-"
    return f"{weights / (1 << 20):,.0f}+{kv / (1 << 20):,.0f} MiB"


def fleet_view(snapshot: FleetSnapshot) -> Group:
    """Tables of executors, loaded models and request counts."""
    from rich.console import Group
    from rich.table import Table

    ex = Table(title=f"executors on {snapshot.hostname}", title_justify="left")
    for col in ("name", "vendor", "devices", "memory free / total"):
        ex.add_column(col)
    for e in snapshot.executors:
        ex.add_row(e.name, e.vendor, str(e.device_count),
                   f"{_size(e.memory_free)} / {_size(e.memory_total)}")
    if not any(e.name != "cpu" for e in snapshot.executors):
        ex.caption = "no GPU backend in this llama.cpp build"
    models = Table(title="loaded models", title_justify="left")
    for col in ("name", "revision", "executor", "slots busy/total", "queued",
                "weights+KV"):
        models.add_column(col)
    for m in snapshot.loaded_models:
        slots = f"{m.busy}/{m.slots}" if m.slots is not None else "-"
        models.add_row(m.name, m.revision or "-", m.assigned_executor, slots,
                       str(m.queued if m.queued is not None else "-"),
                       _weights_kv(m.weights_bytes, m.kv_bytes))
    if not snapshot.loaded_models:
        models.caption = "none"
    footer = f"active requests: {snapshot.active_requests}"
    if snapshot.daemon_rss is not None:
        footer += f"   daemon memory (RSS): {_mib(snapshot.daemon_rss)}"
    if snapshot.http:
        footer += f"\nHTTP API: {snapshot.http}/v1"
    return Group(ex, models, footer)


def local_executors_view(executors: Iterable[Any]) -> Table:
    """The executors this machine offers, discovered without a daemon."""
    from rich.table import Table

    table = Table(title="executors on this machine (no daemon)", title_justify="left")
    for col in ("name", "vendor", "devices"):
        table.add_column(col)
    for e in executors:
        table.add_row(e.name, e.vendor, str(len(e.devices)))
    return table


def models_view(rows: Sequence[dict[str, Any]]) -> Table:
    """The registry, one row per model (the rows ``everycycle models --json`` prints)."""
    from rich.table import Table

    table = Table(title="models", title_justify="left")
    table.add_column("name", no_wrap=True)
    for col in ("kind", "source", "revision", "on disk", "ctx x slots", "weights+KV"):
        table.add_column(col)
    for r in rows:
        mark = " *" if r["default"] else ""
        table.add_row(f"{r['name']}{mark}", r["kind"], r["source"], r["revision"] or "-",
                      "yes" if r["available"] else "no", f"{r['context']} x {r['parallel']}",
                      _weights_kv(r.get("weights_bytes"), r.get("kv_bytes")))
    table.caption = "* the default model"
    return table
