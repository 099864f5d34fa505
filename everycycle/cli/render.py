"""Rich views: the fleet, the executors seen without a daemon, the model registry.

Every table the CLI prints is built here; callers print it on stderr or a terminal.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..protocol import Accepted, FleetSnapshot, LoadedModel

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


def _duration(ms: int) -> str:
    seconds = ms // 1000
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def queued_line(event: Accepted) -> str:
    """``queued: position 2, about 14 s``: a waiting request's status line."""
    line = f"queued: position {event.queue_position}"
    if event.eta_ms is not None:
        line += f", about {max(1, round(event.eta_ms / 1000))} s"
    return line


def _compact(ms: int) -> str:
    """``5m``, ``1h``, ``90s``: a keep-alive as one writes it."""
    text = _duration(ms)
    return text.removesuffix("00s").removesuffix("00m") if text[-3:] in ("00s", "00m") else text


def _idle_unload(unload_in_ms: int | None, keep_alive_ms: int | None) -> str:
    """``in 4m12s`` when idle; ``never``; while busy, ``5m idle``: when it will go once
    idle."""
    if unload_in_ms is not None:
        return f"in {_duration(unload_in_ms)}"
    if keep_alive_ms is None:
        return "-"
    if keep_alive_ms < 0:
        return "never"
    return f"{_compact(keep_alive_ms)} idle"


def _revision(rev: str | None) -> str:
    """A hub commit as git abbreviates it (12 hex digits); anything else as is."""
    if rev and len(rev) == 40 and all(c in "0123456789abcdef" for c in rev):
        return rev[:12]
    return rev or "-"


def _engine_line(m: LoadedModel) -> str:
    """``engine smollm2-135m: pid 4242, 180 MiB; context 8,192 a slot; restarted 2x``,
    and the last death on a line of its own."""
    parts = []
    if m.state == "failed":
        parts.append(f"FAILED (`everycycle load {m.name}` tries again)")
    elif m.state == "restarting":
        parts.append("restarting")
    elif m.engine_pid is not None:
        parts.append(f"pid {m.engine_pid}" + (f", {_mib(m.engine_rss)}" if m.engine_rss else ""))
    elif not m.context:
        return ""
    if m.context:
        parts.append(f"context {m.context:,} a slot")
    if m.engine_restarts:
        parts.append(f"restarted {m.engine_restarts}x")
    line = f"engine {m.name}: " + "; ".join(parts)
    if m.engine_exit:  # on a line of its own: a cause can be long
        line += f"\n  last died: {m.engine_exit}"
    return line


