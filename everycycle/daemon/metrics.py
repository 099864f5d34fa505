"""Prometheus metrics for the daemon, written with ``prometheus-client``.

Counters and histograms are fed by the supervisor's request Outcomes (every request,
whichever listener it came through). Gauges are read from the supervisor's live
FleetSnapshot at scrape time, so ``/metrics`` and ``everycycle fleet`` always agree.
Each daemon has its own CollectorRegistry (several daemons may share a process in tests).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .events import DaemonEvent, RequestEnded, RequestState

if TYPE_CHECKING:
    from .active import Active
    from .supervisor import Outcome, Supervisor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def outcome_label(outcome: Outcome) -> str:
    """finished, cancelled, rejected, invalid, model_not_loaded or internal."""
    if outcome.kind is None:
        return "finished"
    return {"ModelNotLoaded": "model_not_loaded"}.get(outcome.kind.value,
                                                      outcome.kind.value.lower())


class _Fleet(Collector):
    """Gauges from the live fleet: read at scrape time, never cached."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        snap = self._supervisor.snapshot()
        queued = GaugeMetricFamily("everycycle_queue_depth",
                                   "Requests waiting for a slot, per model.", labels=["model"])
        busy = GaugeMetricFamily("everycycle_busy_slots", "Slots decoding, per model.",
                                 labels=["model"])
        slots = GaugeMetricFamily("everycycle_slots", "Slots per loaded model.",
                                  labels=["model"])
        loaded = GaugeMetricFamily("everycycle_loaded_models", "Models resident per executor.",
                                   labels=["executor"])
        drafted = GaugeMetricFamily(
            "everycycle_drafted_tokens",
            "Draft tokens the model verified since it was loaded, per speculative method "
            "(forced, lookup, mtp, model).", labels=["model", "method"])
        accepted = GaugeMetricFamily(
            "everycycle_draft_accepted_tokens",
            "Draft tokens the model confirmed since it was loaded, per speculative method.",
            labels=["model", "method"])
        cache_bytes = GaugeMetricFamily(
            "everycycle_prompt_cache_bytes",
            "Host RAM each model's prompt cache holds.", labels=["model"])
        cache_hits = CounterMetricFamily(
            "everycycle_prompt_cache_hits",
            "Prompts restored from the prompt cache (RAM or disk) since the model loaded.",
            labels=["model"])
        cache_evictions = CounterMetricFamily(
            "everycycle_prompt_cache_evictions",
            "Conversations the prompt cache moved out of RAM since the model loaded.",
            labels=["model"])
        lanes = GaugeMetricFamily(
            "everycycle_lane_queue_depth", "Requests waiting for a slot, per model and lane "
            "(interactive, background).", labels=["model", "lane"])
        for name, lane in sorted(self._supervisor.requests.lanes.items()):
            for kind in ("interactive", "background"):
                lanes.add_metric([name, kind], sum(a.lane == kind for a in lane.queue))
        per_executor = {e.name: 0 for e in snap.executors}
        for m in snap.loaded_models:
            if m.prompt_cache_hits is not None:
                cache_bytes.add_metric([m.name], m.prompt_cache_bytes or 0)
                cache_hits.add_metric([m.name], m.prompt_cache_hits)
                cache_evictions.add_metric([m.name], m.prompt_cache_evictions or 0)
            for d in m.drafts or ():
                drafted.add_metric([m.name, d.method], d.drafted)
                accepted.add_metric([m.name, d.method], d.accepted)
            queued.add_metric([m.name], m.queued or 0)
            busy.add_metric([m.name], m.busy or 0)
            slots.add_metric([m.name], m.slots or 0)
            per_executor[m.assigned_executor] = per_executor.get(m.assigned_executor, 0) + 1
        for name, count in per_executor.items():
            loaded.add_metric([name], count)
        active = GaugeMetricFamily("everycycle_active_requests",
                                   "Requests running or queued.", value=snap.active_requests)
        deaths = CounterMetricFamily(
            "everycycle_engine_deaths",
            "Engine processes that died unasked, by model and cause (SIGILL, SIGKILL, exit, ...).",
            labels=["model", "cause"])
        for (model, cause), count in sorted(self._supervisor.engine_deaths.items()):
            deaths.add_metric([model, cause], count)
        evictions = CounterMetricFamily(
            "everycycle_model_evictions",
            "Idle models unloaded to make room for another, by reason (memory, "
            "max_loaded_models).", labels=["reason"])
        for reason in ("memory", "max_loaded_models"):
            evictions.add_metric([reason], self._supervisor.residency.evictions.get(reason, 0))
        residency = self._supervisor.residency
        loads = CounterMetricFamily("everycycle_model_loads",
                                    "Model loads attempted.", value=residency.loads)
        waited = CounterMetricFamily(
            "everycycle_model_room_wait_seconds",
            "Seconds loads waited for memory that busy models held, by model.",
            labels=["model"])
        for model, seconds in sorted(residency.room_waits.total.items()):
            waited.add_metric([model], seconds)
        yield from (queued, lanes, busy, slots, loaded, active, drafted, accepted,
                    deaths, evictions, loads, waited,
                    cache_bytes, cache_hits, cache_evictions)


_WAITING = frozenset({RequestState.ADMITTING, RequestState.WAITING, RequestState.LOADING,
                      RequestState.QUEUED, RequestState.PARKED})


