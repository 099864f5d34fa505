"""Rich views of a FleetSnapshot and of the model registry (stderr or a terminal only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .protocol import FleetSnapshot

if TYPE_CHECKING:
    from rich.console import Group


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / (1 << 30):.1f} GiB"


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
    for col in ("name", "revision", "executor", "slots busy/total", "queued"):
        models.add_column(col)
    for m in snapshot.loaded_models:
        slots = f"{m.busy}/{m.slots}" if m.slots is not None else "-"
        models.add_row(m.name, m.revision or "-", m.assigned_executor, slots,
                       str(m.queued if m.queued is not None else "-"))
    if not snapshot.loaded_models:
        models.caption = "none"
    return Group(ex, models, f"active requests: {snapshot.active_requests}")