def fleet_view(snapshot: FleetSnapshot) -> Group:
    """Tables of executors, loaded models and request counts."""
    from rich.console import Group
    from rich.table import Table

    ex = Table(title=f"executors on {snapshot.hostname}", title_justify="left")
    for col in ("name", "vendor", "devices", "memory free / total"):
        ex.add_column(col)
    for e in snapshot.executors:
        memory = (e.status if e.status else
                  f"{_size(e.memory_free)} / {_size(e.memory_total)}")
        ex.add_row(e.name, e.vendor, str(e.device_count), memory)
    notes = []
    if not any(e.name != "cpu" for e in snapshot.executors):
        notes.append("no GPU backend in this llama.cpp build")
    if snapshot.rpc is False:
        notes.append("no RPC backend (needs -DGGML_RPC=on)")
    if notes:
        ex.caption = "\n".join(notes)
    models = Table(title="loaded models", title_justify="left")
    for col in ("name", "revision", "executor", "busy", "weights+KV", "unload"):
        models.add_column(col, no_wrap=True)
    for m in snapshot.loaded_models:
        slots = f"{m.busy}/{m.slots}" if m.slots is not None else "-"
        if m.queued:
            slots += f" +{m.queued}"
        where = m.assigned_executor
        if m.device_layers is not None and m.total_layers is not None:
            where += f" {m.device_layers}/{m.total_layers}"
        models.add_row(m.name, _revision(m.revision), where, slots,
                       _weights_kv(m.weights_bytes, m.kv_bytes),
                       "busy" if m.busy or m.queued  # (not unloaded while it has work)
                       else _idle_unload(m.unload_in_ms, m.keep_alive_ms))
    notes = []
    if any(m.queued for m in snapshot.loaded_models):
        notes.append("busy: slots decoding / slots, +queued")
    if any(m.device_layers is not None for m in snapshot.loaded_models):
        notes.append("executor: layers on its devices / layers")
    models.caption = "none" if not snapshot.loaded_models else "; ".join(notes) or None
    footer = f"active requests: {snapshot.active_requests}"
    if snapshot.state not in (None, "ready"):
        footer += f"; {snapshot.state}" + (
            " (takes no new requests; stops once these end)" if snapshot.state == "draining"
            else "")
    requests = None
    if snapshot.requests:
        requests = Table(title="active requests", title_justify="left", box=None,
                         pad_edge=False, header_style="bold underline")
        for col in ("id", "model", "who", "state", "age", "tok"):
            requests.add_column(col, no_wrap=True, justify="right" if col == "tok" else "left")
        for r in snapshot.requests:
            # (a waiting request's expected start says more than its age)
            requests.add_row(r.request_id, r.model, r.principal,
                             r.state + (" bg" if r.lane == "background" else ""),
                             _duration(r.age_ms) if r.eta_ms is None
                             else f"~{_duration(r.eta_ms)}", str(r.tokens))
        requests.caption = "`everycycle cancel ID` stops one" + (
            "; bg: background lane; ~: starts in" if any(
                r.lane == "background" or r.eta_ms is not None for r in snapshot.requests)
            else "")
    engines = [_engine_line(m) for m in snapshot.loaded_models]
    if any(engines):
        footer = "\n".join(e for e in engines if e) + "\n" + footer
    off = [f"{m.name} off" for m in snapshot.loaded_models if m.lookup is False]
    if off:
        footer = "prompt lookup: " + ", ".join(off) + "\n" + footer
    drafts = [f"{m.name} {d.method} {d.accepted}/{d.drafted} drafted tokens accepted "
              f"({100 * d.accepted // d.drafted}%)"
              for m in snapshot.loaded_models for d in m.drafts or () if d.drafted]
    if drafts:
        footer = "drafts: " + ", ".join(drafts) + "\n" + footer
    pairs = [f"{m.name} by {m.draft_model}" for m in snapshot.loaded_models if m.draft_model]
    if pairs:
        footer = "draft models: " + ", ".join(pairs) + "\n" + footer
    caches = [f"{m.name} {_mib(m.prompt_cache_bytes or 0)} in RAM, "
              f"{m.prompt_cache_hits or 0} restored, {m.prompt_cache_evictions or 0} evicted"
              for m in snapshot.loaded_models if m.prompt_cache_hits is not None]
    if caches:
        footer = "prompt cache: " + ", ".join(caches) + "\n" + footer
    if snapshot.principals:
        footer += " (" + ", ".join(f"{p.name} {p.active_requests}"
                                   for p in snapshot.principals) + ")"
    if snapshot.daemon_rss is not None:
        footer += f"   daemon memory (RSS): {_mib(snapshot.daemon_rss)}"
    if snapshot.http:
        footer += f"\nHTTP API: {snapshot.http}/v1"
    if snapshot.cpu_kernels:
        footer += f"\n{snapshot.cpu_kernels}"
    if snapshot.last_eviction:
        footer += f"\n{snapshot.last_eviction}"
    return Group(ex, models, *([requests] if requests is not None else []), footer)


def local_executors_view(executors: Iterable[Any]) -> Table:
    """The executors this machine offers, discovered without a daemon."""
    from rich.table import Table

    table = Table(title="executors on this machine (no daemon)", title_justify="left")
    for col in ("name", "vendor", "devices"):
        table.add_column(col)
    for e in executors:
        table.add_row(e.name, e.vendor, str(len(e.devices)))
    return table


def models_view(rows: Sequence[dict[str, Any]], note: str | None = None, *,
                wide: bool = False) -> Table:
    """The registry, one row per model (the rows ``everycycle models --json`` prints);
    ``note``: a line on how models load here (the CPU kernels' verdict). It reads whole
    at 80 columns; ``wide`` adds where each comes from and its revision."""
    from rich.table import Table

    table = Table(title="models", title_justify="left")
    table.add_column("name", no_wrap=True)
    cols = ["kind", *(["source", "revision"] if wide else []), "on disk", "ctx×slots",
            "weights+KV"]
    for col in cols:
        folded = col in ("source", "revision")
        table.add_column(col, no_wrap=not folded, overflow="fold" if folded else "ellipsis")
    for r in rows:
        mark = " *" if r["default"] else ""
        where = [r["source"], _revision(r["revision"])] if wide else []
        table.add_row(f"{r['name']}{mark}", r["kind"], *where,
                      "yes" if r["available"] else "no",
                      f"{r['context'] or 'auto'}{'*' if r.get('context_auto') else ''}"
                      f"×{r['parallel']}",
                      _weights_kv(r.get("weights_bytes"), r.get("kv_bytes")))
    table.caption = ("* the default model; ctx*: chosen at load (here, on the CPU)"
                     + ("" if wide else "; --wide: source, revision")
                     + (f"\n{note}" if note else ""))
    return table


