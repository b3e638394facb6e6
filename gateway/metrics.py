"""Prometheus metrics of the gateway, labelled by tenant and model.

Updated once per request (never per streamed chunk). With several worker processes,
set ``PROMETHEUS_MULTIPROC_DIR`` so ``/metrics`` sums every process.
"""

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter(
    "tollgate_requests_total", "Requests through the gateway.", ["tenant", "model", "endpoint", "status"]
)
TOKENS = Counter("tollgate_tokens_total", "Tokens billed.", ["tenant", "model", "kind"])
REJECTIONS = Counter(
    "tollgate_rejections_total", "Requests refused before reaching an engine.", ["tenant", "reason"]
)
LATENCY = Histogram(
    "tollgate_request_duration_seconds", "Time from request to last byte.", ["tenant", "model"],
    buckets=LATENCY_BUCKETS,
)
TTFT = Histogram(
    "tollgate_time_to_first_token_seconds", "Time from request to first streamed token.",
    ["tenant", "model"], buckets=LATENCY_BUCKETS,
)
IN_FLIGHT = Gauge(
    "tollgate_in_flight_requests", "Requests being served, per model.", ["model"],
    multiprocess_mode="livesum",
)
QUEUE_DEPTH = Gauge(
    "tollgate_queue_depth", "Requests waiting for an engine slot.", ["priority", "tenant"],
    multiprocess_mode="livesum",
)
QUEUE_WAIT = Histogram(
    "tollgate_queue_wait_seconds", "Time requests waited for an engine slot.", ["priority", "tenant"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
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


def render() -> tuple[bytes, str]:
    """The metrics page of this process, or of all processes in multiprocess mode."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
