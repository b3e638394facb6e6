"""Prometheus metrics of the gateway, labelled by tenant and model.

A finished request appends one tuple to a list (``request_done``); ``flush`` turns the
list into metric updates, aggregated per label set, at most a second later (and right
before this process renders ``/metrics``), so the request path pays neither Prometheus'
per-update locking nor, in multiprocess mode, its file writes. In-flight counts are plain
integers set on the gauge at each flush. With several worker processes,
``PROMETHEUS_MULTIPROC_DIR`` (set by config/gunicorn.py) lets ``/metrics`` sum them all.
"""

import os
from bisect import bisect_left
from collections import defaultdict
from typing import Any

import orjson
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter(
    "tollgate_requests_total",
    "Requests through the gateway.",
    ["tenant", "model", "endpoint", "status"],
)
TOKENS = Counter("tollgate_tokens_total", "Tokens billed.", ["tenant", "model", "kind"])
REJECTIONS = Counter(
    "tollgate_rejections_total", "Requests refused before reaching an engine.", ["tenant", "reason"]
)
PREEMPTIONS = Counter(
    "tollgate_preemptions_total",
    "Requests whose engine slot the gateway gave to a higher class (resumed later).",
    ["model", "priority"],
)
PREEMPTION_EFFECTIVE = Gauge(
    "tollgate_admission_preemption_effective",
    "Does the gateway's preemption free an engine slot on this model: 1 yes, 0 no (the "
    "engines finish the requests it aborts, so it is paused), -1 not judged yet.",
    ["model"],
    multiprocess_mode="livemostrecent",
)
LATENCY = Histogram(
    "tollgate_request_duration_seconds",
    "Time from request to last byte.",
    ["tenant", "model"],
    buckets=LATENCY_BUCKETS,
)
TTFT = Histogram(
    "tollgate_time_to_first_token_seconds",
    "Time from request to first streamed token.",
    ["tenant", "model"],
    buckets=LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge(
    "tollgate_in_flight_requests",
    "Requests being served, per model.",
    ["model"],
    multiprocess_mode="livesum",
)
QUEUE_DEPTH = Gauge(
    "tollgate_queue_depth",
    "Requests waiting for an engine slot.",
    ["priority", "tenant"],
    multiprocess_mode="livesum",
)
QUEUE_WAIT = Histogram(
    "tollgate_queue_wait_seconds",
    "Time requests waited for an engine slot.",
    ["priority", "tenant"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
ADAPTER_LOADS = Counter(
    "tollgate_adapter_loads_requested_total",
    "Loads of a LoRA adapter into an engine replica the gateway asked a worker for.",
    ["model"],
)
ADAPTER_WAIT = Histogram(
    "tollgate_adapter_load_wait_seconds",
    "Time requests waited for their LoRA adapter to be loaded into an engine.",
    ["model"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
DEMAND_STARTS = Counter(
    "tollgate_demand_starts_requested_total",
    "Starts of an on-demand deployment the gateway asked a worker for.",
    ["model"],
)
DEMAND_WAITS = Counter(
    "tollgate_demand_waits_total",
    "Requests that waited for an on-demand model to start, by how the wait ended "
    "(ready, timeout, failed).",
    ["model", "outcome"],
)
DEMAND_WAITING = Gauge(
    "tollgate_demand_waiting_requests",
    "Requests waiting now for an on-demand model to start.",
    ["model"],
    multiprocess_mode="livesum",
)
DEMAND_WAIT = Histogram(
    "tollgate_demand_wait_seconds",
    "Time requests waited for an on-demand model to start.",
    ["model"],
    buckets=(0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 180, 300, 450, 600, 900),
)
UPSTREAM_ERRORS = Counter(
    "tollgate_upstream_errors_total", "Engine failures seen by the gateway.", ["model", "kind"]
)


_children: dict[tuple, object] = {}


def child(metric: object, *labels: str) -> Any:
    """``metric.labels(*labels)``, remembered: ``labels()`` validates and locks on every
    call, and a request updates seven series. (The gateway never removes a series, so a
    remembered child stays the registered one.)"""
    try:
        return _children[metric, labels]
    except KeyError:
        found = _children[metric, labels] = metric.labels(*labels)
        return found


FLUSH_SECONDS = 1.0

# (tenant, model, endpoint, status, latency s, ttft s or None, prompt tokens, completion tokens)
_done: list[tuple] = []
in_flight: dict[str, int] = defaultdict(int)  # served model name -> requests at an engine now
_in_flight_shown: dict[str, int] = {}


def request_done(
    tenant: str,
    model: str,
    endpoint: str,
    status: str,
    latency: float,
    ttft: float | None,
    prompt: int,
    completion: int,
) -> None:
    _done.append((tenant, model, endpoint, status, latency, ttft, prompt, completion))


def flush() -> None:
    """Apply what finished since the last flush to the Prometheus metrics."""
    global _done
    batch, _done = _done, []
    requests: dict[tuple, int] = defaultdict(int)
    tokens: dict[tuple, int] = defaultdict(int)
    latencies: dict[tuple, list[float]] = defaultdict(list)
    ttfts: dict[tuple, list[float]] = defaultdict(list)
    for tenant, model, endpoint, status, latency, ttft, prompt, completion in batch:
        requests[tenant, model, endpoint, status] += 1
        latencies[tenant, model].append(latency)
        if ttft is not None:
            ttfts[tenant, model].append(ttft)
        if prompt or completion:
            tokens[tenant, model, "prompt"] += prompt
            tokens[tenant, model, "completion"] += completion
    for labels, n in requests.items():
        child(REQUESTS, *labels).inc(n)
    for labels, n in tokens.items():
        child(TOKENS, *labels).inc(n)
    for labels, values in latencies.items():
        _observe_all(child(LATENCY, *labels), values)
    for labels, values in ttfts.items():
        _observe_all(child(TTFT, *labels), values)
    for model, n in list(in_flight.items()):
        if _in_flight_shown.get(model) != n:
            child(IN_FLIGHT, model).set(n)
            _in_flight_shown[model] = n


def _observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for every value, with one update per bucket. (The client
    keeps per-bucket counts, each observation in the first bucket that holds it; these are
    its own attributes, stable across its releases and covered by tests/gateway.)"""
    bounds = histogram._upper_bounds
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect_left(bounds, value)] += 1
    for bucket, n in zip(histogram._buckets, counts, strict=True):
        if n:
            bucket.inc(n)
    histogram._sum.inc(sum(values))


class _Fixed:
    """A collector of metric families made elsewhere (here: from Redis)."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def demand_stats(stats: dict[bytes, bytes]) -> bytes:
    """The worker's on-demand counters (``core.keyspace.demand_stats_key``: evictions,
    starts and their seconds from the decision to ready, per model) as metrics text."""
    evictions = CounterMetricFamily(
        "tollgate_demand_evictions",
        "On-demand models put to sleep to make room for another.",
        labels=["model"],
    )
    ready = SummaryMetricFamily(
        "tollgate_demand_time_to_ready_seconds",
        "On-demand starts: seconds from the decision to start to a ready engine.",
        labels=["model"],
    )
    values = {k.decode(): float(v) for k, v in stats.items()}
    for field, value in sorted(values.items()):
        kind, _, model = field.partition(":")
        if kind == "evictions":
            evictions.add_metric([model], value)
        elif kind == "starts":
            ready.add_metric([model], value, values.get(f"ready_seconds:{model}", 0.0))
    registry = CollectorRegistry()
    registry.register(_Fixed([evictions, ready]))
    return generate_latest(registry)


_LEDGER_KINDS = ("prompt", "cached", "generation")


def engine_ledger_stats(stats: dict[bytes, bytes]) -> bytes:
    """The bill's check against each engine (``core.keyspace.engine_ledger_stats_key``,
    written by the worker: metering/engine_ledger.py) as metrics text: per replica, the last
    24 hours' tokens the engine counted, Tollgate billed, and the drift between them."""
    labels = ["deployment", "replica", "kind"]
    families = {
        "engine": GaugeMetricFamily(
            "tollgate_engine_ledger_engine_tokens",
            "Tokens the engine's own counters counted in compared stretches, last 24 h.",
            labels=labels,
        ),
        "billed": GaugeMetricFamily(
            "tollgate_engine_ledger_billed_tokens",
            "Tokens Tollgate billed for the engine's requests in compared stretches, last 24 h.",
            labels=labels,
        ),
        "drift": GaugeMetricFamily(
            "tollgate_engine_ledger_drift_tokens",
            "Engine tokens minus billed ones beyond the allowances, last 24 h (0: the bill holds).",
            labels=labels,
        ),
    }
    restarts = GaugeMetricFamily(
        "tollgate_engine_ledger_uncompared_stretches",
        "Stretches not compared exactly in the last 24 h (an engine restart, preemptions, ...).",
        labels=["deployment", "replica"],
    )
    counters = GaugeMetricFamily(
        "tollgate_engine_ledger_counters_available",
        "1: the engine exports the token counters the bill is checked against; 0: it does not.",
        labels=["deployment", "replica"],
    )
    checked = GaugeMetricFamily(
        "tollgate_engine_ledger_last_checkpoint_timestamp_seconds",
        "When the bill and the engine were last compared (Unix seconds).",
        labels=["deployment", "replica"],
    )
    for raw in stats.values():
        entry = orjson.loads(raw)
        where = [str(entry["deployment"]), str(entry["replica"])]
        counters.add_metric(where, 1.0 if entry.get("counters") else 0.0)
        if entry.get("checked_at"):
            checked.add_metric(where, float(entry["checked_at"]))
        restarts.add_metric(where, float(entry.get("restarts", 0) + entry.get("inexact", 0)))
        for source, family in families.items():
            for kind in _LEDGER_KINDS:
                family.add_metric([*where, kind], float(entry.get(f"{source}_{kind}", 0)))
    registry = CollectorRegistry()
    registry.register(_Fixed([*families.values(), restarts, counters, checked]))
    return generate_latest(registry)


def render() -> tuple[bytes, str]:
    """The metrics page of this process, or of all processes in multiprocess mode."""
    flush()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