def keys_view(rows: Sequence[dict[str, Any]]) -> Table:
    """API keys: name, when made, limits (the rows ``everycycle keys list --json`` prints)."""
    import datetime as dt

    from rich.table import Table

    table = Table(title="API keys", title_justify="left")
    for col in ("name", "created", "limits"):
        table.add_column(col)
    for r in rows:
        made = dt.datetime.fromtimestamp(r["created"]).astimezone().strftime("%Y-%m-%d %H:%M")
        table.add_row(r["name"], made, r["describe"])
    if not rows:
        table.caption = "none: add one with `everycycle keys add NAME`"
    return table


def _count(n: int) -> str:
    """``9,999``, ``12.3k``, ``1.23M``: a count that fits its column."""
    if n < 10_000:
        return f"{n:,}"
    if n < 1_000_000:
        return f"{n / 1000:.1f}k"
    return f"{n / 1_000_000:.2f}M"


def usage_view(rows: Sequence[Any], by: str) -> Table:
    """``everycycle usage``: one row per key, model or day, and a total."""
    from rich.table import Table

    table = Table(title=f"usage by {by}", title_justify="left")
    table.add_column(by, no_wrap=True)
    for col in ("reqs", "done", "cancel", "reject", "fail", "in", "out"):
        table.add_column(col, justify="right", no_wrap=True)
    fields = ("requests", "finished", "cancelled", "rejected", "failed", "prompt_tokens",
              "generated_tokens")
    for r in rows:
        table.add_row(r.group, *(_count(getattr(r, f)) for f in fields))
    if len(rows) > 1:
        table.add_section()
        table.add_row("total", *(_count(sum(getattr(r, f) for r in rows)) for f in fields))
    table.caption = "tokens: prompt in, generated out (--json: exact counts)"
    if not rows:
        table.caption = "no requests in the audit log for this period"
    return table


def fleets_view(found: Sequence[tuple[str, FleetSnapshot]], unreachable: Sequence[str]
                ) -> Group:
    """``fleet --host …``: each daemon's state, one section per daemon, then the total."""
    from rich.console import Group
    from rich.rule import Rule
    from rich.table import Table

    states = Table(title="daemons", title_justify="left")
    for col in ("host", "name", "state", "active"):
        states.add_column(col, no_wrap=True)
    for host, snap in found:
        states.add_row(host, snap.hostname, snap.state or "ready", str(snap.active_requests))
    for host in unreachable:
        states.add_row(host, "-", "unreachable", "-")
    parts: list[Any] = [states] if found else []  # (none reached: the errors said why)
    for host, snap in found:
        parts.append(Rule(f"{host} ({snap.hostname}, {snap.state or 'ready'})", align="left"))
        parts.append(fleet_view(snap))
    executors = sum(len(s.executors) for _, s in found)
    models = sum(len(s.loaded_models) for _, s in found)
    active = sum(s.active_requests for _, s in found)
    total = (f"total: {len(found)} daemons, {executors} executors, {models} loaded models, "
             f"{active} active requests")
    if unreachable:
        total += f"; {len(unreachable)} unreachable"
    parts.append(Rule())
    parts.append(total)
    return Group(*parts)


def mcp_servers_view(rows: Sequence[tuple[str, str, str | None]]) -> Table:
    """MCP servers (mcp.json): name, command, and why one cannot run here."""
    from rich.table import Table

    table = Table(title="MCP servers", title_justify="left")
    for col in ("name", "command", "note"):
        table.add_column(col)
    for name, command, problem in rows:
        table.add_row(name, command, problem or "")
    if not rows:
        table.caption = "none: add one with `everycycle mcp add NAME -- COMMAND ARGS…`"
    return table


def mcp_tools_view(rows: Sequence[tuple[str, str, str]]) -> Table:
    """MCP tools: the name the model calls, its server, the first line of its description."""
    from rich.table import Table

    table = Table(title="MCP tools", title_justify="left")
    for col in ("tool", "server", "description"):
        table.add_column(col)
    for name, server, description in rows:
        table.add_row(name, server, description.strip().split("\n")[0][:100])
    if not rows:
        table.caption = "none"
    return table


def conversations_view(rows: Sequence[tuple[str, float, str, int, str]]) -> Table:
    """Saved chats: id, when last updated, model, messages, the first question."""
    import datetime as dt

    from rich.table import Table

    table = Table(title="Conversations", title_justify="left")
    for col in ("id", "updated", "model", "messages", "begins"):
        table.add_column(col)
    for cid, updated, model, n, title in rows:
        when = dt.datetime.fromtimestamp(updated).astimezone().strftime("%Y-%m-%d %H:%M")
        table.add_row(cid, when, model, str(n), title)
    table.caption = ("none yet: each chat is saved as it goes" if not rows else
                     "`everycycle chat --resume-id ID` carries one on")
    return table