class _Vllm(Collector):
    """vLLM's names for the load a router or endpoint picker reads (the Gateway API
    Inference Extension's "model server protocol"): per model, requests waiting and
    running, KV-cache use, and the LoRA adapters in use. Read at scrape time."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[Metric]:
        sup = self._supervisor
        label = ["model_name"]
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting for a slot (admitting, queued, "
            "parked, or waiting for their model to load), per model.", labels=label)
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Requests in a slot, per model.", labels=label)
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage, 1 being all of it: the cells the "
            "running requests hold over the model's (context x slots).", labels=label)
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info", "LoRA adapters of running and waiting requests "
            "(the value: when this was read, as vLLM's).",
            labels=["model_name", "max_lora", "running_lora_adapters",
                    "waiting_lora_adapters"])
        by_model: dict[str, list[Active]] = {}
        for active in sup.requests.active.values():
            by_model.setdefault(active.model or active.req.model, []).append(active)
        now = time.time()
        for name in sorted({*sup.residency.models, *by_model}):
            actives = by_model.get(name, [])
            runs = [a for a in actives if a.state is RequestState.RUNNING]
            waiting.add_metric([name], sum(a.state in _WAITING for a in actives))
            running.add_metric([name], len(runs))
            model = sup.residency.models.get(name)
            if model is None:
                continue
            cells = model.options.context * model.options.parallel
            held = sum(min(a.n_prompt + a.n_out, model.options.context) for a in runs)
            usage.add_metric([name], held / cells if cells else 0.0)
            scales = sup.lora_scales.of(model.spec)
            names = [a.name for a in model.spec.lora]
            lora.add_metric([name, str(len(names)),
                             _adapters(runs, names, scales),
                             _adapters([a for a in actives if a.state in _WAITING], names,
                                       scales)], now)
        yield from (waiting, running, usage, lora)


def _adapters(actives: list[Active], names: list[str], scales: list[float]) -> str:
    """The adapters (comma-separated) that apply to any of ``actives``: a scale other
    than 0, the request's own where it set one."""
    used: set[int] = set()
    for active in actives:
        own = {s.id: s.scale for s in getattr(active.req, "lora", None) or ()}
        used.update(i for i, scale in enumerate(scales) if own.get(i, scale) != 0)
    return ",".join(names[i] for i in sorted(used))


class Metrics:
    """The daemon's metrics; ``observe`` is a supervisor outcome observer."""

    def __init__(self, supervisor: Supervisor) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created: noise
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("everycycle_requests", "Generate requests by outcome.",
                                ["model", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("everycycle_prompt_tokens", "Prompt tokens processed.",
                                     ["model"], registry=self.registry)
        self.cached_tokens = Counter("everycycle_cached_prompt_tokens",
                                     "Prompt tokens reused from a slot's cache.", ["model"],
                                     registry=self.registry)
        self.generated_tokens = Counter("everycycle_generated_tokens", "Tokens generated.",
                                        ["model"], registry=self.registry)
        self.ttft = Histogram("everycycle_time_to_first_token_seconds",
                              "From admission to the first generated token.", ["model"],
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.wait = Histogram("everycycle_queue_wait_seconds",
                              "From admission to a slot, per model and lane.", ["model", "lane"],
                              buckets=_WAIT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("everycycle_time_per_output_token_seconds",
                              "Mean time between a request's generated tokens.", ["model"],
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.principal_tokens = Counter(
            "everycycle_principal_tokens", "Tokens per principal (API key, or local).",
            ["principal", "kind"], registry=self.registry)
        self.rejections = Counter(
            "everycycle_rejections", "Requests rejected, per principal and limit "
            "(queue, or the quota that refused them).", ["principal", "limit"],
            registry=self.registry)
        self.tool_calls = Counter(
            "everycycle_tool_calls", "Tool calls parsed from models' output, those that "
            "did not parse (returned as text), and those whose arguments break the parts "
            "of their tool's schema the grammar did not enforce (invalid: returned as "
            "written).", ["model", "outcome"],
            registry=self.registry)
        self._supervisor = supervisor
        self.registry.register(_Fleet(supervisor))
        self.registry.register(_Vllm(supervisor))
        supervisor.bus.listen(self.on_event)

    def on_event(self, event: DaemonEvent) -> None:
        if isinstance(event, RequestEnded):
            self.observe(event.outcome)

    def observe(self, outcome: Outcome) -> None:
        model = outcome.model
        if model not in self._supervisor.registry.models and outcome.executor is None:
            model = "_unknown"  # a name a client made up: not a label of its own
        self.requests.labels(model, outcome_label(outcome)).inc()
        if outcome.tool_calls:
            self.tool_calls.labels(model, "parsed").inc(outcome.tool_calls)
        if outcome.malformed_calls:
            self.tool_calls.labels(model, "malformed").inc(outcome.malformed_calls)
        if outcome.invalid_calls:
            self.tool_calls.labels(model, "invalid").inc(outcome.invalid_calls)
        self.prompt_tokens.labels(model).inc(outcome.prompt_tokens)
        self.cached_tokens.labels(model).inc(outcome.cached_tokens)
        self.generated_tokens.labels(model).inc(outcome.generated_tokens)
        who = outcome.principal
        self.principal_tokens.labels(who, "prompt").inc(outcome.prompt_tokens)
        self.principal_tokens.labels(who, "generated").inc(outcome.generated_tokens)
        if outcome.kind is not None and outcome.kind.value == "Rejected":
            self.rejections.labels(who, outcome.limit or "capacity").inc()
        if outcome.executor is not None:  # (it reached its model)
            self.wait.labels(model, outcome.lane).observe(outcome.queue_wait_s)
        if outcome.ttft_s is not None:
            self.ttft.labels(model).observe(outcome.ttft_s)
            if outcome.generated_tokens > 1:
                per_token = (outcome.duration_s - outcome.ttft_s) / (outcome.generated_tokens - 1)
                self.tpot.labels(model).observe(per_token)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)
